"""Llama pretraining with FSDP2 (`fully_shard`) or HSDP, from scratch or from a Hugging Face checkpoint.

    python scripts/pretrain_fsdp.py --config configs/debug_llama.json             # one process, CPU or GPU
    torchrun --nproc_per_node 8 scripts/pretrain_fsdp.py --config configs/llama.json train.steps=100

The story of main(): config -> process group and mesh -> data -> model on `meta` -> fully_shard ->
materialise and initialise (or load) -> train loop -> export.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import cp
from common.checkpoint import (
    PreemptionWatch,
    check_shared_storage,
    export_final,
    find_resume_checkpoint,
    load_checkpoint,
    load_weights,
    maybe_inject_fault,
    save_checkpoint,
)
from common.config import ConfigError, parse_args, resolve_mixed_precision, run_cli, to_dict
from common.data import Batch, build_batches
from common.mesh import build_dp_mesh, gather, init_distributed, resolve_dp_sizes
from common.metrics import (
    CommCounter,
    MetricsLogger,
    StepTimer,
    device_peak_flops,
    flops_per_token,
    peak_memory_bytes,
    reset_peak_memory,
    sharded_state_bytes,
)
from common.model import build_meta_model, init_buffers, load_model_config
from common.optim import build_optimizer, clip_grad_norm_, lr_multiplier
from common.wrap import apply_fsdp, resolve_layer_classes

GIB = 2**30


def token_loss_sum(
    model: torch.nn.Module, batch: Batch, device: torch.device, cp_positions: torch.Tensor | None
) -> torch.Tensor:
    """Summed token loss; with context parallelism, over this rank's positions of each sequence only.
    With data.document_mask the batch's position ids restart per document, which keeps attention inside it."""
    input_ids, labels = batch.input_ids.to(device), batch.labels.to(device)
    position_ids = None if batch.position_ids is None else batch.position_ids.to(device)
    if cp_positions is not None:  # labels were shifted on the full row; everything is sharded the same way
        input_ids, labels = input_ids[:, cp_positions], labels[:, cp_positions]
        position_ids = (
            cp_positions.expand(len(input_ids), -1)
            if position_ids is None
            else (position_ids[:, cp_positions])
        )
    logits = model(input_ids=input_ids, position_ids=position_ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def train_step(
    model,
    optimizer,
    micro_batches,
    device,
    max_grad_norm: float,
    cp_positions: torch.Tensor | None,
    sync_each_batch: bool,
) -> tuple[float, float, int]:
    """One optimizer step over this rank's micro-batches; returns (mean token loss, grad norm, tokens).

    The loss is divided by the number of target tokens summed over all ranks and micro-batches, and FSDP
    sums gradients (see apply_fsdp), so N ranks x k micro-batches give exactly the one-process update,
    with or without padding.
    """
    # Counted on the shards each rank trains on: cp shards partition a sequence, so no token counts twice.
    shard = (
        (lambda labels: labels) if cp_positions is None else (lambda labels: labels[:, cp_positions.cpu()])
    )
    local_tokens = sum(int((shard(b.labels) != -100).sum()) for b in micro_batches)
    global_tokens = torch.tensor(local_tokens, device=device, dtype=torch.float64)
    dist.all_reduce(global_tokens)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    for i, batch in enumerate(micro_batches):
        model.set_requires_gradient_sync(sync_each_batch or i == len(micro_batches) - 1)
        loss = token_loss_sum(model, batch, device, cp_positions)
        (loss / global_tokens.float()).backward()
        loss_sum += loss.detach()
    grad_norm = clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum)
    return (loss_sum / global_tokens).item(), grad_norm, int(global_tokens.item())


