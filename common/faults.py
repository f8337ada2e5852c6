"""Test hooks for crash recovery, off unless FSDP2_RECIPES_FAULT is `<point>@<step>[:<rank>]`: kill (after
the step's update), save (inside its checkpoint write, before the rename), hang, nan (poisons the loss), or
grad (makes the step's gradients NaN while its loss stays finite). Each fires once per run directory, so a
job that restarts gets past it."""

from __future__ import annotations

import math
import os
import re
import signal

import torch
import torch.distributed as dist


def _fires(step: int, run_dir: str, kinds: tuple[str, ...]) -> str | None:
    spec = os.environ.get("FSDP2_RECIPES_FAULT", "")
    match = re.fullmatch(r"(kill|save|hang|nan|grad)@(\d+)(?::(\d+))?", spec)
    if not match or match[1] not in kinds or int(match[2]) != step:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    if match[3] is not None and int(match[3]) != rank:
        return None
    marker = os.path.join(run_dir, f".fault-{spec.replace(':', '-')}-rank{rank}")
    if os.path.exists(marker):
        return None
    open(marker, "w").close()
    return match[1]


def inject_fault(step: int, run_dir: str, during_save: bool = False) -> bool:
    """Fire the fault set for this step, if any; True means "treat the loss as NaN"."""
    kind = _fires(step, run_dir, ("save",) if during_save else ("kill", "hang", "nan"))
    if kind == "hang":
        signal.pause()
    if kind in ("kill", "save", "hang"):
        os.kill(os.getpid(), signal.SIGKILL)
    return kind == "nan"


def arm_gradient_fault(step: int, run_dir: str, model: torch.nn.Module) -> None:
    """For `grad@<step>`: that step's first forward makes the logits' gradient, and so every parameter's,
    NaN; the loss stays finite."""
    if _fires(step, run_dir, ("grad",)) is None:
        return

    def poison(module, args, output):
        handle.remove()
        output.register_hook(lambda grad: torch.full_like(grad, math.nan))

    handle = model.get_output_embeddings().register_forward_hook(poison)
