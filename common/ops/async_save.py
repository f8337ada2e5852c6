"""checkpoint.async_save: DCP writes a checkpoint in a background thread while training goes on. The
checkpoint is completed (step-N.tmp renamed to step-N) once every rank's write is done, one write at a
time, and a run that ends waits for its last one."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from common.checkpoint import (
    CheckpointNotWritten,
    begin_save,
    complete_save,
    model_and_optimizer_tensors,
    own_rng_key,
)
from common.ops.metrics import MetricsLogger, checkpoint_record
from common.optim import NonFiniteGradients


@dataclass
class Writing:
    final: str  # checkpoints/step-N, written as step-N.tmp
    step: int
    future: Future
    finish: tuple  # complete_save's train_state, model config, tokenizer, keep_latest
    stall_s: float  # what training waited for: the previous write, then the copy to host memory


class BackgroundSaves:
    """A context manager around the training loop; start() a write, finish_if_written() after each step."""

    def __init__(self, logger: MetricsLogger):
        self.logger = logger
        self.writing: Writing | None = None
        self.group: dist.ProcessGroup | None = None

    def start(
        self,
        run_dir: str,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: dict,
        keep_latest: int,
        tokenizer=None,
    ) -> None:
        """Copy the training state to host memory and write it in the background; training goes on."""
        started = time.perf_counter()
        if self.writing is not None:  # one write at a time
            self._finish(wait=True)
        final = begin_save(run_dir, step)
        state, _ = model_and_optimizer_tensors(model, optimizer, own_rng_key())
        if self.group is None:  # the writes' collectives run beside training's, so not in its group
            self.group = dist.new_group(backend="gloo")
        # One writer thread: DCP's extra threads report a failed write only to threading.excepthook, which
        # cannot be scoped to a write that outlives this call; in the writing thread it reaches the future.
        writer = dcp.FileSystemWriter(f"{final}.tmp", thread_count=1)
        future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        finish = (train_state, model.config, tokenizer, keep_latest)
        self.writing = Writing(final, step, future, finish, time.perf_counter() - started)

    def finish_if_written(self) -> None:
        """Complete the checkpoint if every rank's write is done. Collective: every rank calls it."""
        if self.writing is not None:
            self._finish(wait=False)

    def _finish(self, wait: bool) -> None:
        if not wait:
            writing = torch.tensor(0.0 if self.writing.future.done() else 1.0)  # gloo: a CPU tensor
            dist.all_reduce(writing, op=dist.ReduceOp.MAX)
            if writing.item():
                return
        errors = []
        try:
            self.writing.future.result()
        except (Exception, CheckpointException) as failed:  # DCP's is a BaseException
            errors.append(failed)
        path = complete_save(self.writing.final, errors, *self.writing.finish)
        step, stall = self.writing.step, self.writing.stall_s
        self.logger.log(checkpoint_record(step, path, stall_s=stall, **{"async": True}))
        self.writing = None

    def __enter__(self) -> BackgroundSaves:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        # A run that ends waits for its last write, unless a rank failed alone (an out-of-memory error,
        # say): the others could then wait forever in the collective that completes it.
        if self.writing is not None and (exc is None or isinstance(exc, (NonFiniteGradients, SystemExit))):
            try:
                self._finish(wait=True)
            except CheckpointNotWritten as failed:
                raise SystemExit(str(failed)) from None
