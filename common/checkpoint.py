"""Resume checkpoints (DCP): save and load. Each is written to `step-N.tmp` and renamed once
complete, so a crash never leaves a half-written one under a final name."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from common import manifest
from common.config import ConfigError
from common.export import move_into_place, save_config
from common.mesh import gather_objects

STEP_DIR = re.compile(r"^step-(\d+)$")
# What a checkpoint holds of the model: every weight that trains. A frozen base (LoRA) comes back from
# model.name_or_path, so a LoRA checkpoint holds the adapters alone.
TRAINED = StateDictOptions(ignore_frozen_params=True)
# Loading leaves the frozen weights alone; every trained one is checked against the checkpoint first.
INTO_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)
TRAIN_STATE = "train_state.json"
WRITER_THREADS = 4
FULL_BELOW_BYTES = 2**20  # free space under which a failed write counts as a full disk


class CheckpointNotWritten(Exception):
    """A checkpoint write failed on some rank (a full disk, say); raised on every rank, the partial
    directory removed."""


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def saved_steps(root: str) -> list[int]:
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m[1]) for m in map(STEP_DIR.match, names) if m)


def own_rng_key(saved: dict | None = None) -> str:
    """This rank's RNG entry. DCP keeps one copy of a plain tensor that every rank saves under one key
    (docs/checkpoints.md), so each rank saves its own. Resumed on more ranks, a rank the checkpoint has no
    entry for takes rank 0's."""
    own = f"rank{dist.get_rank() if dist.is_initialized() else 0}"
    return own if saved is None or f"rng.{own}.cpu" in saved else "rank0"


def model_and_optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, key: str
) -> tuple[dict, list]:
    """Tensors only: DCP unpickles any non-tensor value on load. param_groups come from the config."""
    optim = get_optimizer_state_dict(model, optimizer)  # allocates the state of a fresh optimizer
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state = {
        "model": get_model_state_dict(model, options=TRAINED),
        "optim": optim["state"],
        "rng": {key: rng},
    }
    return state, optim["param_groups"]


def train_state(step: int, samples: int, loss: float, scheduler, data, **more) -> dict:
    """What a resume needs besides tensors, written as train_state.json. `samples` is the global data
    position, the same on any world size; `data` is every rank's data state (a stream's position); `more`:
    the stop rules' state, whose best step keep_latest never prunes."""
    return {
        **more,
        "step": step,
        "samples": samples,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "loss": loss,
        "scheduler": scheduler.state_dict(),
        "data": gather_objects(data.state_dict()),
    }


def begin_save(run_dir: str, step: int) -> str:
    """`checkpoints/step-N`, to be written as step-N.tmp; rank 0 removes what a crashed save left."""
    root = checkpoints_dir(run_dir)
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):
            if name.endswith(".tmp") and STEP_DIR.match(name.removesuffix(".tmp")):
                shutil.rmtree(os.path.join(root, name))
    dist.barrier()
    return os.path.join(root, f"step-{step}")


def save_checkpoint(
    run_dir: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict,
    keep_latest: int,
    tokenizer=None,
) -> str:
    """Write step-N.tmp with DCP (each rank its shards), then rank 0 completes and renames it; returns the
    path. A write that fails on any rank raises CheckpointNotWritten on every rank."""
    final = begin_save(run_dir, step)
    state, _ = model_and_optimizer_tensors(model, optimizer, own_rng_key())
    # DCP's extra writer threads hand an exception only to threading.excepthook, which prints it, and the
    # save then completes without their files: collect those exceptions instead.
    errors, excepthook = [], threading.excepthook
    threading.excepthook = lambda hook: errors.append(hook.exc_value)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{final}.tmp", thread_count=WRITER_THREADS))
    except CheckpointException as failed:  # raised on every rank when any rank's own write failed
        errors.append(failed)
    finally:
        threading.excepthook = excepthook
    return complete_save(final, errors, train_state, model.config, tokenizer, keep_latest)


