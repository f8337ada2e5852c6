"""FSDP2 in torchtitan's order: activation checkpointing, compile, then `fully_shard` on each unit
bottom-up, then on the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as ac
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from common.config import ConfigError, FsdpConfig, class_names, resolve_mixed_precision


def resolve_layer_classes(model: nn.Module, fsdp: FsdpConfig) -> set[str]:
    """transformer_layer_cls_to_wrap, or the model's `_no_split_modules` when empty, or else the class of its
    layer stack (BioGPT, CTRL and OpenAI-GPT name none); names must exist."""
    given = class_names(fsdp.transformer_layer_cls_to_wrap)
    names = set(given or getattr(model, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    if (
        not given
    ):  # a model's own list may name its multimodal sibling's classes (Qwen3.5-MoE's vision blocks)
        names = (names & present) or repeated_block(model)
    if missing := names - present:
        raise ConfigError(
            f"fsdp.transformer_layer_cls_to_wrap names {sorted(missing)}, not in this model; "
            f"its classes are: {', '.join(sorted(present))}"
        )
    if not names and fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        raise ConfigError(
            "fsdp.transformer_layer_cls_to_wrap is empty and the model has no _no_split_modules; "
            f"name the layer class, one of: {', '.join(sorted(present))}"
        )
    return names


def repeated_block(model: nn.Module) -> set[str]:
    """The class of the longest ModuleList of one class with parameters: the decoder's layers."""
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len({type(c) for c in m}) == 1]
    stacks = [m for m in stacks if len(m) and any(True for _ in m[0].parameters())]
    return {type(max(stacks, key=len)[0]).__name__} if stacks else set()


def _tied_parameter_owners(model: nn.Module) -> set[nn.Module]:
    first_owner: dict[int, nn.Module] = {}
    owners: set[nn.Module] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            first = first_owner.setdefault(id(param), module)
            if first is not module:
                owners.update((module, first))
    return owners


def _layer_name(module: nn.Module) -> str:
    while hasattr(module, "_checkpoint_wrapped_module"):  # AC's wrapper, maybe inside an offload wrapper
        module = module._checkpoint_wrapped_module
    return type(module).__name__


def _layers(model: nn.Module, layer_classes: set[str]) -> list[nn.Module]:
    """Each transformer layer once: its CheckpointWrapper if it has one, never also the layer inside it. A
    layer class inside another (Mamba's mixer in its block) comes first: fully_shard takes children first."""
    inside = {getattr(m, "_checkpoint_wrapped_module", None) for m in model.modules()}
    return [m for m in _post_order(model) if _layer_name(m) in layer_classes and m not in inside]


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def plan_units(
    model: nn.Module, fsdp: FsdpConfig, layer_classes: set[str], sharded: set[nn.Module] = frozenset()
) -> list[list[nn.Module]]:
    """The FSDP units below the root (each a list of modules sharing one all-gather). Owners of tied
    parameters stay with the root; `sharded` modules (experts, on their own mesh) are left out."""
    if fsdp.auto_wrap_policy == "NO_WRAP":
        return []
    tied = _tied_parameter_owners(model)
    if fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        units = [[m] for m in _layers(model, layer_classes)]
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if embed is not None and embed not in tied:
            units.append([embed])
        if head is not None and head not in tied:
            # norm and lm_head run back to back: one all-gather for both.
            final_norm = getattr(getattr(model, model.base_model_prefix, model), "norm", None)
            units.append([m for m in (final_norm, head) if m is not None])
        return units
    # SIZE_BASED_WRAP: bottom-up, wrap a module once its not-yet-wrapped parameters reach the threshold.
    # fully_shard cannot hook a ModuleList/ModuleDict's forward, so containers are skipped.
    units, claimed = [], {id(p) for m in sharded for p in m.parameters()}
    for module in _post_order(model):
        if module is model or isinstance(module, (nn.ModuleList, nn.ModuleDict)) or module in sharded:
            continue
        if any(sub in tied for sub in module.modules()):
            continue
        free = [p for p in module.parameters() if id(p) not in claimed]
        if sum(p.numel() for p in free) >= fsdp.min_num_params:
            units.append([module])
            claimed.update(id(p) for p in free)
    return units


