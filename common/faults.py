"""Test hooks for crash recovery, off unless FSDP2_RECIPES_FAULT is `<point>@<step>[:<rank>]`: kill (after
the step's update), save (inside its checkpoint write, before the rename), hang, or nan (poisons the loss).
Each fires once per run directory, so a job that restarts gets past it."""

from __future__ import annotations

import os
import re
import signal

import torch.distributed as dist


def inject_fault(step: int, run_dir: str, during_save: bool = False) -> bool:
    """Fire the fault set for this step, if any; True means "treat the loss as NaN"."""
    spec = os.environ.get("FSDP2_RECIPES_FAULT", "")
    match = re.fullmatch(r"(kill|save|hang|nan)@(\d+)(?::(\d+))?", spec)
    if not match or int(match[2]) != step or (match[1] == "save") != during_save:
        return False
    if match[3] is not None and int(match[3]) != dist.get_rank():
        return False
    marker = os.path.join(run_dir, f".fault-{spec.replace(':', '-')}-rank{dist.get_rank()}")
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    if match[1] == "nan":
        return True
    if match[1] == "hang":
        signal.pause()
    os.kill(os.getpid(), signal.SIGKILL)
    return False
