"""Weights in Hugging Face's formats: a new run's weights (an HF checkpoint, a SHARDED export, or a fresh
init) and the final export. Written under `<name>.tmp` and renamed once complete, like the checkpoints."""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files_on_every_rank,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import WeightConverter, get_model_conversion_mapping
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from common import lora, manifest
from common.config import Config, resolve_mixed_precision
from common.model import init_weights

SAFE_WEIGHTS_NAME = "model.safetensors"
INDEX = "model.safetensors.index.json"
ONE_FILE = "model-00001-of-00001.safetensors"  # torch's name for one consolidated file


def save_config(out_dir: str, model_config, tokenizer) -> None:
    model_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def finish_export(tmp: str, out_dir: str, known: dict | None = None) -> None:
    """One process: the manifest (files, sizes, checksums: common/manifest.py; `known`: the entries the ranks
    computed), then the rename."""
    manifest.write_manifest(tmp, known)
    move_into_place(tmp, out_dir)


def move_into_place(tmp: str, final: str) -> None:
    """`tmp`, complete, becomes `final`; a previous `final` goes only once the new one is in place."""
    old = f"{final}.old"
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_hf_weights(
    model: nn.Module, path: str, broadcast_from_rank0: bool, trust_remote_code: bool = False
) -> None:
    """Fill a sharded model from an HF checkpoint. Each rank reads only the byte ranges of its own shards
    (DCP's Hugging Face reader), in place, so no rank holds more than its share plus one tensor. A checkpoint
    whose values Transformers converts as it loads (per-expert weights it fuses) goes through from_pretrained.
    With LoRA adapters the checkpoint fills the base, under PEFT's names; the adapters are left as they are
    (common/lora.py initialises them)."""
    ours = base_weights(model)
    names, why_not = direct_layout(model, path, ours)
    if why_not:
        if dist.get_rank() == 0:
            print(f"{path}: {why_not}; loading it whole through from_pretrained", file=sys.stderr)
        load_converted(model, path, broadcast_from_rank0, trust_remote_code)
        return
    # A tied weight's second name and the buffers missing from the files (which keep the values their
    # construction gave them, common/architectures.py, as from_pretrained's do) are left out.
    wanted = {names[name]: tensor for name, tensor in ours.items() if name in names}
    reader = HuggingFaceStorageReader(path, thread_count=4)  # files read at once per rank
    dcp.load(wanted, storage_reader=reader)  # in place, into the model's own tensors


def base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under the base model's names, LoRA adapters left out. Its tensors are the
    model's own (its local shards), so loading into them in place loads the model."""
    return lora.base_state(get_model_state_dict(model))


def direct_layout(model: nn.Module, path: str, ours: dict) -> tuple[dict, str | None]:
    """{our name: its key in the checkpoint's safetensors files}, and why the files cannot be read straight
    into `ours` (None when they can): Transformers converts some of their values as it loads, or a name of
    ours, other than a buffer or a tied weight's second name, is not in them."""
    keys = []
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, framework="pt") as f:
            keys += f.keys()
    if not keys:
        return {}, "it has no safetensors files"
    names, transforms = {}, get_model_conversion_mapping(model)
    for key in keys:  # Transformers' key renames are followed (GPT-NeoX's embed_out is lm_head)
        name = key
        for transform in transforms:
            name, matched = transform.rename_source_key(name)
            if matched and isinstance(transform, WeightConverter):
                return names, f"Transformers converts {key!r} as it loads"
        names[name] = key
    aliases = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(parameter, []).append(lora.base_name(name))
    skip = {name for same in aliases.values() if names.keys() & same for name in same}
    skip |= {lora.base_name(name) for name, _ in model.named_buffers()}
    missing = next((name for name in ours if name not in names and name not in skip), None)
    return names, missing and f"{missing} is not in its files"


def load_converted(model: nn.Module, path: str, broadcast_from_rank0: bool, trust_remote_code: bool) -> None:
    """The whole checkpoint through from_pretrained, which applies the model's key renames and weight
    conversions: on rank 0, then broadcast, with broadcast_from_rank0; else on every rank."""
    full = {}
    if dist.get_rank() == 0 or not broadcast_from_rank0:
        full = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=trust_remote_code
        ).state_dict()
        ours = {lora.base_name(name): name for name in get_model_state_dict(model)}
        full = {ours.get(name, name): tensor for name, tensor in full.items()}
    adapters = lora.has_adapters(model)
    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0, strict=not adapters
    )
    set_model_state_dict(model, full, options=options)


