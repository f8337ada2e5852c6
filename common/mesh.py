"""Process group and device mesh: the only place that decides backend, device and mesh shape."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from common.config import ConfigError, ParallelismConfig

# Whether init_distributed ran here, so end_process may end it (not a test calling main()).
_STARTED = [False]


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def gather(obj) -> list:
    if not dist.is_initialized():  # one PyTorch/XLA host
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def resolve_device(preference: str) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(device_preference: str, timeout_minutes: float) -> Dist:
    """NCCL on CUDA (with gloo for CPU tensors), gloo on CPU; under torchrun or as one process."""
    _STARTED[0] = True
    device = resolve_device(device_preference)
    cuda = device.type == "cuda"
    timeout = timedelta(minutes=timeout_minutes)
    if cuda:
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if cuda else None)
    else:  # plain `python script.py`: a one-rank group, so FSDP runs the same code as under torchrun
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), device)


def collective_threads() -> list[str]:
    """gloo and NCCL threads, which live exactly as long as their process groups."""
    names = []
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return [n for n in names if n.startswith(("pt_gloo", "gloo_", "pt_nccl"))]


def end_process(exit_code: int, own_groups: bool | None = None) -> None:
    """Leave after main(), destroying the process group if main() did not. DTensor's caches keep every mesh's
    groups until interpreter finalization, where a gloo worker still freeing tensors aborts ("terminate
    called without an active exception", pytorch/pytorch#179291), so while such threads live, skip that
    teardown. `own_groups` defaults to whether init_distributed ran."""
    own = _STARTED[0] if own_groups is None else own_groups
    if own and dist.is_initialized():  # a path that left main() early: a config error, a NaN stop
        dist.destroy_process_group()
    if own and collective_threads():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    if exit_code:
        sys.exit(exit_code)


def _require_one(p: ParallelismConfig, keys: tuple[str, ...], why: str) -> None:
    for key in keys:
        if getattr(p, key) != 1:
            raise ConfigError(f"parallelism.{key} is {getattr(p, key)} but {why}")


def resolve_dp_sizes(p: ParallelismConfig, world_size: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for HSDP over world_size / cp_size ranks (cp ranks share a batch)."""
    why = "pretrain_fsdp.py has no expert or tensor parallelism; set it to 1 (EP/TP: finetune_moe_ep_fsdp.py)"
    _require_one(p, ("ep_size", "tp_size", "sp_size"), why)
    if world_size % p.cp_size:
        raise ConfigError(f"parallelism.cp_size={p.cp_size} does not divide the world size {world_size}")
    world_size //= p.cp_size
    replicate, shard = p.dp_replicate_size, p.dp_shard_size
    if replicate == -1 and shard == -1:
        raise ConfigError("parallelism.dp_replicate_size and dp_shard_size are both -1; give at least one")
    if shard == -1:
        shard = world_size // replicate
    if replicate == -1:
        replicate = world_size // shard
    if replicate * shard != world_size:
        raise ConfigError(
            f"parallelism.dp_replicate_size ({p.dp_replicate_size}) x dp_shard_size "
            f"({p.dp_shard_size}) does not cover the world size {world_size}; make their product "
            f"{world_size} or set dp_shard_size=-1"
        )
    return replicate, shard


def build_dp_mesh(device_type: str, dp_replicate: int, dp_shard: int) -> DeviceMesh:
    """1-D FSDP mesh, or 2-D (replicate, shard) for HSDP: fully_shard all-reduces across dim 0."""
    if dp_replicate == 1:
        return init_device_mesh(device_type, (dp_shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(
        device_type, (dp_replicate, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
    )


@dataclass
class MoeSizes:
    """Transformers' DistributedConfig layout: dense weights on (dp_replicate, fsdp, tp), experts on
    (dp_replicate, efsdp, ep)."""

    dp_replicate: int
    fsdp: int
    tp: int
    ep: int

    @property
    def efsdp(self) -> int:
        return self.fsdp * self.tp // self.ep  # both views cover the same ranks

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.fsdp  # ranks that see distinct batches


def resolve_moe_sizes(p: ParallelismConfig, world_size: int, num_experts: int) -> MoeSizes:
    _require_one(p, ("cp_size", "sp_size"), "finetune_moe_ep_fsdp.py has no context parallelism; set it to 1")
    if p.dp_shard_size != -1:
        raise ConfigError(
            f"parallelism.dp_shard_size is {p.dp_shard_size}; finetune_moe_ep_fsdp.py uses "
            f"Transformers' name for it, set parallelism.fsdp_size instead"
        )
    if p.dp_replicate_size == -1:
        raise ConfigError("parallelism.dp_replicate_size is -1; give the number of replicas (e.g. nodes)")
    replicate, tp, ep = p.dp_replicate_size, p.tp_size, p.ep_size
    fsdp = world_size // (replicate * tp) if p.fsdp_size == -1 else p.fsdp_size
    if replicate * fsdp * tp != world_size:
        raise ConfigError(
            f"parallelism.dp_replicate_size ({replicate}) x fsdp_size ({p.fsdp_size}) x tp_size ({tp}) "
            f"does not cover the world size {world_size}; make the product {world_size} or set "
            f"fsdp_size=-1"
        )
    if ep % tp:
        # Transformers allows ep=1 with tp>1, tensor-sharding fused experts in a packed layout that DCP
        # checkpoints and full exports cannot represent (overlapping chunks), so we do not.
        raise ConfigError(
            f"parallelism.ep_size ({ep}) is not a multiple of tp_size ({tp}); experts are never "
            f"tensor-parallel here, so set ep_size to a multiple of {tp}"
        )
    if (fsdp * tp) % ep:
        raise ConfigError(
            f"parallelism.ep_size ({ep}) does not divide fsdp_size x tp_size ({fsdp} x {tp}); pick "
            f"an ep_size that divides {fsdp * tp}"
        )
    if num_experts % ep:
        raise ConfigError(
            f"parallelism.ep_size ({ep}) does not divide the model's {num_experts} experts; pick an "
            f"ep_size that divides {num_experts}"
        )
    return MoeSizes(replicate, fsdp, tp, ep)


def data_parallel_rank(dense: DeviceMesh) -> int:
    """Which batch this rank reads: its (dp_replicate, fsdp) position; tp peers read the same one."""
    replicate_rank, fsdp_rank, _ = dense.get_coordinate()
    return replicate_rank * dense["fsdp"].size() + fsdp_rank


def fsdp_meshes(dense: DeviceMesh, expert: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
    """What FSDP shards dense weights and experts over; dp_replicate only with >1 replica."""
    replicate = ("dp_replicate",) if dense["dp_replicate"].size() > 1 else ()
    return dense[(*replicate, "fsdp")], expert[(*replicate, "efsdp")]


def build_moe_meshes(device_type: str, s: MoeSizes) -> tuple[DeviceMesh, DeviceMesh]:
    dense = init_device_mesh(
        device_type, (s.dp_replicate, s.fsdp, s.tp), mesh_dim_names=("dp_replicate", "fsdp", "tp")
    )
    expert = init_device_mesh(
        device_type, (s.dp_replicate, s.efsdp, s.ep), mesh_dim_names=("dp_replicate", "efsdp", "ep")
    )
    return dense, expert
