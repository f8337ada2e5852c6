"""A new run's weights: an HF checkpoint (each rank reading its own shards' bytes), a SHARDED export, or a
world-size-independent init."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from common.architectures import auto_class
from common.checkpoint_layout import Layout, checkpoint_layout, files_alone
from common.config import Config
from common.model import base_name, base_state, has_adapters, init_weights


def load_or_init_weights(model: nn.Module, cfg: Config) -> None:
    """A new run's weights: a SHARDED export, an HF checkpoint, or a world-size-independent init; then,
    with LoRA, the adapters' initialisation."""
    source = cfg.model.name_or_path
    if source and is_sharded_export(source):
        load_sharded_export(model, source)
    elif source:
        load_hf_weights(model, source, cfg.fsdp.cpu_ram_efficient_loading, cfg.model.trust_remote_code)
    else:
        # OPT's, RWKV's and others' configs have no initializer_range: Transformers' own default then
        init_weights(model, cfg.train.seed, getattr(model.config, "initializer_range", 0.02))
    if has_adapters(model):
        from common import lora  # LoRA's module, where lora.r asks for it

        lora.init_adapters(model, cfg.train.seed)


def is_sharded_export(path: str) -> bool:
    return os.path.exists(os.path.join(path, ".metadata"))


def load_sharded_export(model: nn.Module, path: str) -> None:
    """The model's weights from a DCP directory (a SHARDED export); with LoRA adapters, the base's."""
    dcp.load({"model": base_weights(model)}, checkpoint_id=path)  # in place, into the model's own tensors


def load_hf_weights(
    model: nn.Module, path: str, broadcast_from_rank0: bool, trust_remote_code: bool = False
) -> None:
    """Fill a sharded model from an HF checkpoint: each rank reads only its own shards' bytes, in place (DCP's
    HF reader), so it holds its share plus one tensor; of fused experts, its own (common/experts.py); FP8
    blocks times their scales, and MXFP4 experts (common/quantized.py). With LoRA, the base (PEFT names)."""
    ours = base_weights(model)
    layout = checkpoint_layout(model, path, ours)
    if layout.why_not:
        if dist.get_rank() == 0:
            print(f"{path}: {layout.why_not}; loading it whole through from_pretrained", file=sys.stderr)
        load_converted(model, path, broadcast_from_rank0, trust_remote_code)
        return
    # A tied weight's second name and the buffers missing from the files (which keep the values their
    # construction gave them, common/architectures.py, as from_pretrained's do) are left out.
    wanted = {layout.names[name]: tensor for name, tensor in ours.items() if name in layout.names}
    with files_alone(path, layout.files) as directory:
        reader = HuggingFaceStorageReader(directory, thread_count=4)  # files read at once per rank
        dcp.load(wanted, storage_reader=reader)  # in place, into the model's own tensors
    if layout.fused or layout.scales or layout.mxfp4:
        load_experts_and_dequantize(model, ours, layout)
    # The export's names: the renames loading used (checkpoint_layout.keep_release_names).
    model._weight_conversions = layout.conversions


def load_experts_and_dequantize(model: nn.Module, ours: dict[str, torch.Tensor], layout: Layout) -> None:
    """Fused MoE experts, each rank its own (common/experts.py), and FP8 or MXFP4 weights dequantized
    (common/quantized.py): modules imported only for a checkpoint that holds such weights."""
    from common import experts, quantized

    experts.load_own_experts(model, ours, layout.fused, quantized.expert_dequantizer(layout.expert_scales))
    quantized.dequantize_own_blocks(ours, layout.scales)
    quantized.dequantize_own_mxfp4(ours, layout.mxfp4)


def base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict (its own tensors, local shards) under the base's names, adapters left out."""
    return base_state(get_model_state_dict(model))


def load_converted(model: nn.Module, path: str, broadcast_from_rank0: bool, trust_remote_code: bool) -> None:
    """The whole checkpoint through from_pretrained, which applies the model's key renames and weight
    conversions: on rank 0, then broadcast, with broadcast_from_rank0; else on every rank."""
    full = {}
    if dist.get_rank() == 0 or not broadcast_from_rank0:
        from common.quantized import dequantizing  # a quantized release loaded whole is dequantized too

        kwargs = dict(trust_remote_code=trust_remote_code, **dequantizing(path))
        full = auto_class(model.config).from_pretrained(path, dtype=torch.float32, **kwargs).state_dict()
        ours = {base_name(name): name for name in get_model_state_dict(model)}
        full = {ours.get(name, name): tensor for name, tensor in full.items()}
    adapters = has_adapters(model)
    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0, strict=not adapters
    )
    set_model_state_dict(model, full, options=options)
