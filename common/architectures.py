"""What differs between the decoder architectures Transformers ships, found from the config and the class
Transformers maps it to, not from lists of names: which models the recipes train, which class builds each,
and which attention each can use (docs/features.md, "Which models")."""

from __future__ import annotations

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
