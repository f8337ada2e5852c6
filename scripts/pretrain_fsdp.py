"""Llama pretraining with FSDP2 (`fully_shard`) or HSDP, from scratch or from a Hugging Face checkpoint.

    python scripts/pretrain_fsdp.py --config configs/debug_llama.json             # one process, CPU or GPU
    torchrun --nproc_per_node 8 scripts/pretrain_fsdp.py --config configs/llama.json train.steps=100

The story of main(): config -> process group and mesh -> data -> model on `meta` -> fully_shard ->
materialise and initialise (or load) -> train loop -> export.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch
import torch.distributed as dist

from common import cp, loss
from common.checkpoint import find_resume_checkpoint, load_checkpoint
from common.config import Config, TrainConfig
from common.config_sources import parse_args, run_cli
from common.data import Batch, build_batches, check_batch_sizes, check_vocab_size
from common.lifecycle import Bookkeeping, check_shared_storage
from common.mesh import build_dp_mesh, gather, init_distributed, resolve_dp_sizes
from common.metrics import (
    MetricsLogger,
    StepTimer,
    device_peak_flops,
    final_record,
    flops_per_token,
    model_ready,
    reset_peak_memory,
)
from common.model import build_meta_model, init_buffers, load_model_config
from common.optim import build_optimizer, clip_grad_norm_, lr_multiplier
from common.profiling import prepare_diagnostics
from common.weights import export_final, load_or_init_weights
from common.wrap import apply_fsdp, resolve_layer_classes


def token_loss_sum(
    model: torch.nn.Module,
    batch: Batch,
    device: torch.device,
    cp_positions: torch.Tensor | None,
    chunk_tokens: int,
) -> torch.Tensor:
    """Summed token loss; with context parallelism, over this rank's positions of each sequence only.
    With data.document_mask the batch's position ids restart per document, which keeps attention inside it.
    The output layer and loss run chunk_tokens tokens at a time (common/loss.py)."""
    input_ids, labels = batch.input_ids.to(device), batch.labels.to(device)
    position_ids = None if batch.position_ids is None else batch.position_ids.to(device)
    if cp_positions is not None:  # labels were shifted on the full row; everything is sharded the same way
        input_ids, labels = input_ids[:, cp_positions], labels[:, cp_positions]
        position_ids = (
            cp_positions.expand(len(input_ids), -1)
            if position_ids is None
            else (position_ids[:, cp_positions])
        )
    return loss.token_loss_sum(model, labels, chunk_tokens, input_ids=input_ids, position_ids=position_ids)


def train_step(
    model, optimizer, micro_batches, device, cp_positions: torch.Tensor | None, t: TrainConfig
) -> dict:
    """One optimizer step over this rank's micro-batches: mean token loss, grad norm, tokens.

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
        model.set_requires_gradient_sync(t.sync_each_batch or i == len(micro_batches) - 1)
        summed = token_loss_sum(model, batch, device, cp_positions, t.loss_chunk_tokens)
        (summed / global_tokens.float()).backward()
        loss_sum += summed.detach()
    grad_norm = clip_grad_norm_(model.parameters(), t.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum)
    return {
        "loss": (loss_sum / global_tokens).item(),
        "grad_norm": grad_norm,
        "tokens": int(global_tokens.item()),
    }


@torch.no_grad()
def fixed_batch_loss(model, batch, device, cp_positions: torch.Tensor | None, chunk_tokens: int) -> float:
    """Mean token loss on a fixed batch (the first rows of the data), to check exports against."""
    summed = token_loss_sum(model, batch, device, cp_positions, chunk_tokens)
    if cp_positions is not None:
        dist.all_reduce(summed, group=cp.CP["group"])  # each cp rank scored its own positions
    return (summed / (batch.labels != -100).sum()).item()


