"""Around a training run's steps: preemption, the shared-storage check, the bookkeeping after each step."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.checkpoint import (
    CheckpointNotWritten,
    finish_async_save,
    save_checkpoint,
    start_async_save,
)
from common.config import Config, ConfigError
from common.faults import arm_gradient_fault, inject_fault
from common.mesh import gather
from common.metrics import GIB, CommCounter, MetricsLogger, StepTimer, peak_memory_bytes
from common.optim import NonFiniteGradients
from common.profiling import StepDiagnostics


class PreemptionWatch:
    """Asks for a checkpoint-and-exit on SIGUSR1, or once the file FSDP2_RECIPES_PREEMPT_FILE exists (Slurm
    signals the batch shell, which creates it: torchrun's agent dies on SIGUSR1 instead of forwarding it)."""

    def __init__(self):
        self.signalled = False
        self.file = os.environ.get("FSDP2_RECIPES_PREEMPT_FILE")
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def requested_here(self) -> bool:
        return self.signalled or bool(self.file and os.path.exists(self.file))


def on_any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Whether any rank raised each flag, in one all-reduce: every rank then takes the same decision."""
    if not dist.is_initialized():  # one PyTorch/XLA host: nobody to agree with
        return flags
    raised = torch.tensor([float(flag) for flag in flags], device=device)
    dist.all_reduce(raised, op=dist.ReduceOp.MAX)
    return [bool(value) for value in raised.tolist()]


def check_shared_storage(run_dir: str) -> None:
    """Every rank must see what rank 0 writes to the run directory, or checkpoints cannot be resumed."""
    token = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
    path = os.path.join(run_dir, ".shared-storage-check")
    if dist.get_rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(token[0])
    dist.broadcast_object_list(token, src=0)
    seen = False
    with contextlib.suppress(OSError), open(path) as f:
        seen = f.read() == token[0]
    unseen = torch.tensor(0.0 if seen else 1.0)  # a CPU tensor: gloo carries it, also beside NCCL
    dist.all_reduce(unseen)
    if unseen.item():
        raise ConfigError(
            f"checkpoint.dir {run_dir!r} is not shared: {int(unseen.item())} rank(s) cannot see "
            f"what rank 0 writes there; put it on storage every node mounts"
        )


@dataclass(eq=False)
class Bookkeeping:
    """After each optimizer step: log when due, stop on a non-finite loss, and checkpoint every
    checkpoint.interval steps, at the end, and on an early stop (preemption, train.stop_after), in the
    background with checkpoint.async_save (published once written, awaited at the end). A context
    manager around the loop: it also counts collectives (metrics.comm_stats) and runs StepDiagnostics."""

    cfg: Config
    logger: MetricsLogger
    start_step: int
    device: torch.device
    timer: StepTimer
    _: KW_ONLY
    model: Any
    optimizer: Any
    scheduler: Any
    data: Any
    tokenizer: Any
    save: Callable[..., str] = save_checkpoint  # PyTorch/XLA has its own

    def __post_init__(self):
        self.preemption = PreemptionWatch()
        self.comm = CommCounter()
        self.stopped = False
        self.pending, self.pending_stall = None, 0.0  # a checkpoint written in the background
        self.step = self.start_step + 1  # the step being trained
        self._around_loop = contextlib.ExitStack()

    def __enter__(self) -> Bookkeeping:
        if self.cfg.metrics.comm_stats:
            self._around_loop.enter_context(self.comm.patch())
        self.diagnostics = self._around_loop.enter_context(StepDiagnostics(self.cfg, self.device, self.step))
        arm_gradient_fault(self.step, self.cfg.checkpoint.dir, self.model)
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self._around_loop.__exit__(exc_type, exc, traceback)
        # A run that ends waits for its last background write, unless a rank failed alone (an out-of-memory
        # error, say): the others could then wait forever in the collective that publishes it.
        if self.pending is not None and (exc is None or isinstance(exc, (NonFiniteGradients, SystemExit))):
            try:
                self._publish(wait=True)
            except CheckpointNotWritten as failed:
                raise SystemExit(str(failed)) from None
        if isinstance(exc, NonFiniteGradients):
            raise SystemExit(
                f"gradient norm is {exc.norm} at step {self.step}; stopping before the optimizer step, "
                f"without saving: the last checkpoint is intact (try a lower train.lr)"
            ) from None
        if isinstance(exc, CheckpointNotWritten):
            raise SystemExit(str(exc)) from None

    def after_step(self, step: int, stats: dict, tokens: int) -> bool:
        """`stats`: the step's loss and other numbers to log. True: stop here (the checkpoint is written)."""
        t, run_dir = self.cfg.train, self.cfg.checkpoint.dir
        for event in self.diagnostics.after(step):
            self.logger.log(event)
        if inject_fault(step, run_dir):
            stats["loss"] = math.nan
        # One verdict for all ranks: a loss poisoned on one rank alone (a fault, a bad device) must stop
        # the others too, not leave them waiting in the next collective until the timeout.
        bad_loss, preempted = on_any_rank(
            [not math.isfinite(stats["loss"]), self.preemption.requested_here()], self.device
        )
        if bad_loss:
            loss = stats["loss"] if not math.isfinite(stats["loss"]) else "not finite on another rank"
            raise SystemExit(
                f"loss is {loss} at step {step}; stopping without saving, the last checkpoint is "
                f"intact (try a lower train.lr or train.max_grad_norm)"
            )
        if self.pending is not None:
            self._publish(wait=False)
        self.timer.add(tokens)
        if step % self.cfg.metrics.log_every == 0 or step in (self.start_step + 1, t.steps):
            record = {"step": step, **stats, **self.timer.record(step - self.start_step)}
            record["peak_mem_gib"] = peak_memory_bytes(self.device) / GIB
            if self.cfg.metrics.comm_stats:
                record.update(self.comm.reset())
            self.logger.log(record)
        stopping = preempted or bool(t.stop_after and step - self.start_step >= t.stop_after)
        interval = self.cfg.checkpoint.interval
        if (interval and step % interval == 0) or step == t.steps or stopping:
            self._checkpoint(step, stats)
        self.stopped = stopping and step < t.steps
        self.step = step + 1
        arm_gradient_fault(self.step, run_dir, self.model)
        if self.stopped:
            reason = "preempted" if preempted else "train.stop_after"
            self.logger.log({"event": "stopped", "step": step, "reason": reason})
        elif step < t.steps:
            self.diagnostics.before(self.step)
        return self.stopped

    def _checkpoint(self, step: int, stats: dict) -> None:
        """Save now, or (checkpoint.async_save) start a background write, after the previous one is done."""
        started, c = time.perf_counter(), self.cfg.checkpoint
        state = {
            "step": step,
            "samples": stats["samples"],  # the global data position, the same on any world size
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "loss": stats["loss"],
            "scheduler": self.scheduler.state_dict(),
            "data": gather(self.data.state_dict()),
        }
        args = (c.dir, step, self.model, self.optimizer, state, c.keep_latest, self.tokenizer)
        if not c.async_save:
            path = self.save(*args)
            self.logger.log(
                {"event": "checkpoint", "step": step, "path": path, "stall_s": time.perf_counter() - started}
            )
            return
        if self.pending is not None:  # one write at a time
            self._publish(wait=True)
        self.pending = start_async_save(*args)
        self.pending_stall = time.perf_counter() - started  # what training waited: the copy to host memory

    def _publish(self, wait: bool) -> None:
        path = finish_async_save(self.pending, wait)
        if path is not None:
            step, stall = self.pending.step, self.pending_stall
            self.logger.log(
                {"event": "checkpoint", "step": step, "path": path, "stall_s": stall, "async": True}
            )
            self.pending = None