def load_or_init_weights(model: nn.Module, cfg: Config, init_std: float) -> None:
    """A new run's weights: a SHARDED export, an HF checkpoint, or a world-size-independent init; then,
    with LoRA, the adapters' initialisation."""
    source = cfg.model.name_or_path
    if source and is_sharded_export(source):
        load_sharded_export(model, source)
    elif source:
        load_hf_weights(model, source, cfg.fsdp.cpu_ram_efficient_loading, cfg.model.trust_remote_code)
    else:
        init_weights(model, cfg.train.seed, init_std)
    if lora.has_adapters(model):
        lora.init_adapters(model, cfg.train.seed)


def export_final(model: nn.Module, cfg: Config, tokenizer, device_type: str) -> str:
    """`<checkpoint.dir>/export`, per fsdp.state_dict_type; returns the path."""
    export_dir = os.path.join(cfg.checkpoint.dir, "export")
    prepare_for_generation(model, tokenizer, from_scratch=not cfg.model.name_or_path)
    dtype = export_dtype(cfg, device_type)
    adapters = lora.has_adapters(model)
    if adapters and not cfg.lora.merge_on_export:  # small: gathered to rank 0 whatever state_dict_type says
        export_adapters(model, cfg, export_dir, tokenizer)
    elif adapters or cfg.fsdp.state_dict_type == "FULL_STATE_DICT":  # with LoRA: the merged model
        export_full(model, export_dir, tokenizer, dtype, cfg)
    else:
        export_sharded(model, export_dir, tokenizer)
    return export_dir


def export_dtype(cfg: Config, device_type: str) -> torch.dtype:
    """checkpoint.export_dtype; by default the compute dtype (bf16 on CUDA unless the config says so)."""
    return getattr(
        torch, cfg.checkpoint.export_dtype or resolve_mixed_precision(cfg.fsdp, device_type)["param_dtype"]
    )


def prepare_for_generation(model: nn.Module, tokenizer, from_scratch: bool) -> None:
    """The KV cache back on; a model from model.config takes the tokenizer's special ids (not Llama's)."""
    model.config.use_cache = model.generation_config.use_cache = True
    if not from_scratch or tokenizer is None:
        return
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, name, getattr(tokenizer, name))
        setattr(model.generation_config, name, getattr(tokenizer, name))


def export_full(model: nn.Module, out_dir: str, tokenizer, dtype: torch.dtype, cfg: Config) -> None:
    """save_pretrained's layout, split at checkpoint.max_shard_size, every rank writing its part: DCP writes
    each rank's own shards, cast to `dtype`, to part files; then rank r assembles output files r, r + world,
    ... from them (torch's consolidation), so no rank holds more than its share plus one tensor. LoRA
    adapters, if any, are merged into each rank's shards first. A model whose weights Transformers converts
    back as it saves (per-expert weights it fused on load) is gathered to rank 0 and saved there."""
    state = get_model_state_dict(model)
    keys = saved_keys(model, lora.base_state(state))
    if keys is None:
        export_on_rank0(model, out_dir, tokenizer, dtype, cfg)
        return
    if lora.has_adapters(model):
        state = lora.merged(state, cfg.lora)  # under the base model's names, still sharded
    tmp, parts = f"{out_dir}.tmp", os.path.join(f"{out_dir}.tmp", "parts")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    state = {keys[name]: t.to(dtype) for name, t in state.items() if name in keys}  # .to: each rank's shards
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=cfg.checkpoint.max_shard_size
    )
    order = sorted(split.filename_to_tensors)
    file_of = {key: order.index(file) + 1 for key, file in split.tensor_to_filename.items()}
    files = order if split.is_sharded else [ONE_FILE]  # torch's names: save_pretrained's, or 1 of 1
    writer = HuggingFaceStorageWriter(parts, file_of, thread_count=4, save_distributed=True)
    writer.sync_files = False  # scratch files, deleted once assembled: no fsync (FileSystemWriter's own flag)
    dcp.save(state, storage_writer=writer)
    del state
    # Private in torch 2.13, and it drops any key missing from file_of: file_of names every key.
    consolidate_safetensors_files_on_every_rank(parts, tmp, file_of, num_threads=4)
    own = [file for i, file in enumerate(files, 1) if i % dist.get_world_size() == dist.get_rank()]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, manifest.describe(tmp, own))  # each rank checksums the files it wrote
    if dist.get_rank() == 0:
        shutil.rmtree(parts)
        if split.is_sharded:
            write_index(model, tmp, split)  # save_pretrained's, in place of torch's
        else:  # save_pretrained's one file: model.safetensors, and no index
            os.replace(os.path.join(tmp, ONE_FILE), os.path.join(tmp, SAFE_WEIGHTS_NAME))
            os.remove(os.path.join(tmp, INDEX))
        save_model_config(model, tmp, tokenizer, dtype)
        known = {n: e for entries in every for n, e in entries.items()}
        finish_export(tmp, out_dir, {SAFE_WEIGHTS_NAME if n == ONE_FILE else n: e for n, e in known.items()})
    dist.barrier()


