"""Test-only: a rank's host memory while it loads a new run's weights, anonymous and file-mapped apart.

    LOAD_MEMORY_OUT=runs/x/load torchrun --nproc_per_node 2 tests/with_load_memory.py scripts/pretrain_fsdp.py

VmHWM counts the pages of a memory-mapped safetensors file that a rank has touched, which are the page cache,
shared by a node's ranks and dropped under pressure; anonymous memory is what runs a host out of memory. A
thread polls /proc/self/status while common.weights.load_or_init_weights runs, and each rank writes
{"before": {...}, "peak": {...}} (MiB of RssAnon and RssFile) to $LOAD_MEMORY_OUT.rank<R>.json. The patch is
in place before the script runs. Never imported by scripts/ or common/.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import weights  # noqa: E402

FIELDS = ("RssAnon", "RssFile")


def resident_mib() -> dict:
    with open("/proc/self/status") as f:
        return {
            line.split(":")[0]: int(line.split()[1]) // 1024 for line in f if line.split(":")[0] in FIELDS
        }


def measured(*args, _original=weights.load_or_init_weights, **kwargs):
    before, peak, done = resident_mib(), resident_mib(), threading.Event()

    def sample() -> None:
        now = resident_mib()
        peak.update({k: max(peak[k], now[k]) for k in FIELDS})

    def poll() -> None:
        while not done.is_set():
            sample()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        return _original(*args, **kwargs)
    finally:
        done.set()
        thread.join()
        # Once more after the load: on a busy machine the polling thread may not have run since the last
        # shards were filled, and the loaded weights stay resident, so the peak is at least this.
        sample()
        with open(f"{os.environ['LOAD_MEMORY_OUT']}.rank{dist.get_rank()}.json", "w") as f:
            json.dump({"before": before, "peak": peak}, f)


weights.load_or_init_weights = measured
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
