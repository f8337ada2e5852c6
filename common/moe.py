"""Mixture-of-experts: Transformers' own TP and EP plans, then FSDP with our `fsdp` keys (common/wrap.py),
and router statistics. `from_pretrained(distributed_config=...)` would shard with its fixed plan, reading
the full checkpoint on every rank and without our wrap/reshard/AC/offload choices."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import DistributedConfig
from transformers.distributed.expert_parallel import apply_expert_parallelism
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard
from transformers.distributed.tensor_parallel import apply_tensor_parallelism

from common.config import ConfigError
from common.mesh import MoeSizes

DISPATCH = "ep_dispatch_experts"  # the EP plan's style for a layer's experts
GRAD_ALL_REDUCE = "replicated_with_grad_allreduce"  # TP style of Qwen3's q_norm/k_norm: partial gradients


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules the EP plan routes tokens to, one per MoE layer."""
    plan = getattr(model, "ep_plan", None) or {}
    dispatched = {name for name, style in plan.items() if style == DISPATCH}
    return [m for name, m in model.named_modules() if replace_layer_number_by_wildcard(name) in dispatched]


def check_moe(model: nn.Module, name: str) -> tuple[int, Callable]:
    experts = expert_modules(model)
    module = importlib.import_module(type(model).__module__)
    aux_loss = getattr(module, "load_balancing_loss_func", None)
    records_router = "router_logits" in (getattr(type(model.base_model), "_can_record_outputs", None) or {})
    if not experts or aux_loss is None or not records_router:
        raise ConfigError(
            f"model {name} is a {type(model).__name__}, not a mixture-of-experts model with an expert "
            f"plan; use scripts/pretrain_fsdp.py for dense models, or a Qwen3-MoE/Mixtral-style MoE"
        )
    return next(experts[0].parameters()).shape[0], aux_loss


def apply_tp_ep(
    model: nn.Module, sizes: MoeSizes, dense_mesh: DeviceMesh, expert_mesh: DeviceMesh
) -> list[nn.Module]:
    """TP dense layers and EP experts, on `meta`; returns the modules FSDP shards over the expert mesh."""
    layout = DistributedConfig(
        dp_replicate_size=sizes.dp_replicate, fsdp_size=sizes.fsdp, tp_size=sizes.tp, ep_size=sizes.ep
    )
    try:
        # Private, hence the pinned Transformers: it merges class and config plans and expands `layers.*`.
        tp_plan, ep_plan, _ = model._resolve_parallel_plans(layout)
    except ValueError as e:
        raise ConfigError(f"parallelism sizes do not fit this model: {e}") from None
    if sizes.tp > 1:
        apply_tensor_parallelism(model, dense_mesh["tp"], tp_plan)
        for name, module in model.named_modules():
            if tp_plan.get(name) == GRAD_ALL_REDUCE:
                _all_reduce_each_gradient(module, dense_mesh["tp"].get_group())
    if sizes.ep == 1:
        return []
    # The EP group's ranks exchange tokens; tp ranks holding the same batch split it first, so no token
    # is computed twice (see AllToAllEP in Transformers).
    apply_expert_parallelism(model, expert_mesh["ep"], dense_mesh["tp"], ep_plan, ep_implementation="auto")
    return expert_modules(model)


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
