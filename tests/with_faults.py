"""Test-only: crash-recovery faults, injected into a training recipe from the outside.

    FSDP2_RECIPES_FAULT=kill@13:1 torchrun --nproc_per_node=2 tests/with_faults.py scripts/pretrain_fsdp.py

FSDP2_RECIPES_FAULT is `<point>@<step>[:<rank>]`: kill (after the step's update), save (inside its checkpoint
write, before the rename: sync or background), export (inside the final export after that step: its files
written, not yet indexed or renamed into place), write (inside the export's writes after that step: one
region written, the next not; common/safetensors_writer.py's write_regions), full (the export's free-space
check passes, then another writer fills the disk but 64 KiB: common/export_check.py; full@0 for a
conversion into a directory named export), hang, nan (poisons the loss), grad (makes the step's gradients
NaN while its loss stays finite), read (the resume's DCP read of checkpoint step-N fails with an I/O
timeout, ETIMEDOUT, as a network filesystem's would), or rename (`rename@K`: inside the K-th filesystem
operation of moving the export into place, common/export.py:move_into_place: before a rename, or after the
first file of a removal). Each fires once per run directory, so a job that restarts gets past it. The
patches wrap the loop helper's after_step, gradient clipping, DCP's save calls, FileSystemReader.read_data,
the export's writer and free-space check, and the export's move_into_place with the os.replace and
shutil.rmtree it calls, before the script runs. Never imported by scripts/ or common/.
"""

from __future__ import annotations

import errno
import math
import os
import re
import runpy
import shutil
import signal
import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import export, export_check, optim  # noqa: E402
from common.ops.stopping import StopRules  # noqa: E402
from common.safetensors_writer import SafetensorsInPlace  # noqa: E402

SPEC = os.environ.get("FSDP2_RECIPES_FAULT", "")
FAULT = re.fullmatch(r"(kill|save|export|write|full|hang|nan|grad|read|rename)@(\d+)(?::(\d+))?", SPEC)
RUN = {"dir": None, "step": None}  # the run directory and the step being trained, from the loop helper
MOVING = {"dir": None, "operations": 0}  # the export's run directory while move_into_place runs
IN_WRITE = re.compile(r"step-(\d+)\.tmp$")
IN_EXPORT = re.compile(r"export\.tmp$")
CHECKPOINT = re.compile(r"step-(\d+)$")


def fires(kind: str, step: int, run_dir: str) -> bool:
    """Whether the fault is `kind` at `step` on this rank, and has not fired in this run directory yet."""
    if not FAULT or FAULT[1] != kind or int(FAULT[2]) != step:
        return False
    rank = dist.get_rank() if dist.is_initialized() else 0
    if FAULT[3] is not None and int(FAULT[3]) != rank:
        return False
    marker = os.path.join(run_dir, f".fault-{SPEC.replace(':', '-')}-rank{rank}")
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def stop_rules_init(self, cfg, start_step, *args, _original=StopRules.__init__) -> None:
    _original(self, cfg, start_step, *args)
    RUN.update(dir=cfg.checkpoint.dir, step=start_step + 1)


def after_step(self, step: int, loss: float, _original=StopRules.after_step):
    if fires("hang", step, RUN["dir"]):
        signal.pause()
    if fires("kill", step, RUN["dir"]):
        os.kill(os.getpid(), signal.SIGKILL)
    if fires("nan", step, RUN["dir"]):
        loss = math.nan
    RUN["step"] = step + 1
    return _original(self, step, loss)


def clip_grad_norm_(parameters, max_norm: float, _original=optim.clip_grad_norm_) -> float:
    parameters = list(parameters)
    if RUN["step"] is not None and fires("grad", RUN["step"], RUN["dir"]):
        for param in parameters:
            if param.grad is not None:
                param.grad.fill_(math.nan)
    return _original(parameters, max_norm)


