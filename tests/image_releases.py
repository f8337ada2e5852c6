"""Test-only: what an image-text release ships beside its weights, made here with no download, and image-text
records in TRL's format.

- `add_processor(arch, config, path)`: the release's tokenizer with its image tokens, its config pointing at
  them, and its processor (image processor, chat template) saved as AutoProcessor loads it: Gemma 3's, Gemma
  4's, Mistral 3's (PixtralProcessor), and Qwen3.5's and Qwen3-VL's (both Qwen3VLProcessor).
- `processor_without_torchvision()`: Qwen3-VL's and Gemma 4's processors hold a video processor, which needs
  torchvision. Without it, AutoProcessor builds them from the release's files with none (the recipes render
  no video, nor audio: Gemma 4's feature extractor is left out too); everything else is Transformers' own
  (the PIL image processor, the tokenizer's image tokens). Mistral 3's PixtralProcessor needs no torchvision,
  but its module imports it (`pixtral_processor_class`).
- `write_shape_records(folder, count)`: the built-in shapes task's records as a JSONL file and PNG images.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import types
from unittest import mock

import transformers

from common.data.image_records import EMBEDDED_IMAGE_TOKENS, shape_records
from launch import release_tokenizer

WITH_PROCESSOR = ["gemma3", "gemma4", "mistral3", "qwen3_5", "qwen3_vl"]
# The test releases' chat template with image parts: each {"type": "image"} becomes the release's placeholder.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}IMAGE{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% if m['role'] == 'assistant' %}<|eos|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GEMMA3_TOKENS = EMBEDDED_IMAGE_TOKENS  # the names and strings its tokenizer_config.json gives
QWEN_TOKENS = dict(image_token="<|image_pad|>", video_token="<|video_pad|>")
QWEN_TOKENS |= dict(vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>")
# Gemma 4's processor reads its audio and video tokens from the tokenizer too (and adds <|video|> if missing)
GEMMA4_TOKENS = dict(
    boi_token="<|image>", image_token="<|image|>", eoi_token="<image|>", video_token="<|video|>"
)
GEMMA4_TOKENS |= dict(boa_token="<|audio>", audio_token="<|audio|>", eoa_token="<audio|>")
PIXTRAL_TOKENS = dict(image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]")
# Built from their parts where torchvision is missing: the processor class, and the parts it holds then
WITHOUT_TORCHVISION = {"Qwen3VLProcessor": {"video_processor": None}}
WITHOUT_TORCHVISION |= {"Gemma4Processor": {"video_processor": None, "feature_extractor": None}}


def add_processor(arch: str, config, path) -> None:
    """The release's tokenizer with its image tokens, the config's ids for them, and its processor under
    `path`: 4 image tokens per 16x16 image (the vision tower's 4x4 patches, pooled or merged to 2x2);
    Gemma 4's processor resizes it to its token budget first (64 tokens); Mistral 3's ends each row of 2
    with [IMG_BREAK], the last with [IMG_END] (6 tokens)."""
    assert arch in WITH_PROCESSOR, arch
    tokens = {"gemma3": GEMMA3_TOKENS, "gemma4": GEMMA4_TOKENS, "mistral3": PIXTRAL_TOKENS}.get(
        arch, QWEN_TOKENS
    )
    release_tokenizer().save_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=tokens)
    tokenizer.save_pretrained(path)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in tokens.items()}
    if arch == "gemma3":
        config.image_token_id, config.boi_token_index, config.eoi_token_index = (
            ids["image_token"],
            ids["boi_token"],
            ids["eoi_token"],
        )
        config.mm_tokens_per_image = 4
        images = transformers.Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
        template = TEMPLATE.replace("IMAGE", "<start_of_image>")
        transformers.Gemma3Processor(
            images, tokenizer, chat_template=template, image_seq_length=4
        ).save_pretrained(path)
        return
    if arch == "mistral3":
        config.image_token_index = ids["image_token"]
        images = transformers.PixtralImageProcessorPil(
            size={"longest_edge": 16}, patch_size=config.vision_config.patch_size
        )
        pixtral_processor_class()(
            images,
            tokenizer,
            patch_size=config.vision_config.patch_size,
            spatial_merge_size=config.spatial_merge_size,
            chat_template=TEMPLATE.replace("IMAGE", "[IMG]"),
        ).save_pretrained(path)
        return
    for name, token_id in ids.items():  # image_token_id, video_token_id, vision_start_token_id, ...
        setattr(config, f"{name}_id", token_id)
    vision = config.vision_config
    if arch == "gemma4":  # its fewest soft tokens an image (70): the image resized to 64 of them
        transformers.Gemma4ImageProcessorPil(
            patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size, max_soft_tokens=70
        ).save_pretrained(path)
        placeholder, processor = "<|image|>", "Gemma4Processor"
    else:
        pixels = {"shortest_edge": 16 * 16, "longest_edge": 16 * 16}  # a 16x16 image as it is
        transformers.Qwen2VLImageProcessorPil(
            size=pixels,
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
        ).save_pretrained(path)
        placeholder, processor = "<|vision_start|><|image_pad|><|vision_end|>", "Qwen3VLProcessor"
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE.replace("IMAGE", placeholder))
    with open(os.path.join(path, "processor_config.json"), "w") as f:  # as save_pretrained writes it
        json.dump({"processor_class": processor}, f)


@contextlib.contextmanager
def processor_without_torchvision():
    """AutoProcessor as Transformers' own, except that without torchvision a Qwen3-VL or Gemma 4 processor is
    built with no video processor (which needs it; nor Gemma 4's audio feature extractor) from the release's
    image processor, tokenizer and template, and Mistral 3's PixtralProcessor comes from
    pixtral_processor_class."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):  # not installed, or a build for another torch
        torchvision = None
    if torchvision is not None:
        yield
        return
    load, check = (
        transformers.AutoProcessor.from_pretrained,
        transformers.ProcessorMixin.check_argument_for_proper_class,
    )

    def from_pretrained(path, *args, **kwargs):
        file = os.path.join(path, "processor_config.json")
        if not os.path.isfile(file):
            return load(path, *args, **kwargs)
        with open(file) as f:
            name = json.load(f)["processor_class"]
        if name == "PixtralProcessor":
            return pixtral_processor_class().from_pretrained(path, *args, **kwargs)
        if name not in WITHOUT_TORCHVISION:
            return load(path, *args, **kwargs)
        with open(os.path.join(path, "chat_template.jinja")) as f:
            template = f.read()
        images = transformers.AutoImageProcessor.from_pretrained(path)  # the PIL one
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        processor = getattr(transformers, name)(
            image_processor=images, tokenizer=tokenizer, chat_template=template, **WITHOUT_TORCHVISION[name]
        )
        processor.get_attributes = lambda: ["image_processor", "tokenizer"]  # what save_pretrained writes
        return processor

    def check_argument(self, name, argument):
        left_out = argument is None and any(name in parts for parts in WITHOUT_TORCHVISION.values())
        return None if left_out else check(self, name, argument)

    with (
        mock.patch.object(transformers.AutoProcessor, "from_pretrained", from_pretrained),
        mock.patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class", check_argument),
    ):
        yield


def pixtral_processor_class() -> type:
    """Transformers' PixtralProcessor, where torchvision is missing: it calls a size function of the
    torchvision image processor's module, which imports torchvision's transforms at its top for that
    processor alone. They are empty stand-ins while it is imported, and gone after."""
    names = [
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    ]
    missing = [name for name in names if name not in sys.modules]
    sys.modules.update({name: types.ModuleType(name) for name in missing})
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    finally:
        for name in missing:
            del sys.modules[name]
    return PixtralProcessor


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
