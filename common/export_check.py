"""The export read back before its manifest: every rank writes its regions of the same files at once, which
needs a filesystem that keeps concurrent writers' bytes (Lustre, GPFS, NFS, local disks). Object-store mounts
do not: gcsfuse uploads each writer's copy of a file when it is closed, and the last upload wins, so the other
ranks' regions come back as zeros. Each rank reads back what it wrote and compares hashes, so the manifest's
checksums are of bytes that are really there (docs/checkpoints.md, "Which filesystems"). And a full disk:
the files are created sparse, so the space they need is checked before the first byte is written."""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist
import xxhash


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
