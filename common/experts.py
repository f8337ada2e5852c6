"""MoE expert weights in and out of Hugging Face's per-expert layout, each rank its own experts.

Checkpoints store one tensor per expert (`experts.3.gate_proj.weight`); Transformers fuses them as it loads
into one tensor per layer (`experts.gate_up_proj`, [experts, 2 x intermediate, hidden]) and splits them back
as it saves. FSDP and EP shard that fused tensor on the experts' dim, so a rank's shard is a run of whole
experts: it reads only those experts' tensors and fuses them with Transformers' own converter, and at export
splits its own experts back with Transformers' reverse converter."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import ExitStack

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    Transpose,
    WeightConverter,
    revert_weight_conversion,
)


def stacks_experts(converter: WeightConverter) -> bool:
    """Transformers stacks one tensor per expert on dim 0 (MergeModulelist), then at most concatenates on
    other dims: the experts of a shard's rows are then built from those experts' tensors alone."""
    ops = converter.operations
    return (
        len(converter.target_patterns) == 1
        and isinstance(ops[0], MergeModulelist)
        and ops[0].dim == 0
        and all(isinstance(op, Concatenate) and op.dim > 0 for op in ops[1:])
    )


def read_per_rank(
    layout, converter: WeightConverter, pattern: str, key: str, file: str, name: str, ours: dict
) -> bool:
    """Whether `key` of `file`, which Transformers converts into our `name` as it loads, is read per rank; if
    so it goes into `layout` (common/checkpoint_layout.py): tensors it stacks per expert, each rank fusing its
    own experts' (load_own_experts), or a fused weight it transposes from another layout than the model's,
    read as it is where it has the model's."""
    if stacks_experts(converter):
        _, sources = layout.fused.setdefault(name, (converter, {}))
        sources.setdefault(pattern, []).append((key, file))
        return True
    if transposes_other_layouts(converter) and name in ours:
        with safe_open(file, framework="pt") as f:
            if f.get_slice(key).get_shape() == list(ours[name].shape):
                layout.names[name] = key
                return True
    return False


def transposes_other_layouts(converter: WeightConverter) -> bool:
    """Transformers transposes a fused expert weight (Qwen3-VL-MoE's) that a release stores in another layout
    than the model's, and leaves one in the model's layout as it is (Transpose's check_dims)."""
    ops = converter.operations
    return len(converter.source_patterns) == 1 and all(
        isinstance(op, Transpose) and op.check_dims for op in ops
    )


def loads_whole(model: nn.Module) -> bool:
    """Transformers converts some of the model's checkpoint weights as it loads other than by stacking
    experts, so a checkpoint holding them loads whole, through from_pretrained (the planner's figure). A
    weight it transposes from another layout is taken to be in the model's, as save_pretrained writes it."""
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return any(not (stacks_experts(t) or transposes_other_layouts(t)) for t in converters)


def load_own_experts(model: nn.Module, ours: dict, fused: dict, dequantize: Callable | None = None) -> None:
    """Fill this rank's shards of the fused expert weights (`fused`: {our name: (Transformers' converter,
    {source pattern: [(key, file)], experts in order})}, common/checkpoint_layout.py). `dequantize(key,
    tensor, read)`: an expert's weight from the values read (FP8 releases, common/quantized.py)."""
    with ExitStack() as files:
        opened = {}

        def read(key: str, file: str) -> torch.Tensor:  # each file opened once, closed with `files`
            if file not in opened:
                opened[file] = files.enter_context(safe_open(file, framework="pt"))
            tensor = opened[file].get_tensor(key)
            return dequantize(key, tensor, read) if dequantize else tensor

        for name, (converter, sources) in fused.items():
            if name in ours:  # else from_pretrained reports it unexpected, and leaves it
                load_own_shard(model, ours[name], name, converter, sources, read)


