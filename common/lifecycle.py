"""What a training run does around its steps: stop early when asked, check that every node sees the run
directory, and the bookkeeping after each step that both training scripts share."""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections.abc import Callable

import torch
import torch.distributed as dist

from common.checkpoint import save_checkpoint
from common.config import Config, ConfigError
from common.faults import inject_fault
from common.mesh import gather
from common.metrics import GIB, CommCounter, MetricsLogger, StepTimer, peak_memory_bytes


class PreemptionWatch:
    """Asks for a checkpoint-and-exit at the next step boundary.

    Two triggers: SIGUSR1 delivered to a training process, or the file named by FSDP2_RECIPES_PREEMPT_FILE
    appearing. Slurm signals the batch shell (`--signal=B:USR1@120`), which creates that file, because
    torchrun's agent dies on SIGUSR1 instead of forwarding it. Ranks agree through one all-reduce per step.
    """

    def __init__(self, device: torch.device):
        self.device, self.signalled = device, False
        self.file = os.environ.get("FSDP2_RECIPES_PREEMPT_FILE")
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def requested(self) -> bool:
        local = self.signalled or bool(self.file and os.path.exists(self.file))
        if not dist.is_initialized():  # one PyTorch/XLA host: nobody to agree with
            return local
        flag = torch.tensor(float(local), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def check_shared_storage(run_dir: str) -> None:
    """Every rank must see what rank 0 writes to the run directory, or checkpoints cannot be resumed."""
    token = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
    path = os.path.join(run_dir, ".shared-storage-check")
    if dist.get_rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(token[0])
    dist.broadcast_object_list(token, src=0)
    try:
        with open(path) as f:
            seen = f.read() == token[0]
    except OSError:
        seen = False
    unseen = torch.tensor(0.0 if seen else 1.0)  # a CPU tensor: gloo carries it, also beside NCCL
    dist.all_reduce(unseen)
    if unseen.item():
        raise ConfigError(
            f"checkpoint.dir {run_dir!r} is not shared: {int(unseen.item())} rank(s) cannot see "
            f"what rank 0 writes there; put it on storage every node mounts"
        )


class Bookkeeping:
    """After each optimizer step: log when due, stop on a non-finite loss, and checkpoint every
    checkpoint.interval steps, at the end, and when the run must stop early (preemption, train.stop_after).
    Used as `with Bookkeeping(...) as book:` around the loop, which counts collectives when
    metrics.comm_stats is on."""

    def __init__(
        self,
        cfg: Config,
        logger: MetricsLogger,
        start_step: int,
        device: torch.device,
        timer: StepTimer,
        *,
        model,
        optimizer,
        scheduler,
        data,
        tokenizer,
        save: Callable[..., str] = save_checkpoint,
    ):
        self.cfg, self.logger, self.timer, self.start_step = cfg, logger, timer, start_step
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.data, self.tokenizer, self.save = data, tokenizer, save  # `save`: PyTorch/XLA has its own
        self.device = device
        self.preemption = PreemptionWatch(self.device)  # SIGUSR1 or the Slurm batch script's request file
        self.comm = CommCounter()
        self.stopped = False
        self._counting = contextlib.ExitStack()

    def __enter__(self) -> Bookkeeping:
        if self.cfg.metrics.comm_stats:
            self._counting.enter_context(self.comm.patch())
        return self

    def __exit__(self, *exc) -> None:
        self._counting.close()

    def after_step(self, step: int, stats: dict, tokens: int) -> bool:
        """`stats`: the step's loss and other numbers to log; `tokens`: what tokens/s counts. Returns True
        when the run must stop here (its checkpoint is written)."""
        t, run_dir = self.cfg.train, self.cfg.checkpoint.dir
        # test hook (FSDP2_RECIPES_FAULT); kills or hangs, or poisons the loss
        if inject_fault(step, run_dir):
            stats["loss"] = math.nan
        if not math.isfinite(stats["loss"]):
            # Every rank sees the same all-reduced loss, so all stop here, before writing a checkpoint.
            raise SystemExit(
                f"loss is {stats['loss']} at step {step}; stopping without saving, the last checkpoint is "
                f"intact (try a lower train.lr or train.max_grad_norm)"
            )
        self.timer.add(tokens)
        if step % self.cfg.metrics.log_every == 0 or step in (self.start_step + 1, t.steps):
            record = {"step": step, **stats, **self.timer.record(step - self.start_step)}
            record["peak_mem_gib"] = peak_memory_bytes(self.device) / GIB
            if self.cfg.metrics.comm_stats:
                record.update(self.comm.reset())
            self.logger.log(record)
        preempted = self.preemption.requested()
        stopping = preempted or bool(t.stop_after and step - self.start_step >= t.stop_after)
        interval = self.cfg.checkpoint.interval
        if (interval and step % interval == 0) or step == t.steps or stopping:
            self.logger.log({"event": "checkpoint", "step": step, "path": self._save(step, stats)})
        self.stopped = stopping and step < t.steps
        if self.stopped:
            reason = "preempted" if preempted else "train.stop_after"
            self.logger.log({"event": "stopped", "step": step, "reason": reason})
        return self.stopped

    def _save(self, step: int, stats: dict) -> str:
        train_state = {
            "step": step,
            "samples": stats["samples"],  # the global data position: a resume on any world size continues it
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "loss": stats["loss"],
            "scheduler": self.scheduler.state_dict(),
            "data": gather(self.data.state_dict()),
        }
        keep = self.cfg.checkpoint.keep_latest
        return self.save(
            self.cfg.checkpoint.dir, step, self.model, self.optimizer, train_state, keep, self.tokenizer
        )
