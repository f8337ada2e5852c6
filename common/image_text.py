"""Image-text releases (Qwen3.5, Gemma 3, Mistral 3, Qwen3-VL): a vision tower, a projector and a language
model, built whole as the release's own class so that the checkpoint's names go in and come out. On text
data only the language model is trained; the vision side is frozen by default (docs/finetune.md,
"Image-text releases")."""

from __future__ import annotations

from torch import nn

from common.config import ConfigError, ModelConfig

# Transformers' names for the module that maps image features into the language model's embeddings
# (LLaMA-Factory's projector keys): Gemma 3, Llama 4, Mistral 3; Qwen-VL's visual.merger; Gemma 4.
PROJECTORS = ("multi_modal_projector", "merger", "embed_vision")


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
