"""Llama pretraining on PyTorch/XLA (TPU, or XLA's CPU runtime in CI) with SPMD FSDPv2.

    PJRT_DEVICE=TPU python scripts/tpu_xla_fsdp.py --config configs/tpu_llama.json   # on every TPU VM host
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python scripts/tpu_xla_fsdp.py --config configs/debug_tpu.json

The recipe of pretrain_fsdp.py (config schema, data, initialisation, AdamW and schedule, global-token loss,
metrics, checkpoints, HF export) on XLA. The story of main(): config -> SPMD mesh with an `fsdp` axis -> data
-> model in host memory -> FSDPv2 per planned unit (optionally with gradient checkpointing) -> train loop with
the batch sharded over `fsdp` -> DCP checkpoints -> HF export.

Why SPMD FSDPv2 (SpmdFullyShardedDataParallel) and not FSDPv1 (XlaFullyShardedDataParallel): one process per
host drives all its devices and the XLA compiler inserts the all-gathers and reduce-scatters from sharding
annotations, which is the path PyTorch/XLA recommends for TPUs. FSDPv1 needs one process per device, and
multi-process collectives on XLA's CPU runtime hang, so it could never be tested here; `xla_fsdp_v2: false` is
an error.

Needs torch 2.9.0 + torch_xla 2.9.0 (requirements-xla.txt, their own environment). Without torch_xla this
module still imports, so its config checks (xla_config.py, beside it), wrap plan and key helpers are tested
with the main environment's torch.
"""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # xla_config.py, also when imported by path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from common.architectures import is_image_text
from common.checkpoint import checkpoints_dir, finish_checkpoint, restore_train_state, train_state
from common.config import Config, ConfigError, FsdpConfig
from common.data.checks import check_vocab_size
from common.data.train_batches import build_batches
from common.export import finish_export, prepare_for_generation, save_model_config
from common.load_weights import is_sharded_export
from common.model import build_meta_model, init_weights, load_model_config, materialise
from common.ops.cli import parse_args, run_cli
from common.ops.integrity import verify_model_checksums
from common.ops.metrics import MetricsLogger, StepLog, checkpoint_record, flops_per_token
from common.ops.run_dir import find_resume_checkpoint, load_or_set_aside
from common.ops.stopping import StopRules
from common.optim import NonFiniteGradients, build_optimizer, lr_multiplier
from common.wrap import plan_units, resolve_layer_classes
from xla_config import check_xla_config, xla_settings  # beside this script

try:
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import checkpoint_module
    from torch_xla.distributed.fsdp.wrap import lambda_auto_wrap_policy
    from torch_xla.experimental.distributed_checkpoint import (
        SPMDLoadPlanner,
        SPMDSavePlanner,
        prime_optimizer,
    )
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2
except ImportError as error:  # the main environment: everything above the training itself still works
    torch_xla, XLA_IMPORT_ERROR = None, error

WRAP_PREFIX = "_orig_module."  # what FSDPv2 puts before the names of the modules it wraps


def require_torch_xla() -> None:
    if torch_xla is None:
        raise ConfigError(
            f"fsdp.xla is true but torch_xla is not importable ({XLA_IMPORT_ERROR}); install "
            f"requirements-xla.txt (torch 2.9.0 + torch_xla 2.9.0) in its own environment, see docs/tpu.md"
        )


def wrap_plan(model: nn.Module, fsdp: FsdpConfig, grad_ckpt: bool) -> tuple[set[nn.Module], set[nn.Module]]:
    """(modules FSDPv2 wraps below the root, the layers among them to checkpoint), from auto_wrap_policy and
    transformer_layer_cls_to_wrap exactly as pretrain_fsdp.py plans its fully_shard units."""
    layer_classes = resolve_layer_classes(model, fsdp)
    wrapped = {module for unit in plan_units(model, fsdp, layer_classes) for module in unit}
    layers = {m for m in wrapped if type(m).__name__ in layer_classes} if grad_ckpt else set()
    if grad_ckpt and not layers:
        raise ConfigError(
            f"fsdp.xla_fsdp_grad_ckpt is true but auto_wrap_policy={fsdp.auto_wrap_policy} wraps no "
            f"transformer layer to checkpoint; use TRANSFORMER_BASED_WRAP"
        )
    return wrapped, layers


