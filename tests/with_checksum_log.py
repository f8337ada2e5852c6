"""Test-only: which files each rank checksums while it verifies a model directory or checkpoint.

    CHECKSUM_LOG=runs/x/sums torchrun --nproc_per_node 2 tests/with_checksum_log.py scripts/pretrain_fsdp.py

Each rank appends the path of every file it checksums (common/ops/integrity.py) to $CHECKSUM_LOG.rank<R>,
one per line. The patch is in place before the script runs. Never imported by scripts/ or common/.
"""

from __future__ import annotations

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.ops import integrity  # noqa: E402


def logged(path: str, _original=integrity.checksum) -> str:
    with open(f"{os.environ['CHECKSUM_LOG']}.rank{os.environ.get('RANK', '0')}", "a") as f:
        f.write(f"{path}\n")
    return _original(path)


integrity.checksum = logged
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
