"""Mixture-of-experts: Transformers' own TP and EP plans, then FSDP with our `fsdp` keys (common/wrap.py),
and router statistics. `from_pretrained(distributed_config=...)` would shard with its fixed plan, reading
the full checkpoint on every rank and without our wrap/reshard/AC/offload choices."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import DistributedConfig
from transformers.distributed.expert_parallel import apply_expert_parallelism
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

from common.config import ConfigError, ParallelismConfig
from common.tp import apply_tp, parallel_plans

DISPATCH = "ep_dispatch_experts"  # the EP plan's style for a layer's experts


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


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules the EP plan routes tokens to, one per MoE layer."""
    plan = getattr(model, "ep_plan", None) or {}
    dispatched = {name for name, style in plan.items() if style == DISPATCH}
    return [m for name, m in model.named_modules() if replace_layer_number_by_wildcard(name) in dispatched]


def no_load_balancing_loss(router_logits: tuple[torch.Tensor, ...], *args) -> torch.Tensor:
    """The auxiliary loss of a model that balances its experts without one (DeepSeek-V3's bias-adjusted
    routing, GLM-4.5's, ...): Transformers trains them with none."""
    return router_logits[0].new_zeros(())


def moe_parts(model: nn.Module) -> tuple[int, Callable] | None:
    """(experts per layer, the model's load-balancing loss), or None for a model without an expert plan."""
    experts = expert_modules(model)
    module = importlib.import_module(type(model).__module__)
    aux_loss = getattr(module, "load_balancing_loss_func", no_load_balancing_loss)
    recorded = (getattr(type(model.base_model), "_can_record_outputs", None) or {}).get("router_logits")
    # and a router that records them (DeepSeek-V4's hash-routed layers have none)
    records_router = recorded is not None and any(
        isinstance(m, recorded.target_class) for m in model.modules()
    )
    if not experts or not records_router:
        return None
    return next(experts[0].parameters()).shape[0], aux_loss


def apply_tp_ep(
    model: nn.Module, sizes: MoeSizes, dense_mesh: DeviceMesh, expert_mesh: DeviceMesh
) -> list[nn.Module]:
    """TP dense layers and EP experts, on `meta`; returns the modules FSDP shards over the expert mesh."""
    layout = DistributedConfig(
        dp_replicate_size=sizes.dp_replicate, fsdp_size=sizes.fsdp, tp_size=sizes.tp, ep_size=sizes.ep
    )
    tp_plan, ep_plan = parallel_plans(model, layout)
    if sizes.tp > 1:
        apply_tp(model, dense_mesh["tp"], tp_plan)
    if sizes.ep == 1:
        return []
    # The EP group's ranks exchange tokens; tp ranks holding the same batch split it first, so no token
    # is computed twice (see AllToAllEP in Transformers).
    apply_expert_parallelism(model, expert_mesh["ep"], dense_mesh["tp"], ep_plan, ep_implementation="auto")
    return expert_modules(model)


class RouterLogits:
    """Every router's logits in a forward, hooked on the model's router class: the model's own
    `router_logits` output is keyed on class names, which FSDP wrapping changes (SIZE_BASED_WRAP: empty)."""

    def __init__(self, model: nn.Module):
        spec = type(model.base_model)._can_record_outputs["router_logits"]
        self.logits: list[torch.Tensor] = []
        for module in model.modules():
            if isinstance(module, spec.target_class):
                module.register_forward_hook(lambda _, __, out: self.logits.append(out[spec.index]))

    def take(self) -> tuple[torch.Tensor, ...]:
        """One [tokens, experts] tensor per MoE layer. Call after each forward: activation checkpointing's
        recompute in backward appends again, which the next take() discards."""
        out, self.logits = tuple(self.logits), []
        return out


def router_load(router_logits: tuple[torch.Tensor, ...], top_k: int, valid: torch.Tensor) -> torch.Tensor:
    """[moe layers, experts]: real tokens each layer routed to each expert."""
    counts = []
    for logits in router_logits:
        chosen = logits.detach()[valid.flatten()].topk(top_k, dim=-1).indices
        counts.append(torch.bincount(chosen.flatten(), minlength=logits.shape[-1]))
    return torch.stack(counts)
