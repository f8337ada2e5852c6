"""Weights in and out: resume checkpoints, HF loading, the final export. Everything is written to
`<name>.tmp` and renamed once complete, so a crash never leaves a half-written one under a final name."""

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


def _steps(root: str) -> list[int]:
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m[1]) for m in map(STEP_DIR.match, names) if m)


def find_resume_checkpoint(run_dir: str, resume: str) -> str | None:
    """`auto`: this run's newest complete checkpoint, if any; `none`: None; else the given path. Rank 0
    decides and every rank takes its choice: ranks listing the directory themselves could disagree (a
    network filesystem's stale view on one node) and load different steps."""
    choice: list = [None, None]  # the path, or the error that stops every rank
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            choice[0] = _resume_checkpoint(run_dir, resume)
        except ConfigError as error:
            choice[1] = str(error)
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[1]:
        raise ConfigError(choice[1])
    return choice[0]


def _resume_checkpoint(run_dir: str, resume: str) -> str | None:
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
    complete = [s for s in _steps(root) if os.path.exists(os.path.join(root, f"step-{s}", TRAIN_STATE))]
    return os.path.join(root, f"step-{complete[-1]}") if complete else None


def _rng_key(saved: dict | None = None) -> str:
    """This rank's RNG entry. DCP keeps one copy of a plain tensor that every rank saves under one key
    (measured: rank 1 restored rank 0's state), so each rank saves its own. Resumed on more ranks, a rank
    the checkpoint has no entry for takes rank 0's."""
    own = f"rank{dist.get_rank() if dist.is_initialized() else 0}"
    return own if saved is None or f"rng.{own}.cpu" in saved else "rank0"


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer, rng_key: str) -> tuple[dict, list]:
    """Tensors only: DCP unpickles any non-tensor value on load. param_groups come from the config."""
    optim = get_optimizer_state_dict(model, optimizer)  # allocates the state of a fresh optimizer
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state = {"model": get_model_state_dict(model), "optim": optim["state"], "rng": {rng_key: rng}}
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
    root = checkpoints_dir(run_dir)
    final = os.path.join(root, f"step-{step}")
    tmp = f"{final}.tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of a save that crashed
            if name.endswith(".tmp") and STEP_DIR.match(name.removesuffix(".tmp")):
                shutil.rmtree(os.path.join(root, name))
    dist.barrier()
    state, _ = _training_state(model, optimizer, _rng_key())
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, thread_count=WRITER_THREADS))
    inject_fault(step, run_dir, during_save=True)
    dist.barrier()  # every rank's shard is on disk before the checkpoint gets its final name
    if dist.get_rank() == 0:
        publish_checkpoint(tmp, final, train_state, model.config, tokenizer, keep_latest)
    dist.barrier()
    return final


def _save_config(out_dir: str, model_config, tokenizer) -> None:
    model_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def publish_checkpoint(
    tmp: str, final: str, train_state: dict, model_config, tokenizer, keep_latest: int
) -> None:
    """Complete `step-N.tmp` (with config and tokenizer, for eval_cp.py), rename it, drop old ones."""
    with open(os.path.join(tmp, TRAIN_STATE), "w") as f:
        json.dump(train_state, f)
    _save_config(tmp, model_config, tokenizer)
    publish(tmp, final)
    root = os.path.dirname(final)
    for old in _steps(root)[:-keep_latest]:
        shutil.rmtree(os.path.join(root, f"step-{old}"))


def _check_shapes(path: str, model: nn.Module) -> None:
    """A checkpoint of another model fails here, not deep inside DCP."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, param in get_model_state_dict(model).items():
        entry, here = saved.get(f"model.{name}"), list(param.shape)
        there = list(entry.size) if hasattr(entry, "size") else None
        if there != here:
            raise ConfigError(
                f"checkpoint {path} holds a different model ({name} is {there} there, {here} here); "
                f"use a new checkpoint.dir for this model, or checkpoint.resume=none"
            )


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG in place (DCP reshards); returns train_state."""
    _check_shapes(path, model)
    rng_key = _rng_key(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    state, param_groups = _training_state(model, optimizer, rng_key)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, {"state": state["optim"], "param_groups": param_groups})
    rng = state["rng"][rng_key]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return restore_train_state(path, optimizer, scheduler)


