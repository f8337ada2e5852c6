"""Resume checkpoints (DCP): save, choose, load. Each is written to `step-N.tmp` and renamed once
complete, so a crash never leaves a half-written one under a final name."""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from common.config import ConfigError
from common.faults import inject_fault
from common.weights import publish, save_config

STEP_DIR = re.compile(r"^step-(\d+)$")
TRAIN_STATE = "train_state.json"
WRITER_THREADS = 4
FULL_BELOW_BYTES = 2**20  # free space under which a failed write counts as a full disk


class CheckpointNotWritten(Exception):
    """A checkpoint write failed on some rank (a full disk, say); raised on every rank, the partial
    directory removed."""


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _steps(root: str) -> list[int]:
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m[1]) for m in map(STEP_DIR.match, names) if m)


def find_resume_checkpoint(run_dir: str, resume: str) -> str | None:
    """`auto`: this run's newest complete checkpoint, if any; `none`: None; else the given path. Rank 0
    decides and every rank takes its choice: ranks listing the directory themselves could disagree (a
    network filesystem's stale view on one node) and load different steps."""
    choice: list = [None, None]  # the path, or the error that stops every rank
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            choice[0] = _resume_checkpoint(run_dir, resume)
        except ConfigError as error:
            choice[1] = str(error)
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[1]:
        raise ConfigError(choice[1])
    return choice[0]


def _resume_checkpoint(run_dir: str, resume: str) -> str | None:
    if resume == "none":
        return None
    if resume != "auto":
        if not os.path.exists(os.path.join(resume, TRAIN_STATE)):
            raise ConfigError(
                f"checkpoint.resume {resume!r} is not a complete checkpoint directory "
                f"(no {TRAIN_STATE}); use auto, none, or a checkpoints/step-N path"
            )
        _start_branch(run_dir, resume)
        return resume
    root = checkpoints_dir(run_dir)
    complete = [s for s in _steps(root) if os.path.exists(os.path.join(root, f"step-{s}", TRAIN_STATE))]
    return os.path.join(root, f"step-{complete[-1]}") if complete else None


def _start_branch(run_dir: str, resume: str) -> None:
    """Resuming from an older step of this run starts a new branch. Its newer checkpoints move aside to
    checkpoints/abandoned-after-step-N[.K]: kept, but invisible to keep_latest (which would prune the new
    branch's checkpoints as the older ones) and to resume=auto (which would pick the abandoned branch)."""
    root = checkpoints_dir(run_dir)
    match = STEP_DIR.match(os.path.basename(os.path.normpath(resume)))
    parent = os.path.dirname(os.path.normpath(resume))
    if not match or not os.path.isdir(root) or not os.path.samefile(parent, root):
        return  # another run's checkpoint
    newer = [f"step-{s}" for s in _steps(root) if s > int(match[1])]
    if not newer:
        return
    aside = base = os.path.join(root, f"abandoned-after-step-{match[1]}")
    branches = 1
    while os.path.exists(aside):  # the same step resumed again, after more training
        branches += 1
        aside = f"{base}.{branches}"
    os.makedirs(aside)
    for name in newer:
        os.replace(os.path.join(root, name), os.path.join(aside, name))
    print(
        f"checkpoint: resuming from step-{match[1]} starts a new branch; moved {', '.join(newer)} to {aside}"
    )


def _rng_key(saved: dict | None = None) -> str:
    """This rank's RNG entry. DCP keeps one copy of a plain tensor that every rank saves under one key
    (measured: rank 1 restored rank 0's state), so each rank saves its own. Resumed on more ranks, a rank
    the checkpoint has no entry for takes rank 0's."""
    own = f"rank{dist.get_rank() if dist.is_initialized() else 0}"
    return own if saved is None or f"rng.{own}.cpu" in saved else "rank0"


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer, rng_key: str) -> tuple[dict, list]:
    """Tensors only: DCP unpickles any non-tensor value on load. param_groups come from the config."""
    optim = get_optimizer_state_dict(model, optimizer)  # allocates the state of a fresh optimizer
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state = {"model": get_model_state_dict(model), "optim": optim["state"], "rng": {rng_key: rng}}
    return state, optim["param_groups"]


