"""What to reach for when a run is slow, runs out of memory or hangs: a torch profiler trace of chosen steps
(metrics.profile_steps), a CUDA memory snapshot (metrics.memory_snapshot), and NCCL's flight recorder."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from common.config import Config, ConfigError
from common.mesh import resolve_device

MEMORY_VIZ = "https://pytorch.org/memory_viz"
SNAPSHOT_ENTRIES = 100_000  # allocator events kept (a ring buffer): the last few steps of an 8B run


def prepare_diagnostics(cfg: Config) -> None:
    """Before the process group exists (NCCL reads these at its creation; variables the user set win):
    refuse a memory snapshot off CUDA; on CUDA, have the flight recorder dump each rank's last
    collectives under the run directory on a timeout."""
    cuda = resolve_device(cfg.train.device).type == "cuda"
    if cfg.metrics.memory_snapshot and not cuda:
        raise ConfigError(
            "metrics.memory_snapshot is true but this run is on the CPU; it records CUDA's caching "
            "allocator, so run on a CUDA GPU, or set it to false and use metrics.profile_steps"
        )
    if cuda:
        prefix = os.path.join(os.path.abspath(cfg.checkpoint.dir), "flight_recorder", "rank_")
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        prefix = os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", prefix)
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        if os.environ.get("RANK", "0") == "0":
            print(f"flight recorder: on a timeout each rank writes its last collectives to {prefix}N")


class StepDiagnostics:
    """A context manager around the training loop. With metrics.profile_steps = [first, last], each rank
    writes a Chrome/Perfetto trace of those steps to <run_dir>/profile/. With metrics.memory_snapshot,
    allocator history is recorded from the first step; each rank dumps a snapshot after `last` (or after
    the first step, without profile_steps), and when a step runs out of memory."""

    def __init__(self, cfg: Config, device: torch.device, first_step: int):
        first, self.last = cfg.metrics.profile_steps or (None, None)
        self.first = None if first is None else max(first, first_step)  # a resumed run starts later
        self.snapshot_step = self.last if first else first_step
        self.snapshot = cfg.metrics.memory_snapshot
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.run_dir, self.device = cfg.checkpoint.dir, device
        self.profiler = self.step_range = None
        self.step = first_step

    def __enter__(self) -> StepDiagnostics:
        if self.snapshot:  # the documented API is underscore-named (pytorch.org/docs, torch_cuda_memory)
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
        self.before(self.step)
        return self

    def before(self, step: int) -> None:
        self.step = step
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.__enter__()
        if self.profiler is not None:  # the step as one named range in the trace
            self.step_range = torch.profiler.record_function(f"train step {step}")
            self.step_range.__enter__()

    def after(self, step: int) -> list[dict]:
        """Returns the events to log."""
        events = []
        if self.profiler is not None:
            self.step_range.__exit__(None, None, None)
            if step == self.last:
                events.append(self._write_trace(step))
        if self.snapshot and step == self.snapshot_step:
            events.append({"event": "memory_snapshot", "step": step, "path": self._dump(f"step{step}")})
        return events

    def _write_trace(self, step: int) -> dict:
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        path = os.path.join(self.run_dir, "profile", f"rank{self.rank}-steps{self.first}-{step}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        profiler.export_chrome_trace(path)
        return {"event": "profiler_trace", "steps": [self.first, step], "path": path}

    def _dump(self, name: str) -> str:
        path = os.path.join(self.run_dir, "memory_snapshot", f"rank{self.rank}-{name}.pickle")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.cuda.memory._dump_snapshot(path)
        return path

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self.profiler is not None:  # the run ended inside the window (an early stop, an error)
            self.step_range.__exit__(None, None, None)
            self._write_trace(self.step)
        if self.snapshot and isinstance(exc, torch.OutOfMemoryError):
            path = self._dump(f"oom-step{self.step}")
            print(
                f"rank {self.rank}: out of memory at step {self.step}; snapshot {path} (open at {MEMORY_VIZ})"
            )
        if self.snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