def restore_train_state(path: str, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    with open(os.path.join(path, TRAIN_STATE)) as f:
        train_state = json.load(f)
    scheduler.load_state_dict(train_state["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # load_state_dict restores the schedule, not the lr already applied to the optimizer
    return train_state


def load_hf_weights(
    model: nn.Module, path: str, broadcast_from_rank0: bool, trust_remote_code: bool = False
) -> None:
    """Fill a sharded model from an HF checkpoint; with broadcast_from_rank0 only rank 0 reads the files."""
    full = {}
    if dist.get_rank() == 0 or not broadcast_from_rank0:
        # from_pretrained applies the model's own key renames and weight conversions.
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
        full = hf_model.state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0)
    set_model_state_dict(model, full, options=options)


def load_or_init_weights(model: nn.Module, cfg: Config, init_std: float) -> None:
    """A new run's weights: a SHARDED export, an HF checkpoint, or a world-size-independent init."""
    source = cfg.model.name_or_path
    if source and is_sharded_export(source):
        load_sharded_export(model, source)
    elif source:
        load_hf_weights(model, source, cfg.fsdp.cpu_ram_efficient_loading, cfg.model.trust_remote_code)
    else:
        init_weights(model, cfg.train.seed, init_std)


def export_final(model: nn.Module, cfg: Config, tokenizer, device_type: str) -> str:
    """`<checkpoint.dir>/export`, per fsdp.state_dict_type; returns the path."""
    export_dir = os.path.join(cfg.checkpoint.dir, "export")
    prepare_for_generation(model, tokenizer, from_scratch=not cfg.model.name_or_path)
    if cfg.fsdp.state_dict_type == "FULL_STATE_DICT":
        dtype = getattr(torch, resolve_mixed_precision(cfg.fsdp, device_type)["param_dtype"])
        export_full(model, export_dir, tokenizer, dtype)
    else:
        export_sharded(model, export_dir, tokenizer)
    return export_dir


def prepare_for_generation(model: nn.Module, tokenizer, from_scratch: bool) -> None:
    """The KV cache back on; a model from model.config takes the tokenizer's special ids (not Llama's)."""
    model.config.use_cache = model.generation_config.use_cache = True
    if not from_scratch or tokenizer is None:
        return
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, name, getattr(tokenizer, name))
        setattr(model.generation_config, name, getattr(tokenizer, name))


def publish(tmp: str, final: str) -> None:
    old = f"{final}.old"
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def export_full(model: nn.Module, out_dir: str, tokenizer, dtype: torch.dtype) -> None:
    # Gathered to rank 0 on CPU one tensor at a time, so no GPU ever holds the whole model.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        tmp = f"{out_dir}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_hf_directory(model, tmp, {k: v.to(dtype) for k, v in state.items()}, tokenizer, dtype)
        publish(tmp, out_dir)
    dist.barrier()


def write_hf_directory(model: nn.Module, out_dir: str, state: dict, tokenizer, dtype: torch.dtype) -> None:
    model.save_pretrained(out_dir, state_dict=state)
    # save_pretrained records the dtype of the model's own (fp32 master) parameters, not of `state`.
    model.config.dtype = dtype
    _save_config(out_dir, model.config, tokenizer)
    # safetensors arrive 0600, the rest 0644: give all the mode a plain open() would.
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
        _save_config(tmp, model.config, tokenizer)
        publish(tmp, out_dir)
    dist.barrier()


def is_sharded_export(path: str) -> bool:
    return os.path.exists(os.path.join(path, ".metadata"))


def load_sharded_export(model: nn.Module, path: str) -> None:
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