def check_config(cfg: Config, world_size: int) -> tuple[int, int, int]:
    """Bad sizes fail here, before any process group or memory: (dp_replicate, dp_shard, dp_size)."""
    dp_replicate, dp_shard = resolve_dp_sizes(cfg.parallelism, world_size)
    dp_size = world_size // cfg.parallelism.cp_size  # the cp ranks of a data-parallel group share its batch
    check_batch_sizes(cfg.train, dp_size)
    if cfg.parallelism.cp_size > 1:
        cfg.model.attn_implementation = cp.ATTENTION  # K/V all-gathered over the cp group (common/cp.py)
    return dp_replicate, dp_shard, dp_size


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv, description=__doc__)
    t, cp_size, run_dir = cfg.train, cfg.parallelism.cp_size, cfg.checkpoint.dir
    dp_replicate, dp_shard, dp_size = check_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    hf_config = load_model_config(cfg.model, cfg.data.seq_len)
    cp.check_cp(cfg.data.seq_len, cp_size, True, hf_config)
    model = build_meta_model(hf_config, cfg.model, t.gradient_checkpointing)  # on `meta`: no memory yet
    resolve_layer_classes(model, cfg.fsdp)  # a bad class name fails before any process group exists

    # Process group and mesh: 1-D FSDP, or 2-D (dp_replicate, dp_shard) HSDP; with CP, FSDP shards over
    # dp_shard x cp and each rank trains on its head-tail share of every sequence's positions.
    prepare_diagnostics(cfg)  # NCCL's flight recorder dumps under the run directory on a timeout
    d = init_distributed(t.device, cfg.parallelism.timeout_minutes)
    mesh = build_dp_mesh(d.device.type, dp_replicate, dp_shard * cp_size)
    cp_positions, dp_rank = None, d.rank
    if cp_size > 1:
        cp_positions, dp_rank, _ = cp.setup(cfg.data.seq_len, cp_size, True, d.device, cfg.data.document_mask)
    torch.manual_seed(t.seed)

    # Data before the model, so a missing dataset or tokenizer fails before any memory is allocated.
    tokenizer, data = build_batches(
        cfg.data, t.seed, t.global_batch_size, t.micro_batch_size, dp_rank, dp_size, is_main=d.is_main
    )
    check_vocab_size(len(tokenizer), hf_config.vocab_size)
    check_shared_storage(run_dir)  # multi-node: a node-local checkpoint.dir could never be resumed

    # Shard first, then allocate: no rank ever holds the full fp32 model.
    sharding = apply_fsdp(model, mesh, cfg.fsdp, d.device.type, compile_layers=t.compile)
    model.to_empty(device=torch.device("cpu") if cfg.fsdp.cpu_offload else d.device)
    init_buffers(model, d.device)
    optimizer = build_optimizer(model, cfg, d.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    resume_from = find_resume_checkpoint(run_dir, cfg.checkpoint.resume)
    start_step, samples = 0, 0  # samples: the global data position, the same on any world size
    if resume_from:  # weights, optimizer, scheduler, RNG and data position, resharded to this world size
        state = load_checkpoint(resume_from, model, optimizer, scheduler)
        data.load_state_dict(state["data"])
        start_step, samples = state["step"], state["samples"]
    else:
        load_or_init_weights(model, cfg, hf_config.initializer_range)
    model.train()

    logger = MetricsLogger(cfg, d.is_main)
    details = dict(data=getattr(data, "tokens_path", None), resumed_from=resume_from, start_step=start_step)
    logger.log(model_ready(model, d.device, cfg.fsdp, mesh, **details, **sharding))
    reset_peak_memory(d.device)
    peak_flops = cfg.metrics.peak_flops or device_peak_flops(d.device)
    timer = StepTimer(t.steps, d.world_size, flops_per_token(model, cfg.data.seq_len), peak_flops)
    parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, data=data, tokenizer=tokenizer)
    with Bookkeeping(cfg, logger, start_step, d.device, timer, **parts) as book:
        for step in range(start_step + 1, t.steps + 1):
            micro_batches = data.micro_batches(samples)
            result = train_step(model, optimizer, micro_batches, d.device, cp_positions, t)
            samples += t.global_batch_size
            stats = {**result, "lr": scheduler.get_last_lr()[0], "samples": samples}
            if cfg.metrics.sample_ids:
                stats["sample_ids"] = gather([i for b in micro_batches for i in b.sample_ids])
            scheduler.step()
            # Log, checkpoint when due; True when the run stops early (preempted, stop_after), checkpointed.
            if book.after_step(step, stats, result["tokens"]):
                break

    if not book.stopped:
        final = final_record(model, optimizer, d.device)  # training's peak memory, every rank
        if not cfg.data.streaming:
            fixed = data.fixed_batch(t.micro_batch_size)
            final["fixed_batch_loss"] = fixed_batch_loss(
                model, fixed, d.device, cp_positions, t.loss_chunk_tokens
            )
        logger.log(final)
        if cfg.checkpoint.export:
            path = export_final(model, cfg, tokenizer, d.device.type)
            logger.log({"event": "exported", "path": path, "state_dict_type": cfg.fsdp.state_dict_type})
    logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