def hf_key(name: str) -> str:
    """A wrapped model's state-dict key as Transformers names it (FSDPv2 wraps the root and every unit)."""
    return name.replace(WRAP_PREFIX, "")


def shard_output(output, mesh) -> None:
    """Annotate each wrapped module's output as split over `fsdp` on the batch dim, like its input.
    Units return hidden states; the root returns Transformers' CausalLMOutputWithPast."""
    tensor = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if tensor is None:
        tensor = output[0]
    xs.mark_sharding(tensor, mesh, ("fsdp",) + (None,) * (tensor.dim() - 1))


def build_model(cfg: Config) -> nn.Module:
    """The full fp32 model in host memory: the checkpoint's weights, or pretrain_fsdp.py's seeded
    initialisation (the same numbers, so both scripts start from the same model)."""
    if cfg.model.attn_implementation not in (None, "sdpa", "eager"):
        raise ConfigError(
            f"model.attn_implementation is {cfg.model.attn_implementation!r}; on XLA use eager (sdpa, and "
            f"Transformers' default, are replaced by eager)"
        )
    # XLA autocast leaves SDPA's inputs alone and RoPE makes Q and K fp32 while V is bf16, which SDPA refuses;
    # eager attention's matmuls autocast, and XLA fuses them into one kernel anyway.
    cfg.model.attn_implementation = "eager"
    hf_config = load_model_config(cfg.model)
    if is_image_text(hf_config):
        raise ConfigError(
            f"model {hf_config.model_type!r} is an image-text release, which the XLA recipe does not build; "
            f"train it with scripts/pretrain_fsdp.py"
        )
    if cfg.model.name_or_path:
        if is_sharded_export(cfg.model.name_or_path):
            raise ConfigError(
                f"model.name_or_path {cfg.model.name_or_path!r} is a DCP checkpoint; give an HF directory "
                f"(a FULL_STATE_DICT export)"
            )
        return AutoModelForCausalLM.from_pretrained(
            cfg.model.name_or_path,
            config=hf_config,
            dtype=torch.float32,
            attn_implementation=cfg.model.attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code,
        )
    model = build_meta_model(hf_config, cfg.model)
    materialise(model, torch.device("cpu"))
    init_weights(model, cfg.train.seed, hf_config.initializer_range)
    return model


def token_loss_sum(model, batch, mesh, compute_dtype: torch.dtype) -> torch.Tensor:
    """Summed token loss of a batch whose rows are split over the `fsdp` axis."""
    input_ids, labels = batch.input_ids.to(torch_xla.device()), batch.labels.to(torch_xla.device())
    xs.mark_sharding(input_ids, mesh, ("fsdp", None))
    xs.mark_sharding(labels, mesh, ("fsdp", None))
    precision = (
        torch.autocast("xla", dtype=compute_dtype) if compute_dtype != torch.float32 else nullcontext()
    )
    with precision:
        logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


@torch.no_grad()
def fixed_batch_loss(model, data, size: int, mesh, compute_dtype: torch.dtype) -> float | None:
    """The check pretrain_fsdp.py logs: the export must reproduce this mean token loss; none for a stream
    (data.streaming), which has no first rows that another run could rebuild."""
    if not hasattr(data, "fixed_batch"):
        return None
    batch = data.fixed_batch(size)
    return token_loss_sum(model, batch, mesh, compute_dtype).item() / int((batch.labels != -100).sum())


