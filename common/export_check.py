"""The export read back before its manifest: every rank writes its regions of the same files at once, which
needs a filesystem that keeps concurrent writers' bytes (Lustre, GPFS, NFS, local disks). Object-store mounts
do not: gcsfuse uploads each writer's copy of a file when it is closed, and the last upload wins, so the other
ranks' regions come back as zeros. Each rank reads back what it wrote and compares hashes, so the manifest's
checksums are of bytes that are really there (docs/checkpoints.md, "Which filesystems"). And a full disk:
the files are created sparse, so the space they need is checked before the first byte is written, and a
disk that fills after that check is one line too."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.api import CheckpointException


def lost_files(path: str, written: list[tuple[str, int, int, int]]) -> list[str]:
    """The files under `path` where a region this rank wrote ((file, position, length, xxh3-64 of its
    bytes)) no longer holds those bytes."""
    lost = set()
    for file, position, length, digest in written:
        with open(os.path.join(path, file), "rb") as f:
            f.seek(position)
            if xxhash.xxh3_64_intdigest(f.read(length)) != digest:
                lost.add(file)
    return sorted(lost)


def check_written(path: str, written: list[tuple[str, int, int, int]]) -> None:
    """After every rank has written: one line on every rank, and exit, if any rank's bytes were lost. The
    export stays in `path` (its .tmp name) and the previous export is untouched."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, lost_files(path, written))
    lost = sorted({file for files in every for file in files})
    if lost:
        raise SystemExit(
            f"export: {len(lost)} file(s) of {path} ({lost[0]} first) do not hold the bytes their ranks "
            f"wrote: this filesystem does not keep concurrent writes to one file (an object-store mount?); "
            f"export to a shared POSIX filesystem (docs/checkpoints.md). The previous export is untouched"
        )


def check_free_space(path: str, needed: int) -> None:
    """Before any byte is written under `path` (one process, or every rank together): one line, and exit,
    where `needed` bytes do not fit in its filesystem's free space; rank 0's look decides for every rank."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    verdict = [(needed, free)]
    if dist.is_initialized():
        dist.broadcast_object_list(verdict, src=0)
    needed, free = verdict[0]
    if needed > free:
        raise SystemExit(
            f"export: {path} needs {needed:,} bytes but its filesystem has {free:,} free; free space or "
            f"write elsewhere (checkpoint.dir). Nothing was written, and the previous export is untouched"
        )


def no_space_error(error: BaseException) -> BaseException | None:
    """The no-space error in `error`, or in DCP's CheckpointException, which carries every rank's failure to
    every rank; None for any other error. safetensors' save_file raises its own, with the OS error in its
    text."""
    causes = [error, *(e for e, _ in getattr(error, "failures", {}).values())]
    no_space = f"(os error {errno.ENOSPC})"
    return next((e for e in causes if getattr(e, "errno", None) == errno.ENOSPC or no_space in str(e)), None)


@contextlib.contextmanager
def full_disk_is_one_line(path: str, needed: int):
    """The writes of an export or a conversion, where the disk fills after check_free_space (another job
    writing to it): one line naming the path, the bytes it needs and the bytes free now."""
    try:
        yield
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        if no_space_error(error) is None:
            raise
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        raise SystemExit(
            f"export: the disk filled while {path} was written: it needs {needed:,} bytes and {free:,} are "
            f"free now; free space or write elsewhere (checkpoint.dir). The previous export is untouched"
        ) from None