def load_own_shard(
    model: nn.Module,
    shard: torch.Tensor,
    name: str,
    converter: WeightConverter,
    sources: dict,
    read: Callable[[str, str], torch.Tensor],
) -> None:
    """The shard of the fused weight `name`: Transformers' converter run on the experts in the shard's rows
    only, so the rank reads its share, then cut to the shard's other dims (FSDP splits those when it has
    fewer experts than ranks). `read(key, file)`: a tensor of the checkpoint."""
    box = local_box(shard)
    if box[0].start == box[0].stop:
        return  # an empty shard (FSDP's padding)
    converter = copy.deepcopy(converter)
    for pattern, located in sources.items():
        for key, file in located[box[0]]:
            converter.add_tensor(name, key, pattern, read(key, file))
    [fused] = converter.convert(name, model=model, config=model.config).values()
    local = shard.to_local() if isinstance(shard, DTensor) else shard
    with torch.no_grad():
        local.copy_(fused[(slice(None), *box[1:])])


def local_box(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The part of the whole weight this rank's tensor holds: DCP's chunk of a DTensor, all of a tensor."""
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, size) for size in tensor.shape)
    [chunk] = tensor.__create_chunk_list__()  # what DCP saves and loads this rank's shard as
    return tuple(slice(offset, offset + size) for offset, size in zip(chunk.offsets, chunk.sizes))


def own_experts(
    model: nn.Module, name: str, weight: torch.Tensor, keys: list[str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """{key: tensor} of the experts this rank writes from its shard of the fused weight `name`, split back
    by Transformers' converter and cast to `dtype`. `keys`: what the whole weight splits into, experts
    0..E-1 for each of its sources (gate, then up), in the converter's order."""
    experts = weight.shape[0]
    weight, turn, turns = whole_experts(weight)
    rows = local_box(weight)[0]
    if rows.start == rows.stop:
        return {}  # an empty shard (FSDP's padding)
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    pieces = revert_weight_conversion(model, {name: local.to(dtype)})  # the rank's experts, from 0
    mine = {}
    for i, tensor in enumerate(pieces.values()):
        if i % turns != turn:
            continue  # another rank holding these experts writes it
        source, expert = divmod(i, rows.stop - rows.start)
        # a gathered weight goes once this rank has copied out its own tensors
        mine[keys[source * experts + rows.start + expert]] = (
            tensor.to("cpu", copy=True) if turns > 1 else tensor
        )
    return mine


def whole_experts(weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A fused expert weight whose shard holds whole experts: where FSDP splits experts themselves (fewer
    experts than ranks to shard them over), gathered across the ranks that split them; and this rank's
    turn among the ranks then holding the same experts, and their number (each writes every turns-th of
    their tensors)."""
    if not split_within_experts(weight):
        return weight, 0, 1
    mesh, placements = weight.device_mesh, weight.placements
    within = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim > 0]
    gathered = weight.redistribute(
        placements=[Replicate() if i in within else p for i, p in enumerate(placements)]
    )
    turn, turns = 0, 1
    for i in within:
        turn, turns = turn * mesh.size(i) + mesh.get_local_rank(i), turns * mesh.size(i)
    return gathered, turn, turns


def split_within_experts(tensor: torch.Tensor) -> bool:
    """FSDP splits this fused expert weight on a dim other than the experts' (fewer experts than ranks)."""
    return isinstance(tensor, DTensor) and any(isinstance(p, Shard) and p.dim > 0 for p in tensor.placements)


def split_experts_over(mesh: DeviceMesh):
    """FSDP2 splits dim 0, here the rank's experts. With fewer of them than ranks to split over (Mixtral's 8
    experts at ep 8 on 16 GPUs: 1 expert, 2 ranks), some ranks would hold all the expert weights and the
    others none; split a weight dim instead."""

    def placement(param: nn.Parameter) -> Shard:
        shape = param.to_local().shape if isinstance(param, DTensor) else param.shape  # EP: this rank's
        if shape[0] >= mesh.size():
            return Shard(0)
        return Shard(max(range(len(shape)), key=lambda dim: shape[dim]))

    return placement