def train_step(model, optimizer, micro_batches, mesh, compute_dtype, max_grad_norm: float) -> dict:
    """One optimizer step: loss, grad norm, tokens. The loss is divided by the step's target tokens, as in
    pretrain_fsdp.py."""
    tokens = sum(int((b.labels != -100).sum()) for b in micro_batches)  # one process sees the whole batch
    loss_sum = torch.zeros((), device=torch_xla.device())
    for batch in micro_batches:
        loss = token_loss_sum(model, batch, mesh, compute_dtype)
        (loss / tokens).backward()
        loss_sum += loss.detach()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads)
    if not torch.isfinite(grad_norm).item():  # a host read per step: AdamW must never see such a gradient
        raise NonFiniteGradients(grad_norm.item())
    if max_grad_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_grad_norm, grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch_xla.sync()  # run the step's graph
    return {"loss": loss_sum.item() / tokens, "grad_norm": grad_norm.item(), "tokens": tokens}


def save_checkpoint(
    run_dir: str, step: int, model, optimizer, train_state: dict, keep_latest: int, tokenizer
) -> str:
    """DCP of the sharded model and optimizer state (each device's shard written as is), then completed and
    renamed as pretrain_fsdp.py's checkpoints are. Tensors only: the param groups come from the config."""
    final = os.path.join(checkpoints_dir(run_dir), f"step-{step}")
    tmp = f"{final}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()["state"]}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=SPMDSavePlanner())
    hosts_done()
    if xr.process_index() == 0:
        finish_checkpoint(final, train_state, model.module.config, tokenizer, keep_latest)
    hosts_done()
    return final


