"""Test-only: what each rank syncs to disk, in order.

    FSYNC_LOG=runs/x/fsync torchrun --nproc_per_node 2 tests/with_fsync_log.py scripts/pretrain_fsdp.py

Each rank appends the path behind every descriptor it fsyncs (a file, or a directory: its entries) to
$FSYNC_LOG.rank<R>, one per line. The patch is in place before the script runs. Never imported by scripts/ or
common/.
"""

from __future__ import annotations

import os
import runpy
import sys


def logged(fd: int, _original=os.fsync) -> None:
    with open(f"{os.environ['FSYNC_LOG']}.rank{os.environ.get('RANK', '0')}", "a") as f:
        f.write(f"{os.readlink(f'/proc/self/fd/{fd}')}\n")
    _original(fd)


os.fsync = logged
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
