"""The run directory, which every node must share: which checkpoint a run resumes from (rank 0 decides),
branches started by resuming an older step, and the check that every rank sees what rank 0 writes."""

from __future__ import annotations

import contextlib
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from common.checkpoint import STEP_DIR, TRAIN_STATE, checkpoints_dir, saved_steps
from common.config import CheckpointConfig, ConfigError
from common.ops import integrity

# A load that fails without evidence of damage leaves the checkpoint in place and exits non-zero: a requeue
# or torchrun --max_restarts retries it in fresh processes (why not in-process: docs/checkpoints.md).
RETRY = "it stays in place: rerun the same command (or requeue) to retry it"


def find_resume_checkpoint(run_dir: str, resume: str, checksums: bool = True) -> str | None:
    """`auto`: this run's newest complete and undamaged checkpoint, if any; `none`: None; else the given
    path, which must be undamaged. Rank 0 decides and every rank takes its choice: ranks listing the
    directory themselves could disagree (a network filesystem's stale view on one node) and load different
    steps. Then every rank must see what rank 0 writes there: a node-local run directory could never be
    resumed. `checksums`: check every file's checksum against the manifest too (sizes always)."""
    choice: list = [None, None, None]  # the path, or what stops every rank: a config error, a read error
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            clear_leftovers(run_dir)
            choice[0] = _resume_checkpoint(run_dir, resume, checksums)
        except ConfigError as error:
            choice[1] = str(error)
        except OSError as error:  # no evidence of damage: what is left stays for the next launch to retry
            choice[2] = f"checkpoint: could not read a checkpoint to check it ({error}); {RETRY}"
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[1]:
        raise ConfigError(choice[1])
    if choice[2]:
        raise SystemExit(choice[2])
    if dist.is_initialized():
        check_shared_storage(run_dir)
    return choice[0]


def clear_leftovers(run_dir: str) -> None:
    """Before any work: what a run killed while writing left (an export or checkpoint half moved into place,
    a partial one), put right with one line each, so that it never stops a later run."""
    root = checkpoints_dir(run_dir)
    names = os.listdir(root) if os.path.isdir(root) else []
    partial = {name.rsplit(".", 1)[0] for name in names if name.endswith((".tmp", ".old"))}
    finals = [os.path.join(run_dir, "export")] + [os.path.join(root, n) for n in partial if STEP_DIR.match(n)]
    for final in finals:
        for line in recover_moved(final):
            print(line, flush=True)


def recover_moved(final: str) -> list[str]:
    """What a kill inside common/export.py:move_into_place leaves of `final`, and what this did about it.
    `final.old` is a complete previous `final`: put back if `final` is gone, else removed. `final.tmp` was
    never in place (a kill before or during its writing, or before its rename): removed, as the run that
    left it writes it again."""
    old, tmp, done = f"{final}.old", f"{final}.tmp", []
    if os.path.exists(old) and not os.path.exists(final):
        os.replace(old, final)
        done.append(
            f"{final}: put back from {os.path.basename(old)}, which a run killed while replacing it left"
        )
    for leftover in (old, tmp):
        if os.path.exists(leftover):
            shutil.rmtree(leftover)
            done.append(f"{final}: removed {os.path.basename(leftover)}, which a killed run left")
    return done


def load_or_set_aside(path: str | None, c: CheckpointConfig, load, *state) -> tuple[str | None, dict]:
    """(the checkpoint loaded, its train_state) from `load(path, *state)`. A load that fails is told apart
    by the checkpoint itself (integrity.load_damage). Damaged, under resume=auto, it is moved aside like
    one that failed the checks, and the one before it is loaded: every tensor, the RNG and the train state
    again, so nothing of the failed attempt remains. Not damaged (an I/O error, memory, a rank that died),
    nothing moves and every rank stops with one line, so a requeue or a restart retries it."""
    while path:
        loaded, error = {}, None
        try:
            loaded = load(path, *state)
        except ConfigError:  # another model's checkpoint: a person must choose
            raise
        except (Exception, CheckpointException) as failed:  # DCP's is a BaseException, raised on every rank
            error = integrity.what_failed(failed)
        try:  # one verdict: a rank whose own part loaded must not go on alone
            error = integrity.first_on_any_rank(error)
            if error is None:
                return path, loaded
            problem = integrity.damage_seen_by_rank0(path, c.verify_checksums)
        except Exception as failed:  # the collective itself failed (a rank died): no verdict, nothing moves
            error, problem = error or integrity.what_failed(failed), None
        if problem is None:
            raise SystemExit(f"checkpoint {path} could not be loaded ({error}) and shows no damage; {RETRY}")
        if c.resume != "auto":
            raise ConfigError(
                f"checkpoint.resume {path!r} could not be loaded ({error}): {problem}; resume from another "
                f"checkpoint, or set checkpoint.resume=none"
            )
        if not dist.is_initialized() or dist.get_rank() == 0:
            root, name = os.path.split(os.path.normpath(path))
            aside = _move_aside(root, name, "damaged")
            print(
                f"checkpoint: {name} could not be loaded ({error}): {problem}; moved it to {aside}",
                flush=True,
            )
        path = find_resume_checkpoint(c.dir, "auto", c.verify_checksums)  # with none left, one line
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
    damaged = os.path.join(root, "damaged")
    # Nothing is left, and starting over would silently drop the damaged ones' training: a person chooses.
    if held := sorted(os.listdir(damaged) if os.path.isdir(damaged) else []):
        raise ConfigError(
            f"checkpoint.resume=auto: no checkpoint is left to resume, and {damaged} holds "
            f"{', '.join(held)}; set checkpoint.resume=none to start from step 0, or "
            f"checkpoint.resume=<a checkpoint path>"
        )
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
