"""How a Hugging Face checkpoint's files fill a model, as from_pretrained reads them: the files it reads (the
index's), Transformers' key renames and the weights it fuses from per-expert tensors, FP8 weights' scales, and
the keys it would not use. Lists nothing: every rule is Transformers' own, asked of the model."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import tempfile
from collections.abc import Iterator

from safetensors import safe_open
from torch import nn
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from common.architectures import is_image_text
from common.config import ConfigError
from common.model import base_name

INDEX = "model.safetensors.index.json"
QUANTIZED = ("_scale_inv", "_blocks", "_scales")  # FP8 scales, MXFP4 blocks: common/quantized.py's keys


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files from_pretrained reads: those the index names, else model.safetensors."""
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(path, file) for file in json.load(f)["weight_map"].values()})
    return [file for file in [os.path.join(path, "model.safetensors")] if os.path.exists(file)]


@dataclasses.dataclass
class Layout:
    """How a checkpoint's files fill the model (checkpoint_layout)."""

    files: list[str]
    names: dict  # {our name: its key in the files}
    fused: dict  # {our name: (Transformers' converter, {source pattern: [(key, file)], in its order})}
    scales: dict  # FP8 weights: {our name: (its scales' key, their file)}
    why_not: str | None  # why the files cannot fill the model; None when they can
    conversions: list = dataclasses.field(default_factory=list)  # Transformers' transforms its keys used
    expert_scales: dict = dataclasses.field(default_factory=dict)  # FP8 experts: {key: (scales' key, file)}
    mxfp4: dict = dataclasses.field(default_factory=dict)  # {our name: ((blocks' key, file), (scales'...))}


def checkpoint_layout(model: nn.Module, path: str, ours: dict) -> Layout:
    """How the safetensors files fill `ours`, as from_pretrained reads them (Transformers' renames, such as
    GPT-NeoX's embed_out for lm_head, and converters), and why they cannot: Transformers converts some
    otherwise, or a name of ours, other than a buffer or a tied weight's second name, is not in them. A key
    the model does not use, that Transformers would not ignore either, is one line."""
    located, files = {}, checkpoint_files(path)
    for file in files:
        with safe_open(file, framework="pt") as f:
            located |= {key: (file, f.get_slice(key).get_dtype()) for key in f.keys()}
    layout = Layout(files, {}, {}, {}, None)
    if not located:
        layout.why_not = "it has no safetensors files"
        return layout
    transforms = conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    keys = sorted(located, key=dot_natural_key)  # Transformers' order: expert 2 before expert 10
    quantized = any(key.endswith(QUANTIZED) for key in keys)
    if quantized:  # a quantized release's scales and blocks are read beside their weights
        from common.quantized import attach_fp8_scales, set_aside_quantized_keys

        keys, scale_keys = set_aside_quantized_keys(layout, located, keys, renamings, converters)
    for key in keys:
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            layout.names[name] = key
        else:  # Transformers converts it as it loads: fused experts are read per rank (common/experts.py)
            from common.experts import read_per_rank

            if not read_per_rank(layout, by_pattern[pattern], pattern, key, located[key][0], name, ours):
                layout.why_not = f"Transformers converts {key!r} as it loads"
                return layout
    if quantized:
        attach_fp8_scales(layout, located, scale_keys, path)
    aliases = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(parameter, []).append(base_name(name))
    skip = {name for same in aliases.values() if layout.names.keys() & same for name in same}
    skip |= {base_name(name) for name, _ in model.named_buffers()}
    loaded = layout.names.keys() | layout.fused.keys() | layout.mxfp4.keys() | skip
    missing = next((n for n in ours if n not in loaded), None)
    if missing:  # from_pretrained then loads it, with its own word on any key it does not use
        layout.why_not = f"{missing} is not in its files"
        return layout
    layout.conversions = [t for t in transforms if t.was_used()]
    unused = [key for name, key in layout.names.items() if name not in ours and name not in skip]
    unused = [key for key in unused if not ignored_on_load(model, key)]
    if unused:
        raise ConfigError(
            f"model.name_or_path {path!r}: {located[unused[0]][0]} holds {unused[0]!r}"
            f"{f' and {len(unused) - 1} more keys' if len(unused) > 1 else ''}, which "
            f"{type(model).__name__} does not use (a scale or a part of another model?); give the checkpoint "
            f"of this model, as from_pretrained would load it"
        )
    return layout


def conversion_mapping(model: nn.Module) -> list:
    """Transformers' weight renames for the model (an image-text release's: common/image_text.py). A text
    model's are looked up on the sharded classes, which scope its type's under the base model as DeepSeek-V4
    needs; as the sharded root is custom code to it, its class's (GPT-NeoX's embed_out) are added here."""
    if is_image_text(model.config):
        from common.image_text import conversion_mapping_as_built

        return conversion_mapping_as_built(model)
    root = get_checkpoint_conversion_mapping(type(model).__name__.removeprefix("FSDP")) or []
    return root + get_model_conversion_mapping(model)


def keep_release_names(model: nn.Module, path: str, ours: dict) -> None:
    """save_pretrained reverts only the renames that loading used, which from_pretrained keeps in this
    attribute (no public setter), so the export keeps the release's names (DeepSeek-V4's embed_tokens, not
    the original format's embed). load_hf_weights sets it; a resumed run, which loaded no HF weights, here.
    A checkpoint loaded whole by from_pretrained is left to Transformers' default."""
    if getattr(model, "_weight_conversions", None) is None:
        layout = checkpoint_layout(model, path, ours)
        model._weight_conversions = None if layout.why_not else layout.conversions


def ignored_on_load(model: nn.Module, key: str) -> bool:
    """Whether from_pretrained drops `key` without a word: the model's own patterns (DeepSeek-V3's
    multi-token-prediction layer, say), and the RoPE and position buffers older checkpoints saved. Its
    method for this is private, hence the patterns again."""
    patterns = {*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())}
    patterns |= {r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}
    return any(re.search(pattern, key) for pattern in patterns)


@contextlib.contextmanager
def files_alone(path: str, files: list[str]) -> Iterator[str]:
    """`path`, or where it holds other safetensors files too (Mistral's consolidated.safetensors beside the
    shards), a directory of links to `files` alone: DCP's reader takes every file in its directory."""
    if sorted(glob.glob(os.path.join(path, "*.safetensors"))) == sorted(files):
        yield path
        return
    with tempfile.TemporaryDirectory() as directory:
        for file in files:
            os.symlink(os.path.abspath(file), os.path.join(directory, os.path.basename(file)))
        yield directory