def killed_inside_write(save):
    """DCP's save or async_save, and then, for the write named in the fault, the kill: the write (or its
    background thread) is done or under way, and the checkpoint or export not yet renamed into place."""

    def wrapper(*args, **kwargs):
        result = save(*args, **kwargs)
        writer = kwargs.get("storage_writer")
        path = str(getattr(writer, "path", ""))
        run_dir, match = os.path.dirname(os.path.dirname(path)), IN_WRITE.search(path)
        if match and fires("save", int(match[1]), run_dir):
            os.kill(os.getpid(), signal.SIGKILL)
        if IN_EXPORT.search(path) and RUN["step"] and fires("export", RUN["step"] - 1, run_dir):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return wrapper


def killed_mid_write(write_regions):
    """SafetensorsInPlace.write_regions, which for the export in the fault writes one region, then dies."""

    def wrapper(self, items):
        run_dir = os.path.dirname(str(self.path))
        if IN_EXPORT.search(str(self.path)) and RUN["step"] and fires("write", RUN["step"] - 1, run_dir):
            items = first_then_kill(items)
        return write_regions(self, items)

    return wrapper


def first_then_kill(items):
    for i, item in enumerate(items):
        if i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        yield item


def filled_after_the_check(check_free_space):
    """export_check.check_free_space, after which, for the export in the fault, the disk is filled."""

    def wrapper(path: str, needed: int) -> None:
        check_free_space(path, needed)
        run_dir = os.path.dirname(path)
        step = RUN["step"] - 1 if RUN["step"] else 0  # 0: scripts/convert_to_hf.py, which trains no step
        if IN_EXPORT.search(path) and fires("full", step, run_dir):
            free = shutil.disk_usage(run_dir).free
            with open(os.path.join(os.path.dirname(run_dir), "another-job"), "wb") as f:
                f.write(bytes(free - 65536))  # room for the files' headers, not their tensors

    return wrapper


def timed_out_read(read_data):
    """FileSystemReader.read_data, which for the checkpoint in the fault raises a transient error first."""

    def wrapper(self, *args, **kwargs):
        path = str(self.path)
        match = CHECKPOINT.search(path)
        if match and fires("read", int(match[1]), os.path.dirname(os.path.dirname(path))):
            raise OSError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT))
        return read_data(self, *args, **kwargs)

    return wrapper


def export_moved_into_place(move):
    """export.move_into_place for the export: counts the renames and removals it makes (below)."""

    def wrapper(tmp: str, final: str) -> None:
        MOVING.update(dir=os.path.dirname(final), operations=0)
        try:
            move(tmp, final)
        finally:
            MOVING["dir"] = None

    return wrapper


def killed_inside(operation, removal: bool):
    """os.replace or shutil.rmtree, killed inside the K-th call of move_into_place: a rename not made yet,
    or a removal with one file gone (a preemption in the middle of it)."""

    def wrapper(path, *args, **kwargs):
        if MOVING["dir"] is not None:
            MOVING["operations"] += 1
            if fires("rename", MOVING["operations"], MOVING["dir"]):
                if removal and os.path.isdir(path):
                    os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
                os.kill(os.getpid(), signal.SIGKILL)
        return operation(path, *args, **kwargs)

    return wrapper


if __name__ == "__main__":
    StopRules.__init__, StopRules.after_step = stop_rules_init, after_step
    optim.clip_grad_norm_ = clip_grad_norm_  # before the script imports it
    dcp.save, dcp.async_save = killed_inside_write(dcp.save), killed_inside_write(dcp.async_save)
    dcp.FileSystemReader.read_data = timed_out_read(dcp.FileSystemReader.read_data)
    SafetensorsInPlace.write_regions = killed_mid_write(SafetensorsInPlace.write_regions)
    export_check.check_free_space = filled_after_the_check(export_check.check_free_space)
    export.move_into_place = export_moved_into_place(export.move_into_place)  # not a checkpoint's
    os.replace, shutil.rmtree = killed_inside(os.replace, False), killed_inside(shutil.rmtree, True)
    sys.argv = sys.argv[1:]  # the script to run, then its own arguments
    runpy.run_path(sys.argv[0], run_name="__main__")