def needed_first_in_backward(model: nn.Module, units: list[list[nn.Module]], layer_classes: set[str]):
    """torchtitan's rule: backward starts with the output layer and then the last transformer layer, so
    resharding them after forward frees what is all-gathered again at once. Only a TRANSFORMER_BASED_WRAP
    plan knows which units those are."""
    layers = [unit for unit in units if _layer_name(unit[0]) in layer_classes]
    head = model.get_output_embeddings()
    return [unit for unit in units if (layers and unit is layers[-1]) or any(m is head for m in unit)]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    fsdp: FsdpConfig,
    device_type: str,
    compile_layers: bool = False,
    experts: list[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
    training: bool = True,
) -> dict:
    """Shard `model` in place, each of `experts` as a unit on `expert_mesh`; returns counts for the log.
    `training=False` (forward only) reshards every unit after forward, as the key says."""
    layer_classes = resolve_layer_classes(model, fsdp)
    if fsdp.activation_checkpointing:  # before fully_shard, so FSDP's hooks see the wrappers
        from common.activation_checkpointing import checkpoint_layers

        checkpoint_layers(model, layer_classes, fsdp.ac_policy, fsdp.activation_checkpointing_offload)
    compiled = 0
    if compile_layers:
        for module in _layers(model, layer_classes):
            if not isinstance(getattr(module, "_orig_mod", None), nn.Module):
                module.compile()  # in place, so parameter names (and checkpoints) stay the same
                compiled += 1
    dtypes = resolve_mixed_precision(fsdp, device_type)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, dtypes["param_dtype"]), reduce_dtype=getattr(torch, dtypes["reduce_dtype"])
    )
    # pin_memory needs an accelerator; on a CPU-only box the default pin_memory=True fails.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if fsdp.cpu_offload else OffloadPolicy()
    kwargs = dict(
        reshard_after_forward=fsdp.reshard_after_forward, mp_policy=mp_policy, offload_policy=offload
    )
    for module in experts:  # the MoE recipe's (common/moe.py)
        from common.experts import split_experts_over

        fully_shard(module, mesh=expert_mesh, shard_placement_fn=split_experts_over(expert_mesh), **kwargs)
    units = plan_units(model, fsdp, layer_classes, set(experts))
    kept = []
    if (
        training
        and fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
        and fsdp.reshard_after_forward is not False
    ):
        kept = needed_first_in_backward(model, units, layer_classes)
    for unit in units:
        after_forward = False if unit in kept else fsdp.reshard_after_forward
        fully_shard(
            unit if len(unit) > 1 else unit[0], mesh=mesh, **dict(kwargs, reshard_after_forward=after_forward)
        )
    # The root's parameters (tied embeddings, say) are the first that backward needs.
    root_reshard = False if training else fsdp.reshard_after_forward
    fully_shard(model, mesh=mesh, **dict(kwargs, reshard_after_forward=root_reshard))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already divided by the global token count, so gradients must be summed, not
            # averaged. Forcing SUM also avoids PREMUL_SUM/AVG, which gloo lacks.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    own = {id(p) for m in experts for p in m.parameters()}  # experts are units of their own
    sizes = {id(p): p.numel() for unit in kept for m in unit for p in m.parameters() if id(p) not in own}
    return {
        "fsdp_units": len(experts) + len(units) + 1,
        "compiled_layers": compiled,
        "offloaded_layers": sum(isinstance(m, ac.OffloadWrapper) for m in model.modules()),
        "units_kept_after_forward": len(kept),
        "params_kept_after_forward": sum(sizes.values()),
    }


def reshard(model: nn.Module) -> None:
    """Free what forward left all-gathered. Units kept unsharded after forward are freed by backward; after a
    forward under no_grad their unsharded parameters stay registered, which DCP and exports must not see."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
