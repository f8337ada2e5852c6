"""Test-only: a filesystem that keeps only the last writer's copy of a file, as gcsfuse does (it stages each
writer's copy and uploads it on close; the last upload wins).

    torchrun --nproc_per_node 2 tests/with_last_writer.py scripts/pretrain_fsdp.py --config ...

Each rank's write_data of the export (common/safetensors_writer.py) writes into a private copy of each file,
taken when it first opens it, then puts its copy in the file's place; the ranks take turns in rank order, so
rank world-1's copy is the one kept, and every other rank's regions hold what that copy held (the header and
zeros). The patch is in place before the script runs. Never imported by scripts/ or common/.
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import safetensors_writer  # noqa: E402

original = safetensors_writer.SafetensorsInPlace.write_data


def staged(self, plan, planner):
    rank, world = dist.get_rank(), dist.get_world_size()
    real = self.path
    self.path = f"{real}.rank{rank}"  # this rank's staged copies of the files it opens
    shutil.copytree(real, self.path)
    try:
        result = original(self, plan, planner)
    finally:
        self.path = real
    for turn in range(world):  # the uploads on close, in rank order: the last one wins
        if turn == rank:
            for name in os.listdir(f"{real}.rank{rank}"):
                os.replace(os.path.join(f"{real}.rank{rank}", name), os.path.join(real, name))
            os.rmdir(f"{real}.rank{rank}")
        dist.barrier()
    return result


safetensors_writer.SafetensorsInPlace.write_data = staged
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
