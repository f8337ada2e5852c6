"""Weights in and out: HF checkpoint loading (optionally rank-0 + broadcast) and the final export.

Everything is written to `<name>.tmp` and renamed into place once complete, so a crash never leaves a
half-written directory under the final name.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict


def _hf_state_dict(path: str, trust_remote_code: bool) -> dict[str, torch.Tensor]:
    # from_pretrained (rather than reading safetensors by hand) applies the model's own key renames and
    # weight conversions, so any architecture Transformers loads works here.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    return model.state_dict()


def load_hf_weights(model: nn.Module, path: str, broadcast_from_rank0: bool, trust_remote_code: bool = False) -> None:
    """Fill a sharded (FSDP) model from an HF checkpoint.

    broadcast_from_rank0 (fsdp.cpu_ram_efficient_loading): only rank 0 reads the files; the others pass an
    empty dict and receive each tensor by broadcast, keeping only their shard. Otherwise every rank reads
    the whole checkpoint and keeps its shard.
    """
    read_here = dist.get_rank() == 0 or not broadcast_from_rank0
    full = _hf_state_dict(path, trust_remote_code) if read_here else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0)
    set_model_state_dict(model, full, options=options)
    del full


def _publish(tmp: str, final: str) -> None:
    """Atomically swap a finished `tmp` directory into `final` (rank 0 only)."""
    old = f"{final}.old"
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def export_full(model: nn.Module, out_dir: str, tokenizer, dtype: torch.dtype) -> None:
    """FULL_STATE_DICT: one HF directory (safetensors + config + generation config + tokenizer)."""
    # Gathered to rank 0 on CPU one tensor at a time, so no GPU ever holds the whole model.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        tmp = f"{out_dir}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        state = {k: v.to(dtype) for k, v in state.items()}
        model.config.dtype = dtype
        model.save_pretrained(tmp, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _publish(tmp, out_dir)
    dist.barrier()


def export_sharded(model: nn.Module, out_dir: str, tokenizer) -> None:
    """SHARDED_STATE_DICT: a DCP directory with one file per rank, plus config and tokenizer for reloading."""
    tmp = f"{out_dir}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=tmp)
    if dist.get_rank() == 0:
        model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _publish(tmp, out_dir)
    dist.barrier()


def is_sharded_export(path: str) -> bool:
    return os.path.exists(os.path.join(path, ".metadata"))


def load_sharded_export(model: nn.Module, path: str) -> None:
    """Load a SHARDED_STATE_DICT export into an FSDP model of any world size (DCP reshards)."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
