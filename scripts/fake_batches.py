"""The micro-batch scripts/estimate_memory.py runs its fake steps on: token ids of the config's shape, and an
image-text release's images as its processor gives them. Fake tensors: shapes, no values."""

from __future__ import annotations

import torch

from common.config import ConfigError
from common.data.batches import Batch


def fake_batch(micro_batch: int, seq_len: int, hf_config, documents: bool, images: int) -> Batch:
    """`documents`: position ids per packed document or SFT example, which CP attention masks by.
    `images`: each row's images, as an image-text release's processor gives them (image_inputs)."""
    input_ids = torch.randint(0, hf_config.get_text_config().vocab_size, (micro_batch, seq_len))
    batch = Batch(input_ids=input_ids, labels=input_ids.clone())
    if documents:  # a packed row of real tokens
        batch.position_ids = torch.arange(seq_len).expand(micro_batch, -1)
        batch.token_mask = torch.ones_like(input_ids, dtype=torch.bool)
    if images:
        batch.images = image_inputs(hf_config, micro_batch, seq_len, images)
    return batch


def image_inputs(hf_config, micro_batch: int, seq_len: int, images: int) -> dict:
    """What the processor of a release with fixed-size images (Gemma 3) returns for `images` per row:
    pixel values at the vision tower's resolution, and token types. Fake tensors hold no values, so which
    tokens are image tokens is not known: the features' size is what counts. Releases whose image token
    count follows each image's size (Qwen-VL's image_grid_thw, Mistral 3's image_sizes) read those sizes
    on the host, which fake tensors cannot give."""
    per_image = getattr(hf_config, "mm_tokens_per_image", None)
    if per_image is None:
        raise ConfigError(
            f"--images-per-row is {images} but model_type {hf_config.model_type!r} sizes each image's tokens "
            f"by the image, which the planner cannot run on fake tensors; plan its text rows with "
            f"--images-per-row 0 (fixed-size image releases, such as gemma3, are planned with images)"
        )
    if images * per_image > seq_len:
        raise ConfigError(
            f"--images-per-row is {images} but {images} x {per_image} image tokens exceed data.seq_len "
            f"{seq_len}; give fewer images or a longer data.seq_len"
        )
    size = hf_config.vision_config.image_size
    return {
        "pixel_values": torch.randn(micro_batch * images, 3, size, size),
        "token_type_ids": torch.zeros(micro_batch, seq_len, dtype=torch.long),
    }