@torch.no_grad()
def fixed_batch_loss(model, batch, device, cp_positions: torch.Tensor | None) -> float:
    """Mean token loss on a fixed batch (the first rows of the data), to check exports against."""
    loss = token_loss_sum(model, batch, device, cp_positions)
    if cp_positions is not None:
        dist.all_reduce(loss, group=cp.CP["group"])  # each cp rank scored its own positions
    return (loss / (batch.labels != -100).sum()).item()


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv, description=__doc__)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    dp_replicate, dp_shard = resolve_dp_sizes(cfg.parallelism, world_size)
    t, cp_size = cfg.train, cfg.parallelism.cp_size
    dp_size = world_size // cp_size  # the cp ranks of a data-parallel group share its batch
    if t.global_batch_size % (t.micro_batch_size * dp_size):
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) is not a multiple of micro_batch_size "
            f"({t.micro_batch_size}) x data-parallel size ({dp_size}); make it a multiple of "
            f"{t.micro_batch_size * dp_size}"
        )
    if cp_size > 1:
        cfg.model.attn_implementation = cp.ATTENTION  # K/V all-gathered over the cp group (common/cp.py)
    hf_config = load_model_config(cfg.model, cfg.data.seq_len)
    hf_config.use_cache = False
    cp.check_cp(cfg.data.seq_len, cp_size, True, hf_config)
    model = build_meta_model(hf_config, cfg.model)  # no memory yet: every tensor is on `meta`
    resolve_layer_classes(model, cfg.fsdp)  # fail on a bad class name before any process group exists

    # Process group and mesh: 1-D FSDP, or 2-D (dp_replicate, dp_shard) HSDP; with CP, FSDP shards over
    # dp_shard x cp and each rank trains on its head-tail share of every sequence's positions.
    d = init_distributed(t.device, cfg.parallelism.timeout_minutes)
    mesh = build_dp_mesh(d.device.type, dp_replicate, dp_shard * cp_size)
    cp_positions, dp_rank = None, d.rank
    if cp_size > 1:
        cp_positions, dp_rank, _ = cp.setup(cfg.data.seq_len, cp_size, True, d.device, cfg.data.document_mask)
    torch.manual_seed(t.seed)

    # Data before the model, so a missing dataset or tokenizer fails before any memory is allocated.
    tokenizer, data = build_batches(
        cfg.data,
        t.seed,
        t.global_batch_size,
        t.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        is_main=d.is_main,
    )
    if len(tokenizer) > hf_config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens but model vocab_size is {hf_config.vocab_size}; "
            f"set model.config.vocab_size >= {len(tokenizer)}"
        )
    run_dir = cfg.checkpoint.dir
    check_shared_storage(run_dir)  # multi-node: a node-local checkpoint.dir could never be resumed

    # Shard first, then allocate: no rank ever holds the full fp32 model.
    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    num_units = apply_fsdp(model, mesh, cfg.fsdp, d.device.type, compile_layers=t.compile)
    param_device = torch.device("cpu") if cfg.fsdp.cpu_offload else d.device
    model.to_empty(device=param_device)
    init_buffers(model, d.device)
    resume_from = find_resume_checkpoint(run_dir, cfg.checkpoint.resume)
    load_weights(
        model, cfg, resume_from, hf_config.initializer_range
    )  # resume: weights come with the optimizer
    model.train()
    load_peaks = gather(peak_memory_bytes(d.device) / GIB)
    reset_peak_memory(d.device)
    optimizer = build_optimizer(model, cfg, d.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    start_step, samples = (
        0,
        0,
    )  # samples: the global data position, so a resume on any world size continues it
    if resume_from:
        state = load_checkpoint(resume_from, model, optimizer, scheduler)
        data.load_state_dict(state["data"], d.rank)
        start_step, samples = state["step"], state["samples"]

    num_params = sum(p.numel() for p in model.parameters())
    num_embed = model.get_input_embeddings().weight.numel()
    timer = StepTimer(
        t.steps,
        flops_per_token(
            num_params, num_embed, hf_config.num_hidden_layers, hf_config.hidden_size, cfg.data.seq_len
        ),
        cfg.metrics.peak_flops or device_peak_flops(d.device),
        d.world_size,
    )
    logger = MetricsLogger(run_dir, d.is_main, cfg.metrics.tensorboard)
    if d.is_main:
        with open(os.path.join(run_dir, "run_config.json"), "w") as f:
            json.dump(to_dict(cfg), f, indent=2)
    compiled = sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
    logger.log(
        {
            "event": "model_ready",
            "params": num_params,
            "fsdp_units": num_units,
            "world_size": d.world_size,
            "compiled_layers": compiled,
            "mesh": list(mesh.shape),
            "device": str(d.device),
            "mixed_precision": resolve_mixed_precision(cfg.fsdp, d.device.type),
            "peak_mem_after_load_gib_per_rank": load_peaks,
            "data": getattr(data, "tokens_path", None),
            "resumed_from": resume_from,
            "start_step": start_step,
        }
    )

    comm = CommCounter()
    preemption = PreemptionWatch(d.device)  # SIGUSR1 or the Slurm batch script's request file
    with comm.patch() if cfg.metrics.comm_stats else contextlib.nullcontext():
        for step in range(start_step + 1, t.steps + 1):
            maybe_inject_fault("kill", step, run_dir)
            maybe_inject_fault("hang", step, run_dir)
            micro_batches = data.micro_batches(samples)
            loss, grad_norm, tokens = train_step(
                model, optimizer, micro_batches, d.device, t.max_grad_norm, cp_positions, t.sync_each_batch
            )
            samples += t.global_batch_size
            if maybe_inject_fault("nan", step, run_dir):
                loss = math.nan
            if not math.isfinite(loss):
                # Every rank sees the same all-reduced loss, so all stop here, before writing a checkpoint.
                raise SystemExit(
                    f"loss is {loss} at step {step}; stopping without saving, the last checkpoint is "
                    f"intact (try a lower train.lr or train.max_grad_norm)"
                )
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            if step % cfg.metrics.log_every == 0 or step in (start_step + 1, t.steps):
                record = {
                    "step": step,
                    "loss": loss,
                    "grad_norm": grad_norm,
                    "lr": lr,
                    "tokens": tokens,
                    "samples": samples,
                    **timer.record(step - start_step, tokens),
                    "peak_mem_gib": peak_memory_bytes(d.device) / GIB,
                }
                if cfg.metrics.comm_stats:
                    record.update(comm.reset())
                if cfg.metrics.sample_ids:
                    record["sample_ids"] = gather([i for b in micro_batches for i in b.sample_ids])
                logger.log(record)
            else:
                timer.tokens_since += tokens
            preempted = preemption.requested()
            stopping = preempted or (t.stop_after and step - start_step >= t.stop_after)
            interval = cfg.checkpoint.interval
            if (interval and step % interval == 0) or step == t.steps or stopping:
                train_state = {
                    "step": step,
                    "samples": samples,
                    "world_size": d.world_size,
                    "loss": loss,
                    "scheduler": scheduler.state_dict(),
                    "data": gather(data.state_dict()),
                }
                path = save_checkpoint(
                    run_dir, step, model, optimizer, train_state, cfg.checkpoint.keep_latest, tokenizer
                )
                logger.log({"event": "checkpoint", "step": step, "path": path})
            if stopping and step < t.steps:
                logger.log(
                    {
                        "event": "stopped",
                        "step": step,
                        "reason": "preempted" if preempted else "train.stop_after",
                    }
                )
                logger.close()
                dist.destroy_process_group()
                return

    final = {
        "event": "final",
        "state_bytes_per_rank": gather(sharded_state_bytes(model, optimizer)),
        "peak_mem_gib_per_rank": gather(peak_memory_bytes(d.device) / GIB),
    }  # training's peak, every rank
    if not cfg.data.streaming:
        final["fixed_batch_loss"] = fixed_batch_loss(
            model, data.fixed_batch(t.micro_batch_size), d.device, cp_positions
        )
    logger.log(final)
    if cfg.checkpoint.export:
        path = export_final(model, cfg, tokenizer, d.device.type)
        logger.log({"event": "exported", "path": path, "state_dict_type": cfg.fsdp.state_dict_type})
    logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
