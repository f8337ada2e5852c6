"""The final export in Hugging Face's formats (FULL: save_pretrained's files, each rank writing its share;
SHARDED: DCP; LoRA: PEFT's adapter directory), written under `<name>.tmp` and renamed once complete, like the
checkpoints."""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from huggingface_hub.serialization import StateDictSplit, split_state_dict_into_shards_factory
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers.core_model_loading import build_glob_alternation, revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from common import export_check, manifest
from common.architectures import is_image_text
from common.checkpoint_layout import INDEX, keep_release_names
from common.config import Config, resolve_mixed_precision
from common.load_weights import base_weights, is_sharded_export
from common.model import base_state, has_adapters
from common.safetensors_writer import SafetensorsInPlace, safetensors_layout


def save_config(out_dir: str, model_config, tokenizer) -> None:
    model_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    if is_image_text(model_config):  # and its processor's files
        from common.image_text import copy_processor_files

        copy_processor_files(model_config.name_or_path, out_dir)


def finish_export(tmp: str, out_dir: str, known: dict | None = None) -> None:
    """One process: the manifest (common/manifest.py; `known`: the ranks' entries), then the rename."""
    manifest.write_manifest(tmp, known)
    move_into_place(tmp, out_dir)


def move_into_place(tmp: str, final: str) -> None:
    """`tmp`, complete and synced, becomes `final`; a previous `final` goes once the new one is in place."""
    old = f"{final}.old"
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    manifest.fsync_path(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(old, ignore_errors=True)


def export_final(model: nn.Module, cfg: Config, tokenizer, device_type: str) -> str:
    """`<checkpoint.dir>/export`, per fsdp.state_dict_type; returns the path."""
    export_dir = os.path.join(cfg.checkpoint.dir, "export")
    if cfg.model.name_or_path and not is_sharded_export(cfg.model.name_or_path):
        keep_release_names(model, cfg.model.name_or_path, base_weights(model))
    special = getattr(tokenizer, "tokenizer", tokenizer)  # image-text records' processor: its tokenizer's ids
    prepare_for_generation(model, special, from_scratch=not cfg.model.name_or_path)
    dtype = export_dtype(cfg, device_type)
    adapters = has_adapters(model)
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
    """save_pretrained's layout, split at checkpoint.max_shard_size, every rank writing its part: rank 0
    creates each output file with its header, then DCP's save has each rank write its own shards, cast to
    `dtype`, straight into their place in the files (SafetensorsInPlace), so no rank holds more than its
    share plus one tensor, and each byte is written once. LoRA adapters, if any, are merged into each rank's
    shards first. Expert weights Transformers fused on load are split back per expert by its own converter,
    each rank writing its own experts."""
    state = get_model_state_dict(model)
    # With LoRA: the merged weights, under the base model's names, still sharded
    if has_adapters(model):
        from common import lora  # LoRA's module, where lora.r asks for it

        state = lora.merged_weights(state, cfg.lora)
    else:
        state = base_state(state)
    whole, state = tensors_to_write(model, state, dtype)
    split = save_pretrained_split(whole, cfg.checkpoint.max_shard_size)
    files = split.filename_to_tensors  # one file: model.safetensors
    tmp, (headers, offsets) = f"{out_dir}.tmp", safetensors_layout(whole, files)
    export_check.check_free_space(tmp, needed := sum(size for _, size in headers.values()))  # sparse files
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for file, (header, size) in headers.items():
            with open(os.path.join(tmp, file), "wb") as f:
                f.write(header)
                f.truncate(size)
    dist.barrier()  # the files exist before any rank writes into them
    writer = SafetensorsInPlace(tmp, offsets)
    with export_check.full_disk_is_one_line(tmp, needed):
        if cfg.checkpoint.export_writers == "one":  # object-store mounts: one writer per file
            from common.export_one_writer import write_each_file_from_one_rank

            write_each_file_from_one_rank(writer, state, whole, files)
        else:
            dcp.save(state, storage_writer=writer)
    export_check.check_written(tmp, writer.written)  # each rank's bytes read back, before the manifest
    del state
    own = [file for i, file in enumerate(sorted(files), 1) if i % dist.get_world_size() == dist.get_rank()]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, manifest.file_entries(tmp, own))  # each rank checksums a share of the files
    if dist.get_rank() == 0:
        if split.is_sharded:
            write_index(model, tmp, split)
        save_model_config(model, tmp, tokenizer, dtype)
        finish_export(tmp, out_dir, {n: e for entries in every for n, e in entries.items()})
    dist.barrier()


