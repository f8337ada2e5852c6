"""The run directory, which every node must share: which checkpoint a run resumes from (rank 0 decides),
branches started by resuming an older step, and the check that every rank sees what rank 0 writes."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from common.checkpoint import STEP_DIR, TRAIN_STATE, checkpoints_dir, saved_steps
from common.config import CheckpointConfig, ConfigError
from common.ops import integrity


def find_resume_checkpoint(run_dir: str, resume: str, checksums: bool = True) -> str | None:
    """`auto`: this run's newest complete and undamaged checkpoint, if any; `none`: None; else the given
    path, which must be undamaged. Rank 0 decides and every rank takes its choice: ranks listing the
    directory themselves could disagree (a network filesystem's stale view on one node) and load different
    steps. Then every rank must see what rank 0 writes there: a node-local run directory could never be
    resumed. `checksums`: check every file's checksum against the manifest too (sizes always)."""
    choice: list = [None, None]  # the path, or the error that stops every rank
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            choice[0] = _resume_checkpoint(run_dir, resume, checksums)
        except ConfigError as error:
            choice[1] = str(error)
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[1]:
        raise ConfigError(choice[1])
    if dist.is_initialized():
        check_shared_storage(run_dir)
    return choice[0]


def load_or_set_aside(path: str | None, c: CheckpointConfig, load, *state) -> tuple[str | None, dict]:
    """(the checkpoint loaded, its train_state) from `load(path, *state)`. Under resume=auto, one that passed
    the checks but fails to load (a damaged file and no manifest to show it, or checksums off) is moved
    aside like a damaged one, and the one before it is loaded instead: every tensor, the RNG and the
    train state are loaded again, so nothing of the failed attempt remains."""
    while path:
        loaded, error = {}, None
        try:
            loaded = load(path, *state)
        except ConfigError:  # another model's checkpoint: a person must choose
            raise
        except Exception as failed:  # DCP raises on every rank when any rank's read failed
            error = f"{type(failed).__name__}: {(str(failed).splitlines() or [''])[0]}"
        if dist.is_initialized():  # one verdict: a rank whose own part loaded must not go on alone
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e), None)
        if error is None:
            return path, loaded
        if c.resume != "auto":
            raise ConfigError(
                f"checkpoint.resume {path!r} could not be loaded ({error}); resume from another "
                f"checkpoint, or set checkpoint.resume=none"
            )
        if not dist.is_initialized() or dist.get_rank() == 0:
            root, name = os.path.split(os.path.normpath(path))
            aside = _move_aside(root, name, "damaged")
            print(f"checkpoint: {name} could not be loaded ({error}); moved it to {aside}", flush=True)
        path = find_resume_checkpoint(c.dir, "auto", c.verify_checksums)
        if path is None:
            raise ConfigError(
                f"checkpoint.resume=auto: no checkpoint of {c.dir!r} could be loaded (the last: {error}); "
                f"they are under checkpoints/damaged/, and rerunning starts from step 0"
            )
    return None, {}


def _resume_checkpoint(run_dir: str, resume: str, checksums: bool) -> str | None:
    if resume == "none":
        return None
    if resume != "auto":
        if not os.path.exists(os.path.join(resume, TRAIN_STATE)):
            raise ConfigError(
                f"checkpoint.resume {resume!r} is not a complete checkpoint directory "
                f"(no {TRAIN_STATE}); use auto, none, or a checkpoints/step-N path"
            )
        if problem := integrity.damage(resume, checksums):  # asked for by name: no silent fallback
            raise ConfigError(
                f"checkpoint.resume {resume!r} is damaged: {problem}; resume from another checkpoint, "
                f"or set checkpoint.resume=none"
            )
        _start_branch(run_dir, resume)
        return resume
    root = checkpoints_dir(run_dir)
    complete = [s for s in saved_steps(root) if os.path.exists(os.path.join(root, f"step-{s}", TRAIN_STATE))]
    for step in reversed(complete):
        path = os.path.join(root, f"step-{step}")
        problem = integrity.damage(path, checksums)
        if problem is None:
            return path
        aside = _move_aside(root, f"step-{step}", "damaged")
        print(f"checkpoint: step-{step} is damaged ({problem}); moved it to {aside}", flush=True)
    return None


def _move_aside(root: str, name: str, folder: str) -> str:
    """checkpoints/<folder>/<name>[.K]: kept for a person to look at, invisible to resume and keep_latest."""
    aside = base = os.path.join(root, folder, name)
    copies = 1
    while os.path.exists(aside):
        copies += 1
        aside = f"{base}.{copies}"
    os.makedirs(os.path.dirname(aside), exist_ok=True)
    os.replace(os.path.join(root, name), aside)
    return aside


def _start_branch(run_dir: str, resume: str) -> None:
    """Resuming from an older step of this run starts a new branch. Its newer checkpoints move aside to
    checkpoints/abandoned-after-step-N[.K]: kept, but invisible to keep_latest (which would prune the new
    branch's checkpoints as the older ones) and to resume=auto (which would pick the abandoned branch)."""
    root = checkpoints_dir(run_dir)
    match = STEP_DIR.match(os.path.basename(os.path.normpath(resume)))
    parent = os.path.dirname(os.path.normpath(resume))
    if not match or not os.path.isdir(root) or not os.path.samefile(parent, root):
        return  # another run's checkpoint
    newer = [f"step-{s}" for s in saved_steps(root) if s > int(match[1])]
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
