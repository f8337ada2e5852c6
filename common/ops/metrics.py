"""Throughput, MFU, memory and loss logging to stdout, metrics.jsonl and (if installed) TensorBoard."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.config import Config, FsdpConfig, resolve_mixed_precision
from common.mesh import gather_objects
from common.ops.profiling import StepDiagnostics

GIB = 2**30

# Dense bf16 peak FLOP/s per device, from the vendors' datasheets (no sparsity).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
STEP_FORMATS = {"loss": ".4f", "grad_norm": ".3f", "lr": ".2e", "tokens_per_s": ",.0f"}
STEP_FORMATS.update({"tokens_per_s_per_device": ",.0f", "mfu": ".1%", "peak_mem_gib": ".2f", "eta_s": ".0f"})


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token as PaLM (appendix B) and torchtitan count them: 6N (N without the input
    embedding, a lookup) + 12LHS for attention."""
    config = model.config.get_text_config()  # an image-text release's language model
    dense = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6 * dense + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated. CPU: peak RSS (VmHWM) since the last reset_peak_memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024
    except (OSError, StopIteration):  # not Linux: peak since start
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak, so training's peak is not hidden by loading's (e.g. tokenizing the corpus)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: resets VmHWM to the current RSS


def _short(value) -> str:
    """4 significant digits, thousands separators, equal per-rank values folded."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} {_short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        if len(value) > 1 and all(v == value[0] for v in value):
            return f"{_short(value[0])} (x{len(value)})"
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


def event_line(record: dict) -> str:
    """`model_ready: params 1,196,608, ...`: an event as the terminal shows it."""
    fields = ", ".join(f"{key} {_short(value)}" for key, value in record.items() if key != "event")
    return f"{record['event']}: {fields}"


class MetricsLogger:
    """Rank 0 writes run_config.json and metrics.jsonl; other ranks no-op, so callers need no rank checks."""

    def __init__(self, cfg: Config, enabled: bool):
        self.enabled, self.file, self.tb = enabled, None, None
        if not enabled:
            return
        run_dir = cfg.checkpoint.dir
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "run_config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        if cfg.metrics.tensorboard:
            with contextlib.suppress(ImportError):
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if "step" not in record or "event" in record:
            print(event_line(record), flush=True)
            if record.get("event") == "eval" and self.tb is not None:  # beside training's loss curve
                for key in ("eval_loss", "perplexity", "accuracy"):
                    self.tb.add_scalar(f"eval/{key}", record[key], record["step"])
            return
        parts = [f"step {record['step']}"]
        parts += [
            f"{k} {format(record[k], fmt)}" for k, fmt in STEP_FORMATS.items() if record.get(k) is not None
        ]
        print(" | ".join(parts), flush=True)
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


@dataclass
class StepTimer:
    """Tokens/s, MFU and ETA from wall time between logged steps."""

    total_steps: int
    world_size: int
    flops_per_token: float | None = None
    peak_flops: float | None = None
    tokens_since: int = 0

    def __post_init__(self):
        self.start = self.last = time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens_since += tokens

    def record(self, step: int) -> dict:
        now = time.perf_counter()
        tps = self.tokens_since / max(now - self.last, 1e-9)
        self.last, self.tokens_since = now, 0
        per_device = tps / self.world_size
        mfu = None
        if self.peak_flops and self.flops_per_token:
            mfu = per_device * self.flops_per_token / self.peak_flops
        eta = (now - self.start) / step * (self.total_steps - step)
        return {"tokens_per_s": tps, "tokens_per_s_per_device": per_device, "mfu": mfu, "eta_s": eta}


class CommCounter:
    """Counts calls and bytes of FSDP's all-gathers and reduce-scatters by wrapping the c10d functions."""

    KEYS = [f"{kind}_{unit}" for unit in ("calls", "bytes") for kind in ("all_gather", "reduce_scatter")]

    def __init__(self):
        self.counts = dict.fromkeys(self.KEYS, 0)

    def reset(self) -> dict:
        snapshot, self.counts = self.counts, dict.fromkeys(self.KEYS, 0)
        return snapshot

    def _counted(self, kind: str, collective):
        def wrapper(output, input, *args, **kwargs):
            full = output if kind == "all_gather" else input  # the unsharded side
            self.counts[f"{kind}_calls"] += 1
            self.counts[f"{kind}_bytes"] += full.numel() * full.element_size()
            return collective(output, input, *args, **kwargs)

        return wrapper

    @contextlib.contextmanager
    def patch(self):
        # FSDP calls all_gather_single and reduce_scatter_single on torch 2.13, the older names on 2.11.
        new = hasattr(dist, "all_gather_single")
        names = (
            ("all_gather_single", "reduce_scatter_single")
            if new
            else ("all_gather_into_tensor", "reduce_scatter_tensor")
        )
        originals = [getattr(dist, name) for name in names]
        for name, kind, original in zip(names, ("all_gather", "reduce_scatter"), originals):
            setattr(dist, name, self._counted(kind, original))
        try:
            yield self
        finally:
            for name, original in zip(names, originals):
                setattr(dist, name, original)


