"""FSDP2 application: wrap policy, mixed precision, reshard, offload, activation checkpointing, compile.

Order matters and follows torchtitan: activation checkpointing, then compile, then `fully_shard` on
each unit bottom-up, then on the root.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from common.config import ConfigError, FsdpConfig, layer_class_names, resolve_mixed_precision


def resolve_layer_classes(model: nn.Module, fsdp: FsdpConfig) -> set[str]:
    """transformer_layer_cls_to_wrap, or the model's `_no_split_modules` when empty; names must exist."""
    names = set(layer_class_names(fsdp) or getattr(model, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    missing = names - present
    if missing:
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


def _replace_layers(model: nn.Module, classes: set[str], make) -> list[nn.Module]:
    """Swap every layer of the given classes for make(layer), in place; returns the new layers."""
    replaced = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in classes:
                new = make(child)
                parent.register_module(name, new)
                replaced.append(new)
    return replaced


def _tied_parameter_owners(model: nn.Module) -> set[nn.Module]:
    """Modules that hold a parameter shared with another module (e.g. tied embedding and lm_head)."""
    seen: dict[int, nn.Module] = {}
    owners: set[nn.Module] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen and seen[id(param)] is not module:
                owners.update((module, seen[id(param)]))
            seen.setdefault(id(param), module)
    return owners


def plan_units(
    model: nn.Module, fsdp: FsdpConfig, layer_classes: set[str], sharded: set[nn.Module] = frozenset()
) -> list[list[nn.Module]]:
    """The FSDP units below the root, in the order `fully_shard` is called (the root comes last).

    A unit is a list of modules that share one all-gather. Tied parameters must live in one unit, so
    their owners are never split off: they stay with the root. `sharded` modules (experts, already on
    their own mesh) are neither units here nor counted in a SIZE_BASED_WRAP size.
    """
    tied = _tied_parameter_owners(model)
    if fsdp.auto_wrap_policy == "NO_WRAP":
        return []
    if fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        # With activation checkpointing the unit is the CheckpointWrapper, never the layer inside it.
        inside_wrappers = {
            m._checkpoint_wrapped_module for m in model.modules() if hasattr(m, "_checkpoint_wrapped_module")
        }
        units = [[m] for m in model.modules() if _layer_name(m) in layer_classes and m not in inside_wrappers]
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if embed is not None and embed not in tied:
            units.append([embed])
        final_norm = getattr(getattr(model, model.base_model_prefix, model), "norm", None)
        if head is not None and head not in tied:
            # norm and lm_head run back to back: one all-gather for both. A tied head stays with the root.
            units.append([m for m in (final_norm, head) if m is not None])
        return units
    # SIZE_BASED_WRAP: bottom-up, wrap a module once its not-yet-wrapped parameters reach the threshold.
    # Containers are skipped because fully_shard cannot hook a ModuleList/ModuleDict's forward.
    units, claimed = [], {id(p) for m in sharded for p in m.parameters()}
    for module in _post_order(model):
        if (
            module is model
            or isinstance(module, (nn.ModuleList, nn.ModuleDict))
            or module in tied
            or module in sharded
        ):
            continue
        if any(sub in tied for sub in module.modules()):
            continue
        free = [p for p in module.parameters() if id(p) not in claimed]
        if sum(p.numel() for p in free) >= fsdp.min_num_params:
            units.append([module])
            claimed.update(id(p) for p in free)
    return units


def _layer_name(module: nn.Module) -> str:
    inner = getattr(module, "_checkpoint_wrapped_module", module)
    return type(inner).__name__


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    fsdp: FsdpConfig,
    device_type: str,
    compile_layers: bool = False,
    experts: list[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> dict:
    """Shard `model` in place per the fsdp config; returns {"fsdp_units": units (root included),
    "compiled_layers": layers compiled}, for the run's log.

    `experts` (expert-parallel modules) each become a unit on `expert_mesh`, whatever the wrap policy:
    their parameters are already split over `ep`, and FSDP shards them further over the mesh's other dims.
    """
    layer_classes = resolve_layer_classes(model, fsdp)
    if fsdp.activation_checkpointing:
        # Non-reentrant AC per transformer layer, applied before fully_shard so FSDP hooks see the wrapper.
        _replace_layers(
            model, layer_classes, lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        )
    compiled = 0
    if compile_layers:
        for module in model.modules():
            if _layer_name(module) in layer_classes and not isinstance(
                getattr(module, "_orig_mod", None), nn.Module
            ):
                module.compile()  # in place, so parameter names (and checkpoints) stay the same
                compiled += 1
    dtypes = resolve_mixed_precision(fsdp, device_type)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, dtypes["param_dtype"]), reduce_dtype=getattr(torch, dtypes["reduce_dtype"])
    )
    # pin_memory needs an accelerator; on a CPU-only box the default pin_memory=True fails.
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if fsdp.cpu_offload else OffloadPolicy()
    )
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=fsdp.reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload,
    )
    for module in experts:
        fully_shard(module, **{**kwargs, "mesh": expert_mesh})
    units = plan_units(model, fsdp, layer_classes, set(experts))
    for unit in units:
        fully_shard(unit if len(unit) > 1 else unit[0], **kwargs)
    fully_shard(model, **kwargs)
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in fsdp_modules:
        # The loss is already divided by the global token count, so gradients must be summed, not
        # averaged. Forcing SUM also avoids PREMUL_SUM/AVG, which gloo lacks.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return {"fsdp_units": len(experts) + len(units) + 1, "compiled_layers": compiled}
