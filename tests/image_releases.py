"""Test-only: what an image-text release ships beside its weights, made here with no download, and image-text
records in TRL's format.

- `add_processor(arch, config, path)`: the release's tokenizer with its image tokens, its config pointing at
  them, and its processor (image processor, chat template) saved as AutoProcessor loads it. Only processors
  that run without torchvision can be made here: Gemma 3's (its PIL image processor). Qwen-VL's processor
  needs a video processor, and Mistral 3's (Pixtral's) torchvision itself.
- `write_shape_records(folder, count)`: the built-in shapes task's records as a JSONL file and PNG images.
"""

from __future__ import annotations

import json
import os

import transformers

from common.data.image_records import EMBEDDED_IMAGE_TOKENS, shape_records
from launch import release_tokenizer

WITH_PROCESSOR = ["gemma3"]
# The test releases' chat template with image parts: each {"type": "image"} becomes the release's placeholder.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% if m['role'] == 'assistant' %}<|eos|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GEMMA3_TOKENS = EMBEDDED_IMAGE_TOKENS  # the names and strings its tokenizer_config.json gives


def add_processor(arch: str, config, path) -> None:
    """Gemma 3's tokenizer with its image tokens, the config's ids for them, and its processor with 4 image
    tokens per 16x16 image (the vision tower's 4x4 patches, pooled to 2x2), under `path`."""
    assert arch in WITH_PROCESSOR, arch
    release_tokenizer().save_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=GEMMA3_TOKENS)
    tokenizer.save_pretrained(path)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA3_TOKENS.items()}
    config.image_token_id, config.boi_token_index, config.eoi_token_index = (
        ids["image_token"],
        ids["boi_token"],
        ids["eoi_token"],
    )
    config.mm_tokens_per_image = 4
    images = transformers.Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
    transformers.Gemma3Processor(
        images, tokenizer, chat_template=TEMPLATE, image_seq_length=4
    ).save_pretrained(path)


def write_shape_records(folder, count: int, name: str = "train.jsonl", split: str = "train") -> str:
    """The built-in shapes task's first `count` records of `split` as files: `folder`/`name`, its images as
    PNGs under `folder`/images/, named relative to it."""
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        for index, record in enumerate(shape_records(split)[:count]):
            image = f"images/{split}-{index}.png"
            record["images"][0].save(os.path.join(folder, image))
            f.write(json.dumps({"messages": record["messages"], "images": [image]}) + "\n")
    return path
