"""Weights in and out: resume checkpoints, HF loading (optionally rank-0 + broadcast), the final export.

Everything is written to `<name>.tmp` and renamed into place once complete on every rank, so a crash never
leaves a half-written directory under a final name, and `resume: auto` never picks one.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from common.config import Config, ConfigError, resolve_mixed_precision
from common.faults import inject_fault
from common.model import init_weights

STEP_DIR = re.compile(r"^step-(\d+)$")
TRAIN_STATE = "train_state.json"
WRITER_THREADS = 4


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def find_resume_checkpoint(run_dir: str, resume: str) -> str | None:
    """`auto`: the newest complete checkpoint of this run (or None); `none`: None; else the given path."""
    if resume == "none":
        return None
    if resume != "auto":
        if not os.path.exists(os.path.join(resume, TRAIN_STATE)):
            raise ConfigError(
                f"checkpoint.resume {resume!r} is not a complete checkpoint directory "
                f"(no {TRAIN_STATE}); use auto, none, or a checkpoints/step-N path"
            )
        return resume
    root = checkpoints_dir(run_dir)
    steps = [int(m[1]) for m in map(STEP_DIR.match, os.listdir(root) if os.path.isdir(root) else []) if m]
    complete = [s for s in sorted(steps) if os.path.exists(os.path.join(root, f"step-{s}", TRAIN_STATE))]
    return os.path.join(root, f"step-{complete[-1]}") if complete else None


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """Tensors only: DCP unpickles any non-tensor value on load, and we never unpickle.

    The optimizer's param_groups (lr, betas, ...) are not saved: they come from the config and the
    scheduler, whose state goes to train_state.json.
    """
    optim = get_optimizer_state_dict(model, optimizer)  # allocates the state of a fresh optimizer
    state = {
        "model": get_model_state_dict(model),
        "optim": optim["state"],
        "rng": {"cpu": torch.get_rng_state()},
    }
    if torch.cuda.is_available():
        state["rng"]["cuda"] = torch.cuda.get_rng_state()
    return state, optim["param_groups"]


def save_checkpoint(
    run_dir: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict,
    keep_latest: int,
    tokenizer=None,
) -> str:
    """DCP of model + optimizer + RNG, plus train_state.json (step, samples, scheduler, data position)."""
    root = checkpoints_dir(run_dir)
    final = os.path.join(root, f"step-{step}")
    tmp = f"{final}.tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of a save that crashed
            if name.endswith(".tmp") and STEP_DIR.match(name[: -len(".tmp")]):
                shutil.rmtree(os.path.join(root, name))
    dist.barrier()
    state, _ = _training_state(model, optimizer)
    # Several writer threads per rank keep the disk busy while tensors are serialised.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, thread_count=WRITER_THREADS))
    inject_fault(step, run_dir, during_save=True)  # test hook: a crash in the middle of the write
    dist.barrier()  # every rank's shard is on disk before the checkpoint gets its final name
    if dist.get_rank() == 0:
        publish_checkpoint(tmp, final, train_state, model.config, tokenizer, keep_latest)
    dist.barrier()
    return final


def publish_checkpoint(
    tmp: str, final: str, train_state: dict, model_config, tokenizer, keep_latest: int
) -> None:
    """Complete a written `step-N.tmp` (train state, config and tokenizer, so eval_cp.py can evaluate it
    directly), rename it to `step-N`, and drop all but the newest `keep_latest`. One process only."""
    with open(os.path.join(tmp, TRAIN_STATE), "w") as f:
        json.dump(train_state, f)
    model_config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    publish(tmp, final)
    root = os.path.dirname(final)
    steps = sorted(int(m[1]) for m in map(STEP_DIR.match, os.listdir(root)) if m)
    for old in steps[:-keep_latest]:
        shutil.rmtree(os.path.join(root, f"step-{old}"))


def _check_shapes(path: str, model: nn.Module) -> None:
    """A checkpoint of another model fails here with the first differing tensor, not deep inside DCP."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, param in get_model_state_dict(model).items():
        entry = saved.get(f"model.{name}")
        here = list(param.shape)
        there = list(entry.size) if entry is not None and hasattr(entry, "size") else None
        if there != here:
            raise ConfigError(
                f"checkpoint {path} holds a different model ({name} is {there} there, {here} here); "
                f"use a new checkpoint.dir for this model, or checkpoint.resume=none"
            )


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG in place (DCP reshards to this world size); returns
    train_state (step, samples, data position)."""
    _check_shapes(path, model)
    state, param_groups = _training_state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, {"state": state["optim"], "param_groups": param_groups})
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return restore_train_state(path, optimizer, scheduler)


def restore_train_state(path: str, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """Scheduler and learning rate from a checkpoint's train_state.json; returns it (step, samples, data)."""
    with open(os.path.join(path, TRAIN_STATE)) as f:
        train_state = json.load(f)
    scheduler.load_state_dict(train_state["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # load_state_dict restores the schedule, not the lr already applied to the optimizer
    return train_state


def _hf_state_dict(path: str, trust_remote_code: bool) -> dict[str, torch.Tensor]:
    # from_pretrained (rather than reading safetensors by hand) applies the model's own key renames and
    # weight conversions, so any architecture Transformers loads works here.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    return model.state_dict()


def load_hf_weights(
    model: nn.Module, path: str, broadcast_from_rank0: bool, trust_remote_code: bool = False
) -> None:
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


def load_or_init_weights(model: nn.Module, cfg: Config, init_std: float) -> None:
    """Fill a sharded, materialised model that starts a run: from a SHARDED export, an HF checkpoint, or a
    fresh world-size-independent init (a resumed run loads its checkpoint instead)."""
    source = cfg.model.name_or_path
    if source and is_sharded_export(source):
        load_sharded_export(model, source)  # DCP reshards to this world size
    elif source:
        load_hf_weights(
            model,
            source,
            broadcast_from_rank0=cfg.fsdp.cpu_ram_efficient_loading,
            trust_remote_code=cfg.model.trust_remote_code,
        )
    else:
        init_weights(model, cfg.train.seed, init_std)


def export_final(model: nn.Module, cfg: Config, tokenizer, device_type: str) -> str:
    """The run's result in `<checkpoint.dir>/export`, per fsdp.state_dict_type; returns the path."""
    export_dir = os.path.join(cfg.checkpoint.dir, "export")
    prepare_for_generation(model, tokenizer, from_scratch=not cfg.model.name_or_path)
    if cfg.fsdp.state_dict_type == "FULL_STATE_DICT":
        dtype = getattr(torch, resolve_mixed_precision(cfg.fsdp, device_type)["param_dtype"])
        export_full(model, export_dir, tokenizer, dtype)
    else:
        export_sharded(model, export_dir, tokenizer)
    return export_dir


def prepare_for_generation(model: nn.Module, tokenizer, from_scratch: bool) -> None:
    """The exported config as generate() needs it: the KV cache back on (training turns it off), and for a
    model built from model.config, whose ids are LlamaConfig's defaults, the tokenizer's own special ids
    (a model loaded from model.name_or_path keeps its own)."""
    model.config.use_cache = model.generation_config.use_cache = True
    if not from_scratch or tokenizer is None:
        return
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, name, getattr(tokenizer, name))
        setattr(model.generation_config, name, getattr(tokenizer, name))


def publish(tmp: str, final: str) -> None:
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
        write_hf_directory(model, tmp, {k: v.to(dtype) for k, v in state.items()}, tokenizer, dtype)
        publish(tmp, out_dir)
    dist.barrier()


def write_hf_directory(model: nn.Module, out_dir: str, state: dict, tokenizer, dtype: torch.dtype) -> None:
    """safetensors + config + generation config + tokenizer, with config.dtype the dtype actually written."""
    model.save_pretrained(out_dir, state_dict=state)
    # save_pretrained records the dtype of the model's own (fp32 master) parameters, not of `state`.
    model.config.dtype = dtype
    model.config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    # safetensors arrive 0600 (written through a temporary file), the rest 0644: give all the mode a plain
    # open() would, so whoever may read the config may read the weights.
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, name), 0o666 & ~umask)


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
        publish(tmp, out_dir)
    dist.barrier()


def is_sharded_export(path: str) -> bool:
    return os.path.exists(os.path.join(path, ".metadata"))


def load_sharded_export(model: nn.Module, path: str) -> None:
    """Load a SHARDED_STATE_DICT export into an FSDP model of any world size (DCP reshards)."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
