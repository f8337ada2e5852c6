"""Model construction on `meta` and world-size-independent initialisation of sharded parameters."""

from __future__ import annotations

import copy
import os
import sys
import zlib

import torch
from accelerate import init_empty_weights
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, LlamaConfig, PretrainedConfig
from transformers.utils import logging as hf_logging

from common import architectures
from common.config import ConfigError, ModelConfig


def load_model_config(cfg: ModelConfig, seq_len: int | None = None) -> PretrainedConfig:
    """model.config or model.name_or_path's config; warns if seq_len exceeds its positions."""
    # Weights load and export once per run, on every rank: Transformers' progress bars would bury the log.
    hf_logging.disable_progress_bar()
    hf_config = _read_model_config(cfg)
    architectures.check_causal_lm(hf_config)
    if getattr(hf_config, "quantization_config", None) is not None:  # FP8 blocks dequantize as they load
        from common.quantized import check_quantization

        check_quantization(hf_config, cfg.name_or_path)
    # No KV cache: it costs memory, and with one Transformers misses packed sequences' restarting positions.
    hf_config.use_cache = hf_config.get_text_config().use_cache = False
    max_positions = getattr(hf_config.get_text_config(), "max_position_embeddings", None)
    if seq_len and max_positions and seq_len > max_positions and os.environ.get("RANK", "0") == "0":
        print(
            f"warning: data.seq_len ({seq_len}) exceeds the model's max_position_embeddings "
            f"({max_positions}); positions past it were never trained",
            file=sys.stderr,
            flush=True,
        )
    return hf_config


def _read_model_config(cfg: ModelConfig) -> PretrainedConfig:
    if not cfg.name_or_path:
        try:
            if "model_type" in cfg.config:  # any architecture, e.g. a tiny qwen3_moe
                return AutoConfig.for_model(**cfg.config)
            return LlamaConfig(**cfg.config)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"model.config is not a valid {cfg.config.get('model_type', 'llama')} config: {e}"
            ) from None
    if os.path.basename(os.path.normpath(cfg.name_or_path)) == "export" and not os.path.isdir(
        cfg.name_or_path
    ):
        raise ConfigError(
            f"model.name_or_path {cfg.name_or_path!r} does not exist: it is the export of a run not trained "
            f"here yet, so run that first (runs/debug_llama/export: the quickstart command in README.md)"
        )
    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        where = "a local directory" + ("" if os.path.isabs(cfg.name_or_path) else " or a reachable hub id")
        raise ConfigError(
            f"model.name_or_path {cfg.name_or_path!r} could not be loaded ({str(e).splitlines()[0]}); "
            f"give {where} (offline? set HF_HUB_OFFLINE=1 and use a local copy)"
        ) from None


def build_meta_model(
    hf_config: PretrainedConfig, cfg: ModelConfig, gradient_checkpointing: bool = False
) -> nn.Module:
    """The model's structure only: nothing is allocated until after sharding. Attention is
    model.attn_implementation, or else what Transformers picks for the model (sdpa where it supports it)."""
    try:
        with torch.device("meta"):
            model = architectures.auto_class(hf_config).from_config(
                hf_config,
                attn_implementation=cfg.attn_implementation,
                trust_remote_code=cfg.trust_remote_code,
                dtype=torch.float32,
            )
    except (ValueError, ImportError) as e:
        if cfg.attn_implementation is None:
            raise
        model_class = architectures.model_class(hf_config)
        supported = (
            f"it supports {', '.join(architectures.supported_attention(model_class))}, "
            if model_class
            else ""
        )
        raise ConfigError(
            f"model.attn_implementation is {cfg.attn_implementation!r}, which "
            f"{getattr(model_class, '__name__', 'this model')} cannot use ({str(e).splitlines()[0][:160]}); "
            f"{supported}or leave the key unset for Transformers' choice"
        ) from None
    image_text = architectures.is_image_text(hf_config)
    if image_text or not (cfg.freeze_vision_tower and cfg.freeze_multi_modal_projector):
        from common.image_text import freeze_vision  # an image-text release's, or the keys refused

        freeze_vision(model, cfg, image_text)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float) -> None:
    """Each full parameter from a generator seeded by (seed, name), keeping this rank's slice: 1, 2 or N ranks
    give the same model (HF's `_init_weights` on DTensors would draw the same numbers on every rank)."""
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            # The checkpoint-format name, without AC/compile wrapper prefixes, so AC does not change the init.
            name = f"{module_name}.{param_name}".lstrip(".").replace(_CHECKPOINT_PREFIX, "")
            name = name.replace("_orig_mod.", "").replace(".base_layer", "")  # LoRA: the base weight's name
            local = param.to_local() if isinstance(param, DTensor) else param
            generator = torch.Generator(device=local.device).manual_seed(seed ^ zlib.crc32(name.encode()))
            full = torch.empty(param.shape, dtype=torch.float32, device=local.device)
            if param_name == "bias":
                full.zero_()
            elif "norm" in type(module).__name__.lower():
                full.fill_(1.0)
            else:
                full.normal_(0.0, std, generator=generator)
                if getattr(module, "padding_idx", None) is not None:
                    full[module.padding_idx].zero_()
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                full = full.to_local()
            local.copy_(full)


@torch.no_grad()
def materialise(model: nn.Module, device: torch.device, cpu_offload: bool = False) -> None:
    """Allocate this rank's shards on `device` (the host with fsdp.cpu_offload), then compute every buffer,
    which `to_empty` leaves uninitialised (RoPE frequencies, Gemma's embedding scale, masks): the model is
    built once more with its parameters on `meta` and its buffers real, and each buffer is copied across by
    name (a list of names misses some). A loaded checkpoint then overwrites the persistent ones."""
    model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    if architectures.is_image_text(model.config):  # FSDP2 must have gathered each vision unit once
        from common.image_text import gather_vision_units_once

        gather_vision_units_once(model)
    if any(isinstance(buffer, FakeTensor) for buffer in model.buffers()):
        return  # the planner's fake tensors hold no values (and torch 2.11's reject Accelerate's meta init)
    config = copy.deepcopy(model.config)
    with init_empty_weights(include_buffers=False):  # Accelerate's: parameters on meta, buffers computed
        fresh = dict(type(model)._from_config(config, dtype=torch.float32).named_buffers())
    for name, buffer in model.named_buffers():
        name = name.replace(_CHECKPOINT_PREFIX, "").replace("_orig_mod.", "")  # AC's and compile's wrappers
        buffer.copy_(fresh[name].to(buffer.dtype))


# The seam LoRA needs in the dense path: PEFT (common/lora.py) moves a wrapped layer's weight to base_layer
# and adds lora_A and lora_B; loading and the export read and write the base checkpoint's names.
ADAPTERS = "lora_"  # in the name of every adapter parameter (lora_A, lora_B)


def base_name(name: str) -> str:
    """A parameter's name in the base checkpoint: PEFT moves a wrapped layer's weight to base_layer."""
    return name.replace(".base_layer", "")


def base_state(state: dict) -> dict:
    """A state dict under the base checkpoint's names, the adapters left out (the tensors themselves)."""
    return {base_name(n): t for n, t in state.items() if ADAPTERS not in n}


def has_adapters(model: nn.Module) -> bool:
    return any(ADAPTERS in name for name, _ in model.named_parameters())
