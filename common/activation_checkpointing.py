"""Activation checkpointing (fsdp.activation_checkpointing): torch's non-reentrant checkpoint wrapper on the
transformer layers, all of them or every Nth (fsdp.ac_policy), optionally selective (the matmuls and attention
saved, the rest recomputed) or offloaded to host memory. Applied before fully_shard (common/wrap.py)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as ac
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# What fsdp.ac_policy="op" saves: the matmuls (experts' grouped ones too) and attention kernels, which hold
# nearly all of a layer's FLOPs. The elementwise ops and norms between them are recomputed in backward.
_ATEN = torch.ops.aten
SAVED_BY_OP_POLICY = {
    _ATEN.mm.default,
    _ATEN.addmm.default,
    _ATEN.bmm.default,
    _ATEN._grouped_mm.default,
    _ATEN._scaled_dot_product_flash_attention.default,
    _ATEN._scaled_dot_product_efficient_attention.default,
    _ATEN._scaled_dot_product_cudnn_attention.default,
    _ATEN._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_OP_POLICY else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_layers(
    model: nn.Module, layer_classes: set[str], policy: str | int, offload: bool = False
) -> None:
    """Non-reentrant AC of all layers ("full", "op") or of every Nth, counted back from the last so that it
    stays unwrapped: backward starts there, and recomputing it while all other layers' activations are
    alive would add a layer to the peak. `offload`, as Accelerate does it: torch's offload_wrapper keeps what
    each checkpoint saves, the layer's input, in host memory until backward (docs/memory.md)."""
    context = {}
    if policy == "op":
        context["context_fn"] = partial(create_selective_checkpoint_contexts, _save_matmuls_and_attention)
    layers = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in parent.named_children()
        if type(child).__name__ in layer_classes
    ]
    for from_last, (parent, name, layer) in enumerate(reversed(layers), start=1):
        if isinstance(policy, int) and from_last % policy:
            continue
        wrapped = ac.checkpoint_wrapper(layer, checkpoint_impl=ac.CheckpointImpl.NO_REENTRANT, **context)
        parent.register_module(name, ac.offload_wrapper(wrapped) if offload else wrapped)
