"""Process group and device mesh: the only place that decides backend, device and mesh shape."""

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
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(preference: str) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(device_preference: str, timeout_minutes: float) -> Dist:
    """NCCL on CUDA (gloo alongside for CPU tensors), gloo on CPU; works under torchrun or as one process."""
    device = resolve_device(device_preference)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        # A plain `python script.py` run: a one-rank group, so the FSDP code path is the same as under torchrun.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), device)


def resolve_dp_sizes(p: ParallelismConfig, world_size: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for HSDP; -1 in either means "the rest of the world"."""
    for key in ("ep_size", "tp_size", "cp_size", "sp_size"):
        if getattr(p, key) != 1:
            raise ConfigError(f"parallelism.{key} is {getattr(p, key)} but pretrain_fsdp.py is data parallel only; "
                              f"set it to 1 (EP/TP: finetune_moe_ep_fsdp.py, CP: eval_cp.py)")
    replicate, shard = p.dp_replicate_size, p.dp_shard_size
    if replicate == -1 and shard == -1:
        raise ConfigError("parallelism.dp_replicate_size and dp_shard_size are both -1; give at least one")
    if shard == -1:
        shard = world_size // replicate
    if replicate == -1:
        replicate = world_size // shard
    if replicate * shard != world_size:
        raise ConfigError(f"parallelism.dp_replicate_size ({p.dp_replicate_size}) x dp_shard_size "
                          f"({p.dp_shard_size}) does not cover the world size {world_size}; make their product "
                          f"{world_size} or set dp_shard_size=-1")
    return replicate, shard


def build_dp_mesh(device_type: str, dp_replicate: int, dp_shard: int) -> DeviceMesh:
    """1-D FSDP mesh, or 2-D (replicate, shard) for HSDP: fully_shard all-reduces across dim 0."""
    if dp_replicate == 1:
        return init_device_mesh(device_type, (dp_shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device_type, (dp_replicate, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))
