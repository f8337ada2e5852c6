"""Test-only: a real run's training peak of live tensor bytes, measured by the torch profiler.

The estimator (scripts/estimate_memory.py) is checked against this, so it must not share its method: here
the profiler records the main thread's allocations and frees (profile_memory=True), and the peak is the
highest live total between the script's reset_peak_memory() (after loading) and its final_record() (after
the last step), the window the script calls training. CPU tensors only: no allocator cache, no RSS.
Each rank writes {"peak_bytes": N} to $PEAK_OUT.rank<R>.json. Never imported by scripts/ or common/.

    PEAK_OUT=runs/x/peak torchrun --nproc_per_node 2 tests/profile_peak.py scripts/pretrain_fsdp.py ...
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.ops import metrics  # noqa: E402

START, END = "peak_window_start", "peak_window_end"
PROFILER = profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def window_peak(event_tree) -> int:
    """Highest live total between the two markers (allocations before the window count too: they are still
    alive in it). The profiler records only this thread's allocations and frees, and a collective's worker
    thread often drops the last reference to a tensor: its free goes unrecorded. So live blocks are kept by
    address, and a new block at a live address means the old one was freed unseen."""
    allocations, marks, stack = [], [], list(event_tree)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.name in (START, END):
            marks.append((event.name, event.start_time_ns))
        elif event.typed[0] == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].ptr, event.typed[1].alloc_size))
    start = min(time for name, time in marks if name == START)
    end = max(time for name, time in marks if name == END)
    live, total, peak = {}, 0, 0
    for time, address, size in sorted(allocations):
        total -= live.pop(address, 0)  # freed, or freed unseen if this is an allocation
        if size > 0:
            live[address] = size
            total += size
        if start <= time <= end:
            peak = max(peak, total)
    return peak


def reset_peak_memory(device: torch.device, _original=metrics.reset_peak_memory) -> None:
    with record_function(START):
        _original(device)


def final_record(*args, _original=metrics.final_record) -> dict:
    """The script's own record; then the profiler stops and this rank's peak is written (the script may
    leave through os._exit, so nothing waits for the end of the process)."""
    record = _original(*args)
    with record_function(END):
        pass
    PROFILER.stop()
    peak = window_peak(PROFILER.profiler.kineto_results.experimental_event_tree())
    with open(f"{os.environ['PEAK_OUT']}.rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump({"peak_bytes": peak}, f)
    return record


if __name__ == "__main__":
    metrics.reset_peak_memory, metrics.final_record = reset_peak_memory, final_record
    script, sys.argv = sys.argv[1], sys.argv[1:]
    PROFILER.start()
    runpy.run_path(script, run_name="__main__")
