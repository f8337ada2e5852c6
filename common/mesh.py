"""Process group, device and the data-parallel mesh: 1-D FSDP or 2-D HSDP (the MoE meshes are in
common/moe.py, CP's (dp, cp) mesh in common/cp.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from common.config import ConfigError, ParallelismConfig


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def gather_objects(obj) -> list:
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
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def resolve_dp_sizes(p: ParallelismConfig, world_size: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for HSDP over world_size / (cp_size x tp_size) ranks (cp and tp ranks share
    a batch)."""
    if world_size % p.cp_size:
        raise ConfigError(f"parallelism.cp_size={p.cp_size} does not divide the world size {world_size}")
    if world_size % p.tp_size:
        raise ConfigError(f"parallelism.tp_size={p.tp_size} does not divide the world size {world_size}")
    world_size //= p.cp_size * p.tp_size
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


def build_meshes(
    device_type: str, dp_replicate: int, dp_shard: int, tp: int
) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the mesh FSDP shards over, the tensor-parallel mesh or None: common/tp.py's, where tp > 1)."""
    if tp == 1:
        return build_dp_mesh(device_type, dp_replicate, dp_shard), None
    from common.tp import build_tp_meshes

    return build_tp_meshes(device_type, dp_replicate, dp_shard, tp)