def tensors_to_write(model: nn.Module, state: dict, dtype: torch.dtype) -> tuple[dict, dict]:
    """What save_pretrained writes for `state` (ours, the base model's names, sharded), cast to `dtype`:
    {key: a meta tensor of the whole weight} (save_pretrained_keys), and {key: this rank's tensor to
    write}: its shard of a weight, or the whole tensors of the experts its shard of a fused expert weight
    holds, split back by Transformers' converter."""
    dtypes = {name: saved_dtype(model, name, t, dtype) for name, t in state.items()}
    meta = {name: torch.empty(t.shape, dtype=dtypes[name], device="meta") for name, t in state.items()}
    whole, keys_of = save_pretrained_keys(model, meta)
    joined = joined_keys(keys_of)  # several weights in one key: Sarvam's query_key_value
    mine = {}
    if joined:
        from common.joined_weights import own_joined

        mine = own_joined(model, state, joined, dtypes)
    for name, keys in keys_of.items():
        if whole[keys[0]] is meta[name]:  # as it is: this rank's shard
            mine[keys[0]] = state[name].to(dtypes[name])
        elif keys[0] not in joined:  # a fused expert weight: experts 0..E-1 of each source
            from common.experts import own_experts  # MoE releases alone

            mine |= own_experts(model, name, state[name], keys, dtypes[name])
    return whole, mine


def joined_keys(keys_of: dict[str, list[str]]) -> dict[str, list[str]]:
    """{key: our names saved in it} for each key that several of our weights are saved in."""
    names: dict[str, list[str]] = {}
    for name, keys in keys_of.items():
        if len(keys) == 1:
            names.setdefault(keys[0], []).append(name)
    return {key: together for key, together in names.items() if len(together) > 1}


def saved_dtype(model: nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """`dtype`, as Transformers keeps it: integer tensors as they are, and the modules a model keeps in fp32
    (DeepSeek-V3's router weights and e_score_correction_bias in bf16 and fp16; more in fp16), by its own
    patterns (its `_get_dtype_plan`, private, hence the rule again)."""
    if not tensor.is_floating_point():
        return tensor.dtype
    half = dtype in (torch.float16, torch.bfloat16)
    kept = set(model._keep_in_fp32_modules_strict or ()) if half else set()
    kept |= set(model._keep_in_fp32_modules or ()) if dtype == torch.float16 else set()
    return torch.float32 if kept and build_glob_alternation(sorted(kept))[0].search(name) else dtype


def save_pretrained_keys(model: nn.Module, meta: dict) -> tuple[dict, dict]:
    """What save_pretrained writes for `meta` (our names: meta tensors of whole weights): {key: its meta
    tensor}, in its order (tied weights' second names left out, Transformers' renames and conversions
    reverted; the experts split back from a fused weight are views of it, as save_pretrained's are), and
    {our name: the keys it is written under}."""
    kept = remove_tied_weights_from_state_dict(meta, model)
    whole, ours = revert_weight_conversion(model, kept), {id(t): name for name, t in kept.items()}
    keys_of = {ours[id(t)]: [key] for key, t in whole.items() if id(t) in ours}
    for name in [name for name in kept if name not in keys_of]:  # fused on load (experts): split back
        keys_of[name] = list(revert_weight_conversion(model, {name: kept[name]}))
    return whole, keys_of


def save_pretrained_split(whole: dict, max_shard_size: int | str) -> StateDictSplit:
    """save_pretrained's split into files, reproduced on meta tensors: it keeps tensors that share storage
    (the experts it splits back from a fused weight are views of it) in one file, counted once at the
    storage's size. Meta tensors have no address to tell storages apart by, hence the storage's own id."""
    return split_state_dict_into_shards_factory(
        whole,
        get_storage_size=lambda t: t.untyped_storage().nbytes(),
        get_storage_id=lambda t: t.untyped_storage()._cdata,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )


def write_index(model: nn.Module, out_dir: str, split) -> None:
    """The index save_pretrained writes where the weights are split into several files."""
    content = {
        "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
        "weight_map": split.tensor_to_filename,
    }
    with open(os.path.join(out_dir, INDEX), "w", encoding="utf-8") as f:
        f.write(json.dumps(content, indent=2, sort_keys=True) + "\n")


def export_adapters(model: nn.Module, cfg: Config, out_dir: str, tokenizer) -> None:
    """PEFT's adapter directory (fp32 adapters), with the tokenizer and generation config. The adapters are
    gathered from every rank's shards (accelerate#4206 lost all but rank 0's on a FULL_STATE_DICT resume)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    full = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        tmp = f"{out_dir}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        excluded = model.peft_config["default"].exclude_modules  # PEFT's record of add_adapters' call
        from common import lora  # LoRA's module, where lora.r asks for it

        lora.write_adapters(full, cfg.lora, cfg.model.name_or_path, tmp, excluded)
        save_config(tmp, model.generation_config, tokenizer)
        set_plain_file_modes(tmp)
        finish_export(tmp, out_dir)
    dist.barrier()


def save_model_config(model: nn.Module, out_dir: str, tokenizer, dtype: torch.dtype) -> None:
    # save_pretrained records the dtype of the model's own (fp32 master) parameters, not the export's.
    model.config.dtype = dtype
    model.generation_config.save_pretrained(out_dir)
    save_config(out_dir, model.config, tokenizer)
    set_plain_file_modes(out_dir)


def set_plain_file_modes(out_dir: str) -> None:
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
