"""Image-text releases (Qwen3.5, Gemma 3, Mistral 3, Qwen3-VL): a vision tower, a projector and a language
model, built whole as the release's own class so that the checkpoint's names go in and come out. On text
data only the language model is trained; the vision side is frozen by default (docs/finetune.md,
"Image-text releases")."""

from __future__ import annotations

import os
import shutil

from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers.conversion_mapping import get_model_conversion_mapping

from common.config import ConfigError, ModelConfig

# Transformers' names for the module that maps image features into the language model's embeddings
# (LLaMA-Factory's projector keys): Gemma 3, Llama 4, Mistral 3; Qwen-VL's visual.merger; Gemma 4.
PROJECTORS = ("multi_modal_projector", "merger", "embed_vision")
# What a processor needs beside the tokenizer, as AutoProcessor.save_pretrained writes it.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
PROCESSOR_FILES += ("chat_template.json", "chat_template.jinja")


def vision_parameters(model: nn.Module) -> tuple[list[str], list[str]]:
    """(the vision tower's, the projector's) parameter names: every parameter outside the language model
    and its output layer, found from the model's own get_decoder() and get_output_embeddings()."""
    names = {module: name for name, module in model.named_modules()}
    language = [names[model.get_decoder()], names[model.get_output_embeddings()]]
    tower, projector = [], []
    for name, _ in model.named_parameters():
        if any(name == prefix or name.startswith(f"{prefix}.") for prefix in language):
            continue
        (projector if set(name.split(".")) & set(PROJECTORS) else tower).append(name)
    return tower, projector


def freeze_vision(model: nn.Module, cfg: ModelConfig, image_text: bool) -> None:
    """model.freeze_vision_tower and model.freeze_multi_modal_projector (LLaMA-Factory's keys and defaults):
    a frozen parameter is sharded like the rest but gets no gradient and no optimizer state."""
    if not image_text:
        for key in ("freeze_vision_tower", "freeze_multi_modal_projector"):
            if not getattr(cfg, key):
                raise ConfigError(
                    f"model.{key} is false but {model.config.model_type!r} is a text model with no vision "
                    f"tower or projector; remove the key (it applies to image-text releases)"
                )
        return
    tower, projector = vision_parameters(model)
    frozen = tower if cfg.freeze_vision_tower else []
    frozen += projector if cfg.freeze_multi_modal_projector else []
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)


def gather_vision_units_once(model: nn.Module) -> None:
    """All-gather each FSDP unit of the vision side once, then free it. With gradient accumulation and a
    reduce dtype (bf16 compute, fp32 reduction), torch 2.13's FSDP2 reads every unit's unsharded parameter
    after each backward, also a unit that never ran forward (the vision blocks on text rows), and fails
    ('_unsharded_param') on one it never gathered."""
    tower, projector = vision_parameters(model)
    vision = {id(model.get_parameter(name)) for name in tower + projector}
    for module in model.modules():  # by identity: AC's wrapper leaves its prefix out of its own names
        own = {id(parameter) for parameter in module.parameters()}
        if isinstance(module, FSDPModule) and module is not model and own and own <= vision:
            module.unshard()
            module.reshard()


def conversion_mapping_as_built(model: nn.Module) -> list:
    """Transformers' weight renames for a release. fully_shard's classes (FSDPGemma3ForConditionalGeneration)
    are custom code to Transformers, which then skips the root's renames and scopes them under the base model.
    A release needs the root's (Gemma 3's language_model.model -> model.language_model), so the lookup sees
    the classes as built."""
    sharded = [(module, type(module)) for module in model.modules() if isinstance(module, FSDPModule)]
    for module, cls in sharded:
        module.__class__ = cls.__mro__[cls._orig_cls_mro_index]
    try:
        return get_model_conversion_mapping(model)
    finally:
        for module, cls in sharded:
            module.__class__ = cls


def copy_processor_files(source: str | None, out_dir: str) -> None:
    """The release's processor files (image sizes, the chat template) into the export beside the
    tokenizer's, so that AutoProcessor loads the export as it loaded the release. What the tokenizer wrote
    (its own chat template, from data.tokenizer) is kept."""
    if not source or not os.path.isdir(source):
        return
    for name in PROCESSOR_FILES:
        if os.path.isfile(os.path.join(source, name)) and not os.path.exists(os.path.join(out_dir, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