def save_checkpoint(
    run_dir: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict,
    keep_latest: int,
    tokenizer=None,
) -> str:
    save, state = _begin_save(run_dir, step, model, optimizer, train_state, keep_latest, tokenizer)
    # DCP's extra writer threads hand an exception only to threading.excepthook, which prints it, and the
    # save then completes without their files: collect those exceptions instead.
    errors, excepthook = [], threading.excepthook
    threading.excepthook = lambda hook: errors.append(hook.exc_value)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(save.tmp, thread_count=WRITER_THREADS))
    except CheckpointException as failed:  # raised on every rank when any rank's own write failed
        errors.append(failed)
    finally:
        threading.excepthook = excepthook
    if not errors:
        inject_fault(step, run_dir, during_save=True)
    return _complete(save, errors)


@dataclass
class PendingSave:
    """A checkpoint being written (in the background with checkpoint.async_save), not yet published."""

    final: str  # checkpoints/step-N, written as step-N.tmp
    step: int
    publish: Callable[[], None]
    future: Future | None = None

    @property
    def tmp(self) -> str:
        return f"{self.final}.tmp"

    @property
    def root(self) -> str:
        return os.path.dirname(self.final)


def _begin_save(
    run_dir: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict,
    keep_latest: int,
    tokenizer,
) -> tuple[PendingSave, dict]:
    root = checkpoints_dir(run_dir)
    final = os.path.join(root, f"step-{step}")
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of a save that crashed
            if name.endswith(".tmp") and STEP_DIR.match(name.removesuffix(".tmp")):
                shutil.rmtree(os.path.join(root, name))
    dist.barrier()
    publish = functools.partial(
        publish_checkpoint, f"{final}.tmp", final, train_state, model.config, tokenizer, keep_latest
    )
    state, _ = _training_state(model, optimizer, _rng_key())
    return PendingSave(final, step, publish), state


def _complete(save: PendingSave, errors: list) -> str:
    """Once every rank's shard is on disk: rank 0 publishes (step-N.tmp -> step-N), or every rank raises."""
    error = _first_on_any_rank(_os_error(errors, save.root))
    if error is None and dist.get_rank() == 0:
        try:
            save.publish()
        except OSError as failed:
            error = failed
    error = _first_on_any_rank(error)
    if error is None:
        return save.final
    if dist.get_rank() == 0:
        shutil.rmtree(save.tmp, ignore_errors=True)
    dist.barrier()
    full = getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    why = f"the disk is full ({error.strerror})" if full else str(error)
    intact = [s for s in _steps(save.root) if s < save.step]
    previous = f"step-{intact[-1]} is intact" if intact else "there is no earlier checkpoint"
    fix = "Free space" if full else "Fix that"
    raise CheckpointNotWritten(
        f"checkpoint step-{save.step} could not be written: {why}, under {save.root}; removed the partial "
        f"{os.path.basename(save.tmp)}, and {previous}. {fix} and rerun the same command to resume"
    ) from None


_ASYNC_GROUP: dict = {}  # the background writes' own gloo group, per default group (tests make several)


def _async_group() -> dist.ProcessGroup:
    """Created on first use, by every rank: the writes' collectives run beside training's, so they must not
    share a group."""
    if _ASYNC_GROUP.get("world") is not dist.group.WORLD:
        _ASYNC_GROUP.update(world=dist.group.WORLD, group=dist.new_group(backend="gloo"))
    return _ASYNC_GROUP["group"]


