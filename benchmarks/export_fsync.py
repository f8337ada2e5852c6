"""What syncing the FULL export to disk, and reading it back, cost: common/export.export_full as it runs
(synced, then each rank's regions read back and hashed: common/export_check.py), without the read-back, and
without the fsyncs too (both patched out here, as the export was written before 2026-12-06); and as it runs
with checkpoint.export_writers=one (each file gathered to one rank, which writes it alone).

    python benchmarks/export_fsync.py [--repeats 3] [--tiny]

weights_io.py's 531M-parameter Llama, sharded by fully_shard over 1 and 4 CPU ranks (random fp32 weights),
exported in fp32, split at 1GB. Synced: each rank syncs the regions it wrote, then rank 0 every file and
folder of the export, before the rename, and the run directory after it. Before each export, the dirty pages
of the last are written back (os.sync), so that none of them slows the next. Prints the median seconds,
their range, and the ratio to the export without syncing on the same ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from benchmarks.export_write_once import sharded_llama
from common import export, export_check
from common.config import Config
from tests.launch import run_command, tiny, torchrun

MODES = ("not synced", "synced", "synced, read back", "one writer a file")


def as_rank(work: str, repeats: int) -> None:
    """Inside torchrun: shard the model, then time the export both ways `repeats` times; rank 0 writes the
    times to work/times.json."""
    dist.init_process_group("gloo")
    model = sharded_llama()
    cfg = Config()
    cfg.checkpoint.max_shard_size = "1MB" if tiny() else "1GB"  # several files either way
    times, fsync, check = {mode: [] for mode in MODES}, os.fsync, export_check.check_written
    for _ in range(repeats):
        for mode in MODES:
            os.fsync = fsync if mode != "not synced" else lambda fd: None
            export_check.check_written = check if mode in MODES[2:] else lambda *args: None
            cfg.checkpoint.export_writers = "one" if mode == "one writer a file" else "all"
            if dist.get_rank() == 0:
                os.sync()  # each export starts with no dirty pages of the last one to write back
            dist.barrier()
            start = time.perf_counter()
            export.export_full(model, f"{work}/export", None, torch.float32, cfg)
            times[mode].append(time.perf_counter() - start)
            if dist.get_rank() == 0:
                shutil.rmtree(f"{work}/export")
            dist.barrier()
    os.fsync, export_check.check_written = fsync, check
    if dist.get_rank() == 0:
        with open(f"{work}/times.json", "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1 if tiny() else 3)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--as-rank", metavar="WORK")
    args = parser.parse_args()
    if args.as_rank:
        return as_rank(args.as_rank, args.repeats)
    print("| ranks | export | median s | range s | / not synced |")
    print("|---|---|---|---|---|")
    for world in (1, 2) if args.tiny else (1, 4):
        with tempfile.TemporaryDirectory(dir=os.path.expanduser("~")) as work:  # a disk, not a tmpfs
            launch = [
                *torchrun(world),
                os.path.abspath(__file__),
                "--as-rank",
                work,
                f"--repeats={args.repeats}",
            ]
            run_command(launch + (["--tiny"] if args.tiny else []), timeout=1800)
            with open(f"{work}/times.json") as f:
                times = json.load(f)
        baseline = statistics.median(times[MODES[0]])
        for mode in MODES:
            median = statistics.median(times[mode])
            spread = f"{min(times[mode]):.2f} to {max(times[mode]):.2f}"
            print(f"| {world} | {mode} | {median:.2f} | {spread} | {median / baseline:.2f} |")


if __name__ == "__main__":
    main()
