"""What differs between the decoder architectures Transformers ships, found from the model itself, not from
lists of names: which models the recipes train, which attention each can use, the buffers its construction
computes, and whether it transforms its output layer's result (docs/features.md, "Which models")."""

from __future__ import annotations

import copy

import torch
from accelerate import init_empty_weights
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig
from transformers.models.auto import modeling_auto as auto

from common.config import ConfigError

MODALITIES = ("vision", "visual", "image", "video", "audio", "speech", "vq", "codec")  # in sub-config names


def check_causal_lm(hf_config: PretrainedConfig) -> None:
    """The recipes train decoder-only causal LMs: anything else is one line naming what is missing."""
    model_type = hf_config.model_type
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ConfigError(
            f"model_type {model_type!r} is an encoder-decoder model; the recipes train decoder-only causal "
            f"LMs (AutoModelForCausalLM)"
        )
    # BERT-likes attend both ways unless is_decoder is true; GPT-NeoX's is_decoder is a leftover, unread.
    encoder_family = (
        hasattr(hf_config, "add_cross_attention") or type(hf_config) in auto.MODEL_FOR_MASKED_LM_MAPPING
    )
    if getattr(hf_config, "is_decoder", None) is False and encoder_family:
        raise ConfigError(
            f"model_type {model_type!r} is an encoder (its config's is_decoder is false), which would train "
            f"bidirectionally; the recipes train decoder-only causal LMs (set is_decoder=true in its config "
            f"to train it as one)"
        )
    if is_image_text(hf_config):
        return  # its language model trains on text (and on images: common/image_text.py)
    # DBRX's and MPT's attn_config and ffn_config are parts of a text model; a modality's config is not.
    other = sorted(name for name in hf_config.sub_configs if any(word in name for word in MODALITIES))
    if not other and type(hf_config) in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:  # Fuyu: no tower
        other = ["an image-text model in Transformers"]
    if other:
        raise ConfigError(
            f"model_type {model_type!r} is a multimodal model ({', '.join(other)}); the recipes train its "
            f"language model alone: give the text model's checkpoint or config (text_config's model_type "
            f"{getattr(getattr(hf_config, 'text_config', None), 'model_type', '?')!r})"
        )
    if type(hf_config) not in auto.MODEL_FOR_CAUSAL_LM_MAPPING and not getattr(hf_config, "auto_map", None):
        raise ConfigError(
            f"model_type {model_type!r} has no causal-LM head in Transformers (AutoModelForCausalLM does "
            f"not know it); the recipes train decoder-only causal LMs"
        )


def is_image_text(hf_config: PretrainedConfig) -> bool:
    """An image-text release (Qwen3.5, Gemma 3, Llama 4, Mistral 3, Qwen3-VL): a vision tower, a projector
    and a language model, built as Transformers' image-text-to-text class."""
    return (
        type(hf_config) in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
        and "vision_config" in hf_config.sub_configs
    )


def auto_class(hf_config: PretrainedConfig) -> type:
    """The Auto class that builds the release as it ships: an image-text release whole, else a causal LM."""
    return AutoModelForImageTextToText if is_image_text(hf_config) else AutoModelForCausalLM


def supported_attention(model_class: type) -> list[str]:
    """The attn_implementation values Transformers accepts for the class (eager always)."""
    flags = {
        "sdpa": "_supports_sdpa",
        "flash_attention_2": "_supports_flash_attn",
        "flex_attention": "_supports_flex_attn",
    }
    return ["eager", *(name for name, flag in flags.items() if getattr(model_class, flag, False))]


def model_class(hf_config: PretrainedConfig) -> type | None:
    """Transformers' class for the config, as auto_class builds it; None for remote code."""
    image_text = is_image_text(hf_config)
    mapping = auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING if image_text else auto.MODEL_FOR_CAUSAL_LM_MAPPING
    return mapping.get(type(hf_config), None)


@torch.no_grad()
def init_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer as the model's own construction computes it, which `to_empty` left uninitialised: RoPE
    frequencies under any name, embedding scales (Gemma), masks. A list of names misses some, so the model is
    built once more with its parameters on `meta` and its buffers real, and each buffer is copied across by
    name. A loaded checkpoint then overwrites the persistent ones."""
    if any(isinstance(buffer, FakeTensor) for buffer in model.buffers()):
        return  # the planner's fake tensors hold no values (and torch 2.11's reject Accelerate's meta init)
    config = copy.deepcopy(model.config)
    with init_empty_weights(include_buffers=False):  # Accelerate's: parameters on meta, buffers computed
        fresh = dict(type(model)._from_config(config, dtype=torch.float32).named_buffers())
    for name, buffer in model.named_buffers():
        name = name.replace(_CHECKPOINT_PREFIX, "").replace("_orig_mod.", "")  # AC's and compile's wrappers
        buffer.copy_(fresh[name].to(buffer.dtype))


class _HiddenStates(dict):
    """A decoder's output holding only its last hidden state: any other field is None, by attribute or by
    index, and `**output` (image-text models re-wrap their language model's output) gives the one field."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__(last_hidden_state=hidden)

    def __getattr__(self, name: str) -> torch.Tensor | None:
        return self.get(name)

    def __getitem__(self, key: int | str) -> torch.Tensor | None:
        return self.get("last_hidden_state" if key == 0 else key)


@torch.no_grad()
def returns_head_output(model: nn.Module) -> bool:
    """Whether the model's forward returns its output layer's result as it is, found by running that forward
    on `meta` with the decoder and the head stubbed out (no kernels, no collectives, milliseconds): a model
    that scales or soft-caps its logits (Gemma 2/3, Cohere, Granite, ...) returns a new tensor. No list of
    config names keeps up with Transformers' models; none in Transformers 5.24 changes them in place."""
    head, decoder = model.get_output_embeddings(), model.get_decoder()
    hidden = torch.zeros(1, 2, head.weight.shape[1], device="meta")
    result = torch.zeros(1, 2, head.weight.shape[0], device="meta")
    own = {
        module: module.__dict__.get("forward") for module in (decoder, head)
    }  # a forward set on the instance
    decoder.forward = lambda *args, **kwargs: _HiddenStates(hidden)
    head.forward = lambda hidden: result
    try:
        return model(input_ids=torch.zeros(1, 2, dtype=torch.long, device="meta")).logits is result
    except RuntimeError:  # a forward that reads values on meta (ModernBERT-decoder's .item())
        return (
            True  # unknown here: the start-up loss check decides on real tensors (common/ops/loss_check.py)
        )
    finally:
        for module, forward in own.items():
            del module.forward
            if forward is not None:
                module.forward = forward
