"""Test-only: a rank's host memory while it loads a new run's weights (or resumes) and while it exports,
anonymous and file-mapped apart.

    HOST_MEMORY_OUT=runs/x/mem torchrun --nproc_per_node 2 tests/with_host_memory.py scripts/pretrain_fsdp.py

VmHWM counts the pages of a memory-mapped safetensors file that a rank has touched, which are the page cache,
shared by a node's ranks and dropped under pressure; anonymous memory is what runs a host out of memory. A
thread polls /proc/self/status every millisecond (a busy loop slowed the timed work threefold on 2 cores)
while common.load_weights.load_or_init_weights runs, while a resume's common.checkpoint.load_checkpoint runs,
and while export_full runs (sampling once more as its writer starts, the export's peak, which a poll could
miss), and each rank writes {"before": {...}, "peak": {...}} (MiB of RssAnon, RssFile and RssShmem, and
the kernel's high-water mark of the window as "Rss", which no poll can miss) to
$HOST_MEMORY_OUT.load.rank<R>.json, .resume.rank<R>.json and .export.rank<R>.json. From the load's (or the
resume's) end to the export's start (training, its checkpoints, the final loss), the kernel's own high-water
mark is read instead (VmHWM, reset through /proc/self/clear_refs as the window opens): no poll can miss a
peak there, and no safetensors file is mapped then, so it rises with anonymous memory only. It goes to
$HOST_MEMORY_OUT.train.rank<R>.json as {"before": {"Rss": ...}, "peak": {"Rss": ...}}. With
$EXPORT_ON_RANK0_TOO, the model is exported once more there, gathered to rank 0 and saved by it
(export_on_rank0 below), measured as $HOST_MEMORY_OUT.export_on_rank0.rank<R>.json. Each record also has the
seconds taken and the bytes read (/proc/self/io's rchar: read() calls; pages of mapped files show as RssFile).
WEIGHTS_IO=rank0 takes the path the recipes took before each rank read and wrote its share
(benchmarks/weights_io.py): the checkpoint whole through from_pretrained (on rank 0 with
fsdp.cpu_ram_efficient_loading, else on every rank) and the export gathered to rank 0 and saved there. The
patches are in place before the script runs. Never imported by scripts/ or common/.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import sys
import threading
import time

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import checkpoint, export, load_weights, lora, safetensors_writer  # noqa: E402
from common.checkpoint_layout import Layout  # noqa: E402
from common.model import has_adapters  # noqa: E402

FIELDS = ("RssAnon", "RssFile", "RssShmem")  # pinned host memory (CUDA) shows as RssShmem
SAMPLERS = []  # the open measurement's sample(), for the hook below
BEFORE = os.environ.get("WEIGHTS_IO") == "rank0"


def resident_mib() -> dict:
    with open("/proc/self/status") as f:
        return {
            line.split(":")[0]: int(line.split()[1]) // 1024 for line in f if line.split(":")[0] in FIELDS
        }


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def measure(what: str, call, *args, **kwargs):
    rss_before = reset_peak()
    before, peak, done = resident_mib(), resident_mib(), threading.Event()
    before["Rss"] = rss_before
    start, read_before = time.perf_counter(), read_bytes()

    def sample() -> None:
        now = resident_mib()
        peak.update({k: max(peak[k], now[k]) for k in FIELDS})

    def poll() -> None:  # every millisecond: a busy loop took the cores the timed work runs on
        while not done.wait(0.001):
            sample()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    SAMPLERS.append(sample)
    try:
        return call(*args, **kwargs)
    finally:
        SAMPLERS.remove(sample)
        done.set()
        thread.join()
        # Once more at the end: on a busy machine the polling thread may not have run since the last
        # shards were filled, and loaded weights stay resident, so the peak is at least this.
        sample()
        peak["Rss"] = resident_now_and_peak_mib()[1]  # anonymous and mapped pages together, never missed
        seconds, read = time.perf_counter() - start, read_bytes() - read_before
        with open(f"{os.environ['HOST_MEMORY_OUT']}.{what}.rank{dist.get_rank()}.json", "w") as f:
            json.dump({"before": before, "peak": peak, "seconds": seconds, "read_bytes": read}, f)


def reset_peak() -> int:
    """Resets the kernel's high-water mark (VmHWM) to the current VmRSS, which it returns (MiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return resident_now_and_peak_mib()[0]


def resident_now_and_peak_mib() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) // 1024 for line in f if line.startswith("Vm")}
    return fields["VmRSS"], fields["VmHWM"]


class TrainingWindow:
    """The peak resident memory from open() to close(), from the kernel's high-water mark."""

    before = None

    def open(self) -> None:
        self.rank, self.before = dist.get_rank(), reset_peak()
        atexit.register(self.close)  # a run that does not export

    def close(self) -> None:
        if self.before is None:
            return
        with open(f"{os.environ['HOST_MEMORY_OUT']}.train.rank{self.rank}.json", "w") as f:
            json.dump({"before": {"Rss": self.before}, "peak": {"Rss": resident_now_and_peak_mib()[1]}}, f)
        self.before = None


TRAINING = TrainingWindow()


def writing(self, *args, _original=safetensors_writer.SafetensorsInPlace.write_regions, **kwargs):
    """The export's writer: one sample more as it starts, with the rank's shards cast (or merged) for it, or
    (checkpoint.export_writers=one) its file gathered: the export's peak, which a poll could miss."""
    for sample in SAMPLERS:
        sample()
    return _original(self, *args, **kwargs)


def load(*args, _original=load_weights.load_or_init_weights, **kwargs):
    measure("load", _original, *args, **kwargs)
    TRAINING.open()


def resume(*args, _original=checkpoint.load_checkpoint, **kwargs):
    try:
        return measure("resume", _original, *args, **kwargs)
    finally:
        TRAINING.open()  # a resumed run loads no weights (but a LoRA base): its training starts here


def export_on_rank0(model, out_dir: str, tokenizer, dtype, cfg) -> None:
    """The FULL export as the recipes wrote it before every rank wrote its part: the model gathered to rank
    0 on CPU one tensor at a time (LoRA merged there), cast, and saved by save_pretrained."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        tmp = f"{out_dir}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if has_adapters(model):
            state = lora.merged_weights(state, cfg.lora)
        state = {k: v.to(dtype) for k, v in state.items()}
        model.save_pretrained(tmp, state_dict=state, max_shard_size=cfg.checkpoint.max_shard_size)
        export.save_model_config(model, tmp, tokenizer, dtype)
        export.finish_export(tmp, out_dir)
    dist.barrier()


def measured_export(model, out_dir, *args, _original=export_on_rank0 if BEFORE else export.export_full):
    TRAINING.close()
    measure("export", _original, model, out_dir, *args)
    if os.environ.get("EXPORT_ON_RANK0_TOO"):
        measure("export_on_rank0", export_on_rank0, model, os.environ["EXPORT_ON_RANK0_TOO"], *args)


load_weights.load_or_init_weights, export.export_full = load, measured_export
checkpoint.load_checkpoint = resume  # the scripts import it from common.checkpoint as they start
safetensors_writer.SafetensorsInPlace.write_regions = writing
if BEFORE:
    load_weights.checkpoint_layout = lambda model, path, ours: Layout([], {}, {}, {}, "WEIGHTS_IO=rank0")
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
