"""Tensor parallelism from the model's own Transformers plan, applied on `meta` before fully_shard, so
FSDP then shards each TP shard over the data-parallel ranks (2-D FSDP x TP, 3-D HSDP x TP)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import DistributedConfig
from transformers.distributed.tensor_parallel import apply_tensor_parallelism

from common.config import ConfigError

GRAD_ALL_REDUCE = "replicated_with_grad_allreduce"  # TP style of Qwen3's q_norm/k_norm: partial gradients


def build_tp_meshes(
    device_type: str, dp_replicate: int, dp_shard: int, tp: int
) -> tuple[DeviceMesh, DeviceMesh]:
    """(the mesh FSDP shards over, the tensor-parallel mesh): one (dp_replicate, dp_shard, tp) mesh with tp
    innermost, so a tensor-parallel group is adjacent ranks, within a node; its ranks hold the same batch."""
    names = ("dp_replicate", "dp_shard", "tp")
    mesh = init_device_mesh(device_type, (dp_replicate, dp_shard, tp), mesh_dim_names=names)
    return (mesh["dp_shard"] if dp_replicate == 1 else mesh[("dp_replicate", "dp_shard")]), mesh["tp"]


def parallel_plans(model: nn.Module, layout: DistributedConfig) -> tuple[dict, dict]:
    """(TP plan, EP plan) of `model` for this layout, module names expanded."""
    try:
        # Private, hence the pinned Transformers: it merges class and config plans and expands `layers.*`.
        tp_plan, ep_plan, _ = model._resolve_parallel_plans(layout)
    except ValueError as e:
        raise ConfigError(f"parallelism sizes do not fit this model: {e}") from None
    return tp_plan, ep_plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict | None = None) -> None:
    """Shard the plan's layers (default: the model's TP plan) over `tp_mesh`, still on `meta`."""
    if plan is None:
        plan, _ = parallel_plans(model, DistributedConfig(tp_size=tp_mesh.size()))
    try:
        apply_tensor_parallelism(model, tp_mesh, plan)
    except KeyError as e:  # Mistral 3's plan names its tied output layer, which Transformers 5.24 cannot find
        raise ConfigError(
            f"parallelism.tp_size is {tp_mesh.size()} but Transformers cannot apply the TP plan of "
            f"model_type {model.config.model_type!r} (it names {e}, which the model does not hold apart); "
            f"set parallelism.tp_size=1"
        ) from None
    for name, module in model.named_modules():
        if plan.get(name) == GRAD_ALL_REDUCE:
            _all_reduce_each_gradient(module, tp_mesh.get_group())


def _all_reduce_each_gradient(module: nn.Module, group) -> None:
    """Sum this replicated module's partial parameter gradients over tp, each backward's before it is
    accumulated. Transformers all-reduces `.grad` after accumulation instead, which sums the earlier
    micro-batches' already-reduced gradients again (x tp) when `.grad` is kept between backward passes,
    as FSDP2 does under set_requires_gradient_sync(False)."""
    vars(module).pop("forward", None)  # drop Transformers' wrapper, which adds the post-accumulate hook
    hooked: dict[str, nn.Parameter] = {}

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    def hook_params(mod: nn.Module, _args) -> None:
        # On forward, not now: FSDP swaps in its unsharded parameter, and loading replaces placeholders.
        if torch.is_grad_enabled():
            for name, param in mod.named_parameters(recurse=False):
                if param.requires_grad and hooked.get(name) is not param:
                    param.register_hook(all_reduce)
                    hooked[name] = param

    module.register_forward_pre_hook(hook_params)