def start_async_save(
    run_dir: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict,
    keep_latest: int,
    tokenizer=None,
) -> PendingSave:
    """Copy the training state to host memory, then write it in a background thread with DCP's
    async_save; training goes on once the copy is made. Publish with finish_async_save."""
    pending, state = _begin_save(run_dir, step, model, optimizer, train_state, keep_latest, tokenizer)
    # One writer thread: DCP's extra threads report a failed write only to threading.excepthook, which
    # cannot be scoped to a write that outlives this call; in the writing thread it reaches the future.
    writer = dcp.FileSystemWriter(pending.tmp, thread_count=1)
    pending.future = dcp.async_save(state, storage_writer=writer, process_group=_async_group())
    inject_fault(step, run_dir, during_save=True)  # the kill test: the background write is under way
    return pending


def finish_async_save(pending: PendingSave, wait: bool) -> str | None:
    """Publish `pending` once its write has finished on every rank (at once, if `wait`): the path, or
    None while some rank is still writing. Collective: every rank calls it at the same point."""
    if not wait:
        writing = torch.tensor(0.0 if pending.future.done() else 1.0)  # gloo: a CPU tensor, also beside NCCL
        dist.all_reduce(writing, op=dist.ReduceOp.MAX)
        if writing.item():
            return None
    errors = []
    try:
        pending.future.result()
    except (Exception, CheckpointException) as failed:  # DCP's is a BaseException
        errors.append(failed)
    return _complete(pending, errors)


def _os_error(errors: list[Exception], root: str) -> Exception | None:
    """The first OSError behind `errors` (DCP's own failure holds every rank's), else the first error."""
    for failed in errors:
        for value in getattr(failed, "failures", {failed: failed}).values():
            error = value[0] if isinstance(value, tuple) else value
            while error is not None and not isinstance(error, OSError):
                error = error.__cause__ or error.__context__
            if error is not None:
                return error
    # torch.save's zip writer reports a full disk as "unexpected pos N vs M", without the OSError.
    if errors and shutil.disk_usage(root).free < FULL_BELOW_BYTES:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return errors[0] if errors else None


def _first_on_any_rank(error: Exception | None) -> Exception | None:
    """One verdict for all ranks: a write can fail on one rank alone."""
    errors = [None] * dist.get_world_size()
    portable = error if error is None or isinstance(error, OSError) else RuntimeError(str(error))
    dist.all_gather_object(errors, portable)  # DCP's own exception holds tracebacks, which do not pickle
    return next((e for e in errors if e is not None), None)


def publish_checkpoint(
    tmp: str, final: str, train_state: dict, model_config, tokenizer, keep_latest: int
) -> None:
    """Complete `step-N.tmp` (with config and tokenizer, for eval_cp.py), rename it, drop old ones."""
    with open(os.path.join(tmp, TRAIN_STATE), "w") as f:
        json.dump(train_state, f)
    save_config(tmp, model_config, tokenizer)
    publish(tmp, final)
    root = os.path.dirname(final)
    for old in _steps(root)[:-keep_latest]:
        shutil.rmtree(os.path.join(root, f"step-{old}"))


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG in place (DCP reshards); returns train_state."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, param in get_model_state_dict(model).items():  # another model's fails here, not deep in DCP
        entry, here = saved.get(f"model.{name}"), list(param.shape)
        there = list(entry.size) if hasattr(entry, "size") else None
        if there != here:
            raise ConfigError(
                f"checkpoint {path} holds a different model ({name} is {there} there, {here} here); "
                f"use a new checkpoint.dir for this model, or checkpoint.resume=none"
            )
    rng_key = _rng_key(saved)
    state, param_groups = _training_state(model, optimizer, rng_key)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, {"state": state["optim"], "param_groups": param_groups})
    rng = state["rng"][rng_key]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return restore_train_state(path, optimizer, scheduler)


def restore_train_state(path: str, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    with open(os.path.join(path, TRAIN_STATE)) as f:
        train_state = json.load(f)
    scheduler.load_state_dict(train_state["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # load_state_dict restores the schedule, not the lr already applied to the optimizer
    return train_state
