"""When a run stops before its last step: a non-finite loss or gradient norm (an error, nothing saved),
preemption (SIGUSR1 or the preemption file) or train.stop_after (both checkpointed by the loop), or early
stopping on the held-out loss (checkpointed and exported); and which evaluated step is the best."""

from __future__ import annotations

import math
import os
import signal

import torch
import torch.distributed as dist

from common.checkpoint import CheckpointNotWritten
from common.config import Config
from common.optim import NonFiniteGradients


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


class StopRules:
    """A context manager around the training loop. after_step() says whether to stop after this step, the
    same on every rank; a stop for a bad step, or a checkpoint that could not be written, leaves the loop
    as one line (SystemExit) that names the step."""

    def __init__(self, cfg: Config, start_step: int, device: torch.device, resumed: dict | None = None):
        """`resumed`: the train_state of the checkpoint this run resumed from, which holds the best step
        and the patience spent so far."""
        self.stop_after, self.last_step = cfg.train.stop_after, cfg.train.steps
        self.patience, self.threshold = cfg.eval.early_stopping_patience, cfg.eval.early_stopping_threshold
        self.checkpoint_interval = cfg.checkpoint.interval
        self.start_step, self.device = start_step, device
        self.preemption = PreemptionWatch()
        self.step = start_step + 1  # the step being trained
        saved = (resumed or {}).get("best", {})
        self.best_step, self.best_eval_loss = saved.get("step"), saved.get("eval_loss")
        self.lowest_eval_loss = saved.get("lowest_eval_loss", self.best_eval_loss)
        self.evals_without_improvement = saved.get("evals_without_improvement", 0)

    def state_dict(self) -> dict:
        """For train_state.json: the best step (which keep_latest never prunes), the lowest eval_loss of
        any evaluation and the patience spent."""
        best = dict(
            step=self.best_step, eval_loss=self.best_eval_loss, lowest_eval_loss=self.lowest_eval_loss
        )
        return {"best": {**best, "evals_without_improvement": self.evals_without_improvement}}

    def after_eval(self, step: int, eval_loss: float) -> str | None:
        """Track the best step; "early stopping" once eval.early_stopping_patience evaluations in a row
        fell by no more than eval.early_stopping_threshold from the lowest eval_loss. The evaluation before
        training (step 0) is a baseline: it counts for neither, as in the Trainer.

        The best step is the Trainer's best_model_checkpoint: a step it saves at (a multiple of
        checkpoint.interval, or the last) whose eval_loss is below every earlier evaluation's. An evaluation
        between checkpoints can be the lowest and has no checkpoint, so it moves the best step nowhere, and
        later checkpoints must beat it. With no such step, the Trainer keeps the weights it ends with, which
        are the checkpoint of the step the run ends at."""
        if step == 0:
            return None
        improved = self.lowest_eval_loss is None or self.lowest_eval_loss - eval_loss > self.threshold
        self.evals_without_improvement = 0 if improved else self.evals_without_improvement + 1
        lowest = self.lowest_eval_loss is None or eval_loss < self.lowest_eval_loss
        self.lowest_eval_loss = eval_loss if lowest else self.lowest_eval_loss
        saved = step == self.last_step or (self.checkpoint_interval and step % self.checkpoint_interval == 0)
        if lowest and saved:
            self.best_step, self.best_eval_loss = step, eval_loss
        stopping = self.patience and self.evals_without_improvement >= self.patience and step < self.last_step
        if self.best_step is None and (stopping or step == self.last_step):
            self.best_step, self.best_eval_loss = step, eval_loss  # the run's own last weights
        return "early stopping" if stopping else None

    def after_step(self, step: int, loss: float) -> str | None:
        """None to go on, or why the run stops after this step, short of the last one: "preempted" or
        "train.stop_after"."""
        # One verdict for all ranks: a loss poisoned on one rank alone (a bad device, say) must stop the
        # others too, not leave them waiting in the next collective until the timeout.
        bad_loss, preempted = on_any_rank(
            [not math.isfinite(loss), self.preemption.requested_here()], self.device
        )
        if bad_loss:
            shown = loss if not math.isfinite(loss) else "not finite on another rank"
            raise SystemExit(
                f"loss is {shown} at step {step}; stopping without saving, the last checkpoint is "
                f"intact ({what_to_try(step, 'train.lr or train.max_grad_norm')})"
            )
        self.step = step + 1
        if step >= self.last_step:
            return None
        if preempted:
            return "preempted"
        if self.stop_after and step - self.start_step >= self.stop_after:
            return "train.stop_after"
        return None

    def __enter__(self) -> StopRules:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if isinstance(exc, NonFiniteGradients):
            raise SystemExit(
                f"gradient norm is {exc.norm} at step {self.step}; stopping before the optimizer step, "
                f"without saving: the last checkpoint is intact ({what_to_try(self.step, 'train.lr')})"
            ) from None
        if isinstance(exc, CheckpointNotWritten):
            raise SystemExit(str(exc)) from None


def what_to_try(step: int, keys: str) -> str:
    """Before any update (step 1) the learning rate played no part: the model's own numerics on this batch."""
    if step == 1:
        return "at step 1, before any update, so not the learning rate: the model's own numbers on this batch"
    return f"try a lower {keys}"