def saved_keys(model: nn.Module, state: dict) -> dict[str, str] | None:
    """{our name: the key save_pretrained writes it under}: tied weights' second names left out, Transformers'
    renames reverted, as save_pretrained does; None where reverting converts values. Worked out on meta
    tensors, so it costs no memory."""
    meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in state.items()}
    ours = {id(t): name for name, t in meta.items()}
    saved = revert_weight_conversion(model, remove_tied_weights_from_state_dict(meta, model))
    if any(id(t) not in ours for t in saved.values()):
        return None
    return {ours[id(t)]: key for key, t in saved.items()}


def write_index(model: nn.Module, out_dir: str, split) -> None:
    """The index save_pretrained writes where the weights are split into several files."""
    content = {
        "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
        "weight_map": split.tensor_to_filename,
    }
    with open(os.path.join(out_dir, INDEX), "w", encoding="utf-8") as f:
        f.write(json.dumps(content, indent=2, sort_keys=True) + "\n")


def export_on_rank0(model: nn.Module, out_dir: str, tokenizer, dtype: torch.dtype, cfg: Config) -> None:
    # Gathered to rank 0 on CPU one tensor at a time, so no GPU ever holds the whole model.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        tmp = f"{out_dir}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if lora.has_adapters(model):
            state = lora.merged(state, cfg.lora)
        state = {k: v.to(dtype) for k, v in state.items()}
        write_hf_directory(model, tmp, state, tokenizer, dtype, cfg.checkpoint.max_shard_size)
        finish_export(tmp, out_dir)
    dist.barrier()


def export_adapters(model: nn.Module, cfg: Config, out_dir: str, tokenizer) -> None:
    """PEFT's adapter directory (fp32 adapters), with the tokenizer and generation config. The adapters are
    gathered from every rank's shards (accelerate#4206 lost all but rank 0's on a FULL_STATE_DICT resume)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    full = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        tmp = f"{out_dir}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        lora.write_adapters(full, cfg.lora, cfg.model.name_or_path, tmp)
        save_config(tmp, model.generation_config, tokenizer)
        plain_modes(tmp)
        finish_export(tmp, out_dir)
    dist.barrier()


def write_hf_directory(
    model: nn.Module, out_dir: str, state: dict, tokenizer, dtype: torch.dtype, max_shard_size: str | int
) -> None:
    """save_pretrained's layout: one file, or files of at most max_shard_size and their index."""
    model.save_pretrained(out_dir, state_dict=state, max_shard_size=max_shard_size)
    save_model_config(model, out_dir, tokenizer, dtype)


def save_model_config(model: nn.Module, out_dir: str, tokenizer, dtype: torch.dtype) -> None:
    # save_pretrained records the dtype of the model's own (fp32 master) parameters, not the export's.
    model.config.dtype = dtype
    model.config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    plain_modes(out_dir)


def plain_modes(out_dir: str) -> None:
    """safetensors arrive 0600, the rest 0644: give all the mode a plain open() would."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, name), 0o666 & ~umask)


def export_sharded(model: nn.Module, out_dir: str, tokenizer) -> None:
    tmp = f"{out_dir}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=tmp)
    if dist.get_rank() == 0:
        save_config(tmp, model.config, tokenizer)
        finish_export(tmp, out_dir)
    dist.barrier()


def is_sharded_export(path: str) -> bool:
    return os.path.exists(os.path.join(path, ".metadata"))


def load_sharded_export(model: nn.Module, path: str) -> None:
    """The model's weights from a DCP directory (a SHARDED export); with LoRA adapters, the base's."""
    dcp.load({"model": base_weights(model)}, checkpoint_id=path)  # in place, into the model's own tensors