def complete_save(
    final: str, errors: list, train_state: dict, model_config, tokenizer, keep_latest: int
) -> str:
    """Once every rank's shard is on disk, rank 0 finishes the checkpoint; or every rank raises. Each rank
    checksums the files it wrote, for the manifest."""
    tmp, root = f"{final}.tmp", os.path.dirname(final)
    error = _first_on_any_rank(_os_error(errors, root))
    own = [n for n in os.listdir(tmp) if n.startswith(f"__{dist.get_rank()}_")] if error is None else []
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, manifest.file_entries(tmp, own))
    if error is None and dist.get_rank() == 0:
        try:
            known = {name: entry for entries in every for name, entry in entries.items()}
            finish_checkpoint(final, train_state, model_config, tokenizer, keep_latest, known)
        except OSError as failed:
            error = failed
    error = _first_on_any_rank(error)
    if error is None:
        return final
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    full = getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    name = os.path.basename(final)
    intact = [s for s in saved_steps(root) if s < int(name.removeprefix("step-"))]
    previous = f"step-{intact[-1]} is intact" if intact else "there is no earlier checkpoint"
    why, fix = str(error), "Fix that"
    if full:  # the next one needs about what the last one took (a flat directory)
        last = sum(e.stat().st_size for e in os.scandir(f"{root}/step-{intact[-1]}")) if intact else 0
        took = f"step-{intact[-1]} took {last:,} bytes, " if intact else ""
        why = f"the disk is full ({error.strerror}; {took}{shutil.disk_usage(root).free:,} are free)"
        fix = "Free space"
    raise CheckpointNotWritten(
        f"checkpoint {name} could not be written: {why}, under {root}; removed the partial "
        f"{name}.tmp, and {previous}. {fix} and rerun the same command to resume"
    ) from None


def finish_checkpoint(
    final: str, train_state: dict, model_config, tokenizer, keep_latest: int, known: dict | None = None
) -> None:
    """One process: complete step-N.tmp (train_state.json, the model config and tokenizer, so evaluation
    can load it, and the manifest; `known`: the entries the ranks computed), rename it to step-N, and drop
    the oldest beyond keep_latest but the best."""
    tmp, root = f"{final}.tmp", os.path.dirname(final)
    with open(os.path.join(tmp, TRAIN_STATE), "w") as f:
        json.dump(train_state, f)
    save_config(tmp, model_config, tokenizer)
    manifest.write_manifest(tmp, known)
    move_into_place(tmp, final)
    best = train_state.get("best", {}).get("step")  # the Trainer keeps the best checkpoint too
    for old in saved_steps(root)[:-keep_latest]:
        if old != best:
            shutil.rmtree(os.path.join(root, f"step-{old}"))


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


def load_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, data=None
) -> dict:
    """Restore model, optimizer, scheduler, RNG and (given `data`) the data's own state in place, DCP
    resharding to this world size; returns train_state."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, param in get_model_state_dict(model, options=TRAINED).items():  # another model's fails here
        entry, here = saved.get(f"model.{name}"), list(param.shape)
        there = list(entry.size) if hasattr(entry, "size") else None
        if there != here:
            raise ConfigError(
                f"checkpoint {path} holds a different model ({name} is {there} there, {here} here); "
                f"use a new checkpoint.dir for this model, or checkpoint.resume=none"
            )
    key = own_rng_key(saved)
    state, param_groups = model_and_optimizer_tensors(model, optimizer, key)
    # A parameter with no gradient yet (DeepSeek-V4's compressor on short rows) has no AdamW state: nor here.
    had = {name.split(".", 1)[1].rsplit(".", 1)[0] for name in saved if name.startswith("optim.")}
    state["optim"] = {name: value for name, value in state["optim"].items() if name in had}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"], options=INTO_TRAINED)
    optim, no_state = {"state": state["optim"], "param_groups": param_groups}, StateDictOptions(strict=False)
    set_optimizer_state_dict(model, optimizer, optim, options=no_state)
    rng = state["rng"][key]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return restore_train_state(path, optimizer, scheduler, data)


def load_trained_weights(path: str, model: nn.Module) -> None:
    """The model weights a training checkpoint holds (the best step's, at the end of a run), nothing else."""
    state = {"model": get_model_state_dict(model, options=TRAINED)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"], options=INTO_TRAINED)


def restore_train_state(path: str, optimizer: torch.optim.Optimizer, scheduler, data=None) -> dict:
    with open(os.path.join(path, TRAIN_STATE)) as f:
        train_state = json.load(f)
    scheduler.load_state_dict(train_state["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # load_state_dict restores the schedule, not the lr already applied to the optimizer
    if data is not None:
        data.load_state_dict(train_state["data"])  # a stream's position; every rank's, saved by train_state()
    return train_state