class StepLog:
    """A context manager around the training loop. After each step: the step's line in the terminal,
    metrics.jsonl and TensorBoard (every metrics.log_every steps, the first and the last) with tokens/s,
    MFU, ETA, peak memory and (metrics.comm_stats) collective counts; and the profiler's and memory
    snapshot's steps (common/ops/profiling.py)."""

    def __init__(
        self,
        cfg: Config,
        logger: MetricsLogger,
        start_step: int,
        device: torch.device,
        flops_per_token: float | None = None,
        devices: int | None = None,
    ):
        """`flops_per_token`: for MFU (None: no MFU); `devices`: what tokens/s per device divides by
        (default: the world size)."""
        self.logger, self.device = logger, device
        self.log_every, self.last_step, self.first_step = (
            cfg.metrics.log_every,
            cfg.train.steps,
            start_step + 1,
        )
        peak_flops = cfg.metrics.peak_flops or device_peak_flops(device)
        devices = devices or (dist.get_world_size() if dist.is_initialized() else 1)
        self.timer = StepTimer(cfg.train.steps, devices, flops_per_token, peak_flops)
        self.comm = CommCounter() if cfg.metrics.comm_stats else None
        self.diagnostics = StepDiagnostics(cfg, device, start_step + 1)
        self._around_loop = contextlib.ExitStack()
        reset_peak_memory(device)  # training's peak, not loading's (tokenizing the corpus, say)

    def __enter__(self) -> StepLog:
        if self.comm is not None:
            self._around_loop.enter_context(self.comm.patch())
        self._around_loop.enter_context(self.diagnostics)
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self._around_loop.__exit__(exc_type, exc, traceback)

    def log(self, step: int, stats: dict, tokens: int | None = None) -> None:
        """`stats`: the step's loss and other numbers; `tokens`: what it processed, for tokens/s (default:
        stats["tokens"])."""
        for event in self.diagnostics.after(step):
            self.logger.log(event)
        self.timer.add(stats["tokens"] if tokens is None else tokens)
        if step % self.log_every == 0 or step in (self.first_step, self.last_step):
            record = {"step": step, **stats, **self.timer.record(step - self.first_step + 1)}
            record["peak_mem_gib"] = peak_memory_bytes(self.device) / GIB
            if self.comm is not None:
                record.update(self.comm.reset())
            self.logger.log(record)
        if step < self.last_step:
            self.diagnostics.before(step + 1)

    def log_eval(self, step: int, scores: dict) -> float:
        """An evaluation of the held-out set after `step` (0: before training); returns its eval_loss."""
        self.logger.log({"event": "eval", "step": step, **scores})
        return scores["eval_loss"]


def sharded_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes this rank holds for parameters and optimizer state (gradients, if any, match parameters)."""

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    states = [v for state in optimizer.state.values() for v in state.values()]
    return {
        "param_bytes": sum(local_bytes(p) for p in model.parameters()),
        "optimizer_bytes": sum(local_bytes(v) for v in states if isinstance(v, torch.Tensor) and v.ndim > 0),
    }


def checkpoint_record(step: int, path: str, **more) -> dict:
    """A checkpoint written: its step, path and size on disk (a LoRA run's holds the adapters alone)."""
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
    return {"event": "checkpoint", "step": step, "path": path, "bytes": size, **more}


def final_record(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, fixed_batch_loss=None
) -> dict:
    """After training: the state bytes and training's peak memory of every rank, and the loss on a fixed
    batch that the export must reproduce (None: not measured, e.g. on a stream)."""
    return {
        "event": "final",
        "state_bytes_per_rank": gather_objects(sharded_state_bytes(model, optimizer)),
        "peak_mem_gib_per_rank": gather_objects(peak_memory_bytes(device) / GIB),
        "fixed_batch_loss": fixed_batch_loss,
    }


def model_ready_record(
    model: torch.nn.Module, device: torch.device, fsdp: FsdpConfig, mesh, **details
) -> dict:
    return {
        "event": "model_ready",
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "world_size": dist.get_world_size(),
        "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)),
        "device": str(device),
        "mixed_precision": resolve_mixed_precision(fsdp, device.type),
        "peak_mem_after_load_gib_per_rank": gather_objects(peak_memory_bytes(device) / GIB),
        **details,
    }
