"""Test-only: a filesystem that keeps only the last writer's copy of a file, as gcsfuse does (it stages each
writer's copy and uploads it on close; the last upload wins).

    torchrun --nproc_per_node 2 tests/with_last_writer.py scripts/pretrain_fsdp.py --config ...

Each call of the export's writer (common/safetensors_writer.py's write_regions: once per rank with
checkpoint.export_writers=all, once per round with one) writes into a private copy of the files, taken as it
starts, then puts its copies of the files it wrote in their place; the ranks take turns in rank order, so
where several ranks wrote one file, rank world-1's copy is the one kept, and every other rank's regions hold
what that copy held (the header and zeros). The patch is in place before the script runs. Never imported by
scripts/ or common/.
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import safetensors_writer  # noqa: E402

original = safetensors_writer.SafetensorsInPlace.write_regions


def staged(self, items):
    rank, world = dist.get_rank(), dist.get_world_size()
    real, stage, items = self.path, f"{self.path}.rank{rank}", list(items)
    shutil.copytree(real, stage)  # this rank's copies of the files, as they are now
    self.path = stage
    try:
        original(self, items)
    finally:
        self.path = real
    for turn in range(world):  # the uploads on close, in rank order: the last one wins
        if turn == rank:
            for name in {self.offsets[key][0] for key, _, _ in items}:  # the files it wrote
                os.replace(os.path.join(stage, name), os.path.join(real, name))
            shutil.rmtree(stage)
        dist.barrier()


safetensors_writer.SafetensorsInPlace.write_regions = staged
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
