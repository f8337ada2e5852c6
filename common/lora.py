"""LoRA with FSDP2. PEFT's adapters go into the model on `meta`, before fully_shard, so each FSDP unit shards
its frozen base weights and its trainable adapters alike. Only the adapters get gradients, reduce-scatters and
optimizer state (the frozen base has no fp32 master copy), checkpoints hold the adapters alone, and the export
is PEFT's own adapter directory, or with lora.merge_on_export the merged model."""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor, distribute_tensor

from common.config import ConfigError, LoraConfig
from common.model import ADAPTERS, base_name

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig


def peft_config(
    lora: LoraConfig, base_model: str | None = None, exclude_modules: list | None = None
) -> PeftLoraConfig:
    # peft is imported where it is used: its 230 modules cost every run without adapters 0.6 s of start-up
    # per process, which the CPU test suite pays hundreds of times (docs/testing.md).
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        exclude_modules=exclude_modules,
        base_model_name_or_path=base_model,
        task_type="CAUSAL_LM",
    )


def add_adapters(model: nn.Module, lora: LoraConfig, device_type: str) -> None:
    """Inject the adapters (still on `meta`: nothing is allocated), freeze the base and give it its dtype;
    with lora.r = 0, nothing."""
    if not lora.r:
        return
    from peft import inject_adapter_in_model  # see peft_config

    try:
        # A module frozen already (an image-text release's vision tower) gets none, as in LLaMA-Factory.
        frozen = [
            n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad
        ]
        inject_adapter_in_model(peft_config(lora, exclude_modules=frozen or None), model)
    except ValueError:  # PEFT's NoMatchingPeftModuleError
        linear = sorted(
            {name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ConfigError(
            f"lora.target_modules {lora.target_modules!r} match no module of this model; its linear modules "
            f"are: {', '.join(linear)} (or use 'all-linear')"
        ) from None
    dtype = torch.bfloat16 if lora.base_dtype == "bfloat16" else torch.float32
    if lora.base_dtype == "auto":
        dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    for param in model.parameters():
        if not param.requires_grad:  # PEFT froze everything but the adapters
            param.data = param.data.to(dtype)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's initialisation, the same on any world size: lora_A as nn.Linear's (Kaiming uniform), from a
    generator seeded by (seed, name); lora_B zeros, so training starts from the base model's outputs."""
    for name, param in model.named_parameters():
        if ADAPTERS not in name:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        full = torch.zeros(param.shape, dtype=param.dtype, device=local.device)
        if ".lora_A." in name:  # seeded by the name without AC's wrapper: the same with and without AC
            key = name.replace(_CHECKPOINT_PREFIX, "").encode()
            generator = torch.Generator(device=local.device).manual_seed(seed ^ zlib.crc32(key))
            bound = 1 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=sqrt(5)) of a [r, in] weight
            full.uniform_(-bound, bound, generator=generator)
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        local.copy_(full)


def write_adapters(
    full: dict, lora: LoraConfig, base_model: str | None, out_dir: str, exclude_modules: list | None
) -> None:
    """PEFT's adapter directory from the gathered adapter weights `full`: adapter_model.safetensors and
    adapter_config.json, which PeftModel.from_pretrained(base, out_dir) loads."""
    # PEFT's names, without the adapter's name. Not get_peft_model_state_dict: it finds the adapters by module
    # name, which AC's wrapper changes, and then exports none (peft 0.21.2; tests/test_lora.py).
    weights = {k.replace(".default.", "."): v for k, v in full.items() if ADAPTERS in k}
    save_file(
        {f"base_model.model.{k}": v.contiguous() for k, v in weights.items()},
        f"{out_dir}/adapter_model.safetensors",
    )
    peft_config(lora, base_model, exclude_modules).save_pretrained(out_dir)


def merged_weights(state: dict, lora: LoraConfig) -> dict:
    """The base model's weights with every adapter folded in, W + (alpha / r) B A, under the base's names.
    Sharded weights stay sharded: the small adapters are gathered (a collective), B A is computed whole and
    each rank adds its own part to its shard, so the result is bit for bit the merge of the whole weights."""
    out = {}
    for name, weight in state.items():
        if ADAPTERS in name:
            continue
        if ".base_layer." in name:
            prefix = name.rsplit(".base_layer.", 1)[0]
            a, b = (state[f"{prefix}.lora_{x}.default.weight"] for x in "AB")
            a, b = ((t.full_tensor() if isinstance(t, DTensor) else t).float() for t in (a, b))
            delta = (lora.alpha / lora.r) * (b @ a)
            if isinstance(weight, DTensor):  # this rank's part, sliced here: no communication
                delta = distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None)
            weight = (weight.float() + delta).to(weight.dtype)
        out[base_name(name)] = weight
    return out