def hosts_done() -> None:
    """Multi-host: wait until every host has finished its part of a write (one host: nothing to wait for)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def load_checkpoint(path: str, model, optimizer, scheduler, data) -> dict:
    prime_optimizer(optimizer)  # DCP loads in place: the optimizer state must exist, with its sharding
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()["state"]}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=SPMDLoadPlanner())
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(
        {"state": state["optim"], "param_groups": optimizer.state_dict()["param_groups"]}
    )
    return restore_train_state(path, optimizer, scheduler, data)


def export(model, cfg: Config, tokenizer, compute_dtype: torch.dtype) -> str:
    """FULL_STATE_DICT: an HF directory (tensors gathered to the host one at a time). SHARDED_STATE_DICT: DCP
    with Transformers' key names, the format of pretrain_fsdp.py's sharded export."""
    out_dir = os.path.join(cfg.checkpoint.dir, "export")
    tmp = f"{out_dir}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    prepare_for_generation(model.module, tokenizer, from_scratch=not cfg.model.name_or_path)
    if cfg.fsdp.state_dict_type == "FULL_STATE_DICT":
        dtype = getattr(torch, cfg.checkpoint.export_dtype) if cfg.checkpoint.export_dtype else compute_dtype
        state = {hf_key(k): v.cpu().to(dtype) for k, v in model.state_dict().items()}
        if xr.process_index() == 0:
            model.module.save_pretrained(tmp, state_dict=state, max_shard_size=cfg.checkpoint.max_shard_size)
            save_model_config(model.module, tmp, tokenizer, dtype)
    else:
        state = {"model": {hf_key(k): v for k, v in model.state_dict().items()}}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=SPMDSavePlanner())
        hosts_done()
        if xr.process_index() == 0:
            model.module.config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    if xr.process_index() == 0:
        finish_export(tmp, out_dir)
    hosts_done()
    return out_dir


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv, description=__doc__)
    settings, compute_dtype = xla_settings(cfg.fsdp)
    require_torch_xla()
    if xr.process_count() > 1:
        # Multi-host TPU: DCP needs a process group to coordinate hosts (each host drives its own devices).
        torch.distributed.init_process_group("gloo", init_method="xla://")
    verify_model_checksums(cfg.model, cfg.checkpoint.verify_checksums)  # each host its share of the files
    xr.use_spmd()  # before any XLA tensor exists
    num_devices = xr.global_runtime_device_count()
    check_xla_config(cfg, num_devices)
    mesh = xs.Mesh(np.arange(num_devices), (num_devices,), ("fsdp",))
    xs.set_global_mesh(mesh)
    t, c, is_main = cfg.train, cfg.checkpoint, xr.process_index() == 0

    # Every host builds the whole global batch (deterministic); each device keeps its slice of the batch dim.
    tokenizer, data = build_batches(cfg.data, t, dp_rank=0, dp_size=1, is_main=is_main)
    model = build_model(cfg)
    check_vocab_size(tokenizer, model.config.vocab_size)
    num_params = sum(p.numel() for p in model.parameters())
    model_flops = flops_per_token(model, cfg.data.seq_len)
    wrapped, checkpointed = wrap_plan(model, cfg.fsdp, cfg.fsdp.xla_fsdp_grad_ckpt)

    def wrap_unit(module, *args, **kwargs):
        return FSDPv2(checkpoint_module(module) if module in checkpointed else module, *args, **kwargs)

    # FSDPv2 moves the model to the XLA devices and marks every parameter sharded over `fsdp`.
    model = FSDPv2(
        model,
        mesh=mesh,
        shard_output=shard_output,
        auto_wrapper_callable=wrap_unit,
        auto_wrap_policy=lambda *a, **kw: lambda_auto_wrap_policy(*a, **kw, lambda_fn=wrapped.__contains__),
        **settings,
    )
    optimizer = build_optimizer(model, cfg, torch_xla.device())  # foreach AdamW on the XLA tensors
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    resume_from = find_resume_checkpoint(c.dir, c.resume, c.verify_checksums)
    resume_from, state = load_or_set_aside(resume_from, c, load_checkpoint, model, optimizer, scheduler, data)
    start_step, samples = state.get("step", 0), state.get("samples", 0)

    logger = MetricsLogger(cfg, is_main)  # also writes run_config.json
    units = dict(fsdp_units=len(wrapped) + 1, checkpointed_layers=len(checkpointed), devices=num_devices)
    where = dict(device=str(torch_xla.device()), compute_dtype=str(compute_dtype), resumed_from=resume_from)
    logger.log({"event": "model_ready", "params": num_params, **units, **where, "start_step": start_step})

    # The host's memory for the logs, and the host's flag for a preemption request: the CPU device.
    host, stopping = torch.device("cpu"), None
    step_log = StepLog(cfg, logger, start_step, host, model_flops, devices=num_devices)
    with step_log, StopRules(cfg, start_step, host) as stop:
        for step in range(start_step + 1, t.steps + 1):
            result = train_step(
                model, optimizer, data.micro_batches(samples), mesh, compute_dtype, t.max_grad_norm
            )
            samples += t.global_batch_size
            stopping = stop.after_step(step, result["loss"])  # None, or "preempted", "train.stop_after"
            step_log.log(step, {**result, "lr": scheduler.get_last_lr()[0], "samples": samples})
            scheduler.step()
            if stopping or step == t.steps or (c.interval and step % c.interval == 0):
                state = train_state(step, samples, result["loss"], scheduler, data)
                path = save_checkpoint(c.dir, step, model, optimizer, state, c.keep_latest, tokenizer)
                logger.log(checkpoint_record(step, path))
            if stopping:
                logger.log({"event": "stopped", "step": step, "reason": stopping})
                logger.close()
                return

    fixed_loss = fixed_batch_loss(model, data, t.micro_batch_size, mesh, compute_dtype)
    logger.log({"event": "final", "fixed_batch_loss": fixed_loss})
    if c.export:
        path = export(model, cfg, tokenizer, compute_dtype)
        logger.log({"event": "exported", "path": path, "state_dict_type": cfg.fsdp.state_dict_type})
    logger.close()


if __name__ == "__main__":
    run_cli(main)
