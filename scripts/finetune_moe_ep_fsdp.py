"""Fine-tune a Hugging Face mixture-of-experts model (Qwen3-MoE, Mixtral) with expert parallelism x FSDP2.

    python scripts/finetune_moe_ep_fsdp.py --config configs/debug_moe.json                    # one process
    torchrun --nproc_per_node 4 scripts/finetune_moe_ep_fsdp.py --config configs/debug_moe.json
    parallelism.ep_size=2
    torchrun --nproc_per_node 8 scripts/finetune_moe_ep_fsdp.py --config configs/qwen3_moe.json

Layout, as in Transformers' DistributedConfig: dense weights live on (dp_replicate, fsdp, tp), experts on
(dp_replicate, efsdp, ep) with efsdp = fsdp*tp/ep. Each rank owns E/ep experts, FSDP-sharded over efsdp,
and tokens travel to their experts by all-to-all. Loss is taken on completion/assistant tokens only.

The story of main(): config -> sizes checked against the model -> meshes -> SFT data -> model on `meta`
-> TP and EP (Transformers' plans) -> fully_shard -> load weights -> train loop -> held-out eval -> export.
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
from common.data import Batch, ensure_embedded_tokenizer, load_tokenizer
from common.mesh import build_moe_meshes, gather, init_distributed, resolve_moe_sizes
from common.metrics import (
    CommCounter,
    MetricsLogger,
    StepTimer,
    peak_memory_bytes,
    reset_peak_memory,
    sharded_state_bytes,
)
from common.model import build_meta_model, init_buffers, load_model_config
from common.moe import RouterLogits, apply_tp_ep, check_moe, router_load
from common.optim import build_optimizer, clip_grad_norm_, lr_multiplier
from common.sft import build_sft_batches, eval_batches
from common.wrap import apply_fsdp, resolve_layer_classes

GIB = 2**30


class MoeLoss:
    """Token-summed cross-entropy on answer tokens, plus the model's router load-balancing loss."""

    def __init__(self, model, aux_loss_fn, num_experts: int, top_k: int, coef: float):
        self.router_logits = RouterLogits(model)
        self.aux_loss_fn, self.num_experts, self.top_k, self.coef = aux_loss_fn, num_experts, top_k, coef

    def __call__(self, model, batch: Batch, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cross-entropy summed over answer tokens, router aux loss, [layers, experts] token counts)."""
        mask = batch.token_mask.to(device)
        # Restarting position ids and no attention mask make Transformers build a per-example causal mask
        # (packing); a KV cache would switch that detection off.
        self.router_logits.take()  # drop what an activation-checkpointing recompute left behind
        logits = model(
            input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device), use_cache=False
        ).logits
        router_logits = self.router_logits.take()
        ce = F.cross_entropy(
            logits.float().flatten(0, 1),
            batch.labels.to(device).flatten(),
            ignore_index=-100,
            reduction="sum",
        )
        aux = self.aux_loss_fn(router_logits, self.num_experts, self.top_k, mask)
        return ce, aux, router_load(router_logits, self.top_k, mask)


def global_sum(value: torch.Tensor, tp: int) -> torch.Tensor:
    """Sum over data-parallel ranks: tensor-parallel peers hold the same batch, so they count once."""
    value = value.clone()
    dist.all_reduce(value)
    return value / tp


def train_step(
    model,
    optimizer,
    micro_batches,
    loss_fn: MoeLoss,
    device,
    max_grad_norm: float,
    tp: int,
    sync_each_batch: bool,
) -> dict:
    """One optimizer step; the loss is divided by the global answer-token count and FSDP sums gradients
    (see apply_fsdp), so any (fsdp, ep, tp) layout gives the one-process update."""
    targets = [(b.labels != -100).sum() for b in micro_batches]
    global_tokens = global_sum(torch.stack(targets).sum().double().to(device), tp)
    processed = global_sum(sum(b.token_mask.sum() for b in micro_batches).double().to(device), tp)
    ce_sum = aux_sum = torch.zeros((), device=device, dtype=torch.float64)
    load = 0
    for i, (batch, tokens) in enumerate(zip(micro_batches, targets)):
        model.set_requires_gradient_sync(
            sync_each_batch or i == len(micro_batches) - 1
        )  # see train.sync_each_batch
        ce, aux, counts = loss_fn(model, batch, device)
        # The aux loss is a per-micro-batch mean; weighting it by the batch's answer tokens makes its sum
        # over ranks a token-weighted mean that does not depend on how the batch is split.
        weighted_aux = aux * tokens.to(device)
        ((ce + loss_fn.coef * weighted_aux) / global_tokens.float()).backward()
        ce_sum, aux_sum, load = ce_sum + ce.detach(), aux_sum + weighted_aux.detach(), load + counts
    grad_norm = clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ce_sum, aux_sum, load = (global_sum(x, tp) for x in (ce_sum, aux_sum, load.double()))
    return {
        "loss": (ce_sum / global_tokens).item(),
        "router_aux_loss": (aux_sum / global_tokens).item(),
        "grad_norm": grad_norm,
        "tokens": int(global_tokens.item()),
        "tokens_processed": int(processed.item()),
        "tokens_per_expert_max": load.max(dim=1).values.tolist(),
        "tokens_per_expert_mean": load.mean(dim=1).tolist(),
    }


@torch.no_grad()
def evaluate(model, batches: list[Batch], loss_fn: MoeLoss, device, tp: int) -> float:
    """Token-weighted mean loss over answer tokens of the held-out rows (every rank runs the same count)."""
    model.eval()
    ce_sum = tokens = torch.zeros((), device=device, dtype=torch.float64)
    for batch in batches:
        ce_sum = ce_sum + loss_fn(model, batch, device)[0]
        tokens = tokens + (batch.labels != -100).sum()
    model.train()
    return (global_sum(ce_sum, tp) / global_sum(tokens, tp)).item()


def expert_layout(experts: list) -> dict:
    """Where the first expert weight lives on this rank: for the placement test and the logs."""
    if not experts:
        return {}
    weight = next(experts[0].parameters())
    return {
        "global_shape": list(weight.shape),
        "local_shape": list(weight.to_local().shape),
        "mesh": dict(zip(weight.device_mesh.mesh_dim_names, weight.device_mesh.shape)),
        "placements": [str(p) for p in weight.placements],
    }


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv, description=__doc__)
    t = cfg.train
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if t.compile:
        raise ConfigError(
            "train.compile is true but EP's all-to-all reads split sizes on the host every layer, "
            "which breaks compiled graphs; set train.compile=false"
        )
    hf_config = load_model_config(cfg.model, cfg.data.seq_len)
    hf_config.use_cache = False
    model = build_meta_model(hf_config, cfg.model)  # no memory yet: every tensor is on `meta`
    num_experts, aux_loss_fn = check_moe(model, cfg.model.name_or_path or "model.config")
    sizes = resolve_moe_sizes(cfg.parallelism, world_size, num_experts)
    if t.global_batch_size % (t.micro_batch_size * sizes.dp):
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) is not a multiple of micro_batch_size "
            f"({t.micro_batch_size}) x data-parallel size ({sizes.dp}); make it a multiple of "
            f"{t.micro_batch_size * sizes.dp}"
        )
    if sizes.tp > 1 and not t.sync_each_batch and t.global_batch_size > t.micro_batch_size * sizes.dp:
        # Measured: fsdp 2 x tp 2 x ep 2 with 2 micro-batches moved the grad norm 1.2e-5 (relative) off the
        # one-process run when gradients were reduce-scattered only on the last micro-batch; exact otherwise.
        raise ConfigError(
            f"train.sync_each_batch is false with parallelism.tp_size={sizes.tp} and gradient "
            f"accumulation, which changes the gradients here; set train.sync_each_batch=true"
        )
    if cfg.data.dataset == "embedded":
        raise ConfigError("data.dataset is 'embedded' (pretraining text); give SFT JSONL or 'arithmetic'")
    resolve_layer_classes(model, cfg.fsdp)
    coef = t.router_aux_loss_coef
    if coef is None:
        coef = getattr(hf_config, "router_aux_loss_coef", 0.0)

    # Two views of the same ranks: dense (dp_replicate, fsdp, tp) and expert (dp_replicate, efsdp, ep).
    d = init_distributed(t.device, cfg.parallelism.timeout_minutes)
    dense_mesh, expert_mesh = build_moe_meshes(d.device.type, sizes)
    replicate_rank, fsdp_rank, _ = dense_mesh.get_coordinate()
    dp_rank = replicate_rank * sizes.fsdp + fsdp_rank  # tp peers share a batch
    torch.manual_seed(t.seed)

    # SFT data: loss only on answers; rows packed or padded, sampled the same way on any world size.
    ensure_embedded_tokenizer(cfg.data, d.is_main)
    tokenizer = load_tokenizer(cfg.data)
    if len(tokenizer) > hf_config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{hf_config.vocab_size}; use the model's own tokenizer (data.tokenizer)"
        )
    data = build_sft_batches(
        cfg.data, tokenizer, t.seed, t.global_batch_size, t.micro_batch_size, dp_rank, sizes.dp, d.is_main
    )
    held_out = (
        eval_batches(
            cfg.data, tokenizer, cfg.eval.max_sequences, cfg.eval.batch_size, dp_rank, sizes.dp, d.is_main
        )
        if cfg.data.eval_dataset
        else []
    )
    run_dir = cfg.checkpoint.dir
    check_shared_storage(run_dir)

    # TP and EP from the model's own plans, then FSDP: experts over (dp_replicate, efsdp), the rest over
    # (dp_replicate, fsdp). Still on `meta`: no rank ever holds the full model.
    experts = apply_tp_ep(model, sizes, dense_mesh, expert_mesh)
    dp_dims = ("dp_replicate", "fsdp") if sizes.dp_replicate > 1 else ("fsdp",)
    expert_dims = ("dp_replicate", "efsdp") if sizes.dp_replicate > 1 else ("efsdp",)
    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    num_units = apply_fsdp(
        model,
        dense_mesh[dp_dims],
        cfg.fsdp,
        d.device.type,
        experts=experts,
        expert_mesh=expert_mesh[expert_dims],
    )
    model.to_empty(device=torch.device("cpu") if cfg.fsdp.cpu_offload else d.device)
    init_buffers(model, d.device)
    resume_from = find_resume_checkpoint(run_dir, cfg.checkpoint.resume)
    load_weights(
        model, cfg, resume_from, hf_config.initializer_range
    )  # resume: weights come with the optimizer
    model.train()
    loss_fn = MoeLoss(model, aux_loss_fn, num_experts, hf_config.num_experts_per_tok, coef)
    load_peaks = gather(peak_memory_bytes(d.device) / GIB)
    reset_peak_memory(d.device)
    optimizer = build_optimizer(model, cfg, d.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    start_step, samples = 0, 0
    if resume_from:
        state = load_checkpoint(resume_from, model, optimizer, scheduler)
        start_step, samples = state["step"], state["samples"]

    logger = MetricsLogger(run_dir, d.is_main, cfg.metrics.tensorboard)
    if d.is_main:
        with open(os.path.join(run_dir, "run_config.json"), "w") as f:
            json.dump(to_dict(cfg), f, indent=2)
    logger.log(
        {
            "event": "model_ready",
            "params": sum(p.numel() for p in model.parameters()),
            "experts": num_experts,
            "fsdp_units": num_units,
            "world_size": d.world_size,
            "dense_mesh": dict(zip(dense_mesh.mesh_dim_names, dense_mesh.shape)),
            "expert_layout_per_rank": gather(expert_layout(experts)),
            "router_aux_loss_coef": coef,
            "mixed_precision": resolve_mixed_precision(cfg.fsdp, d.device.type),
            "peak_mem_after_load_gib_per_rank": load_peaks,
            "resumed_from": resume_from,
            "start_step": start_step,
        }
    )
    if held_out and start_step == 0:
        logger.log(
            {"event": "eval", "step": 0, "eval_loss": evaluate(model, held_out, loss_fn, d.device, sizes.tp)}
        )

    timer = StepTimer(t.steps, None, None, d.world_size)
    comm = CommCounter()
    preemption = PreemptionWatch(d.device)
    with comm.patch() if cfg.metrics.comm_stats else contextlib.nullcontext():
        for step in range(start_step + 1, t.steps + 1):
            maybe_inject_fault("kill", step, run_dir)
            micro_batches = data.micro_batches(samples)
            stats = train_step(
                model,
                optimizer,
                micro_batches,
                loss_fn,
                d.device,
                t.max_grad_norm,
                sizes.tp,
                t.sync_each_batch,
            )
            samples += t.global_batch_size
            if not math.isfinite(stats["loss"]):
                raise SystemExit(
                    f"loss is {stats['loss']} at step {step}; stopping without saving, the last "
                    f"checkpoint is intact (try a lower train.lr or train.max_grad_norm)"
                )
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            if step % cfg.metrics.log_every == 0 or step in (start_step + 1, t.steps):
                record = {
                    "step": step,
                    **stats,
                    "lr": lr,
                    "samples": samples,
                    **timer.record(step - start_step, stats["tokens_processed"]),
                    "peak_mem_gib": peak_memory_bytes(d.device) / GIB,
                }
                if cfg.metrics.comm_stats:
                    record.update(comm.reset())
                logger.log(record)
            else:
                timer.tokens_since += stats["tokens_processed"]
            preempted = preemption.requested()
            stopping = preempted or (t.stop_after and step - start_step >= t.stop_after)
            interval = cfg.checkpoint.interval
            if (interval and step % interval == 0) or step == t.steps or stopping:
                train_state = {
                    "step": step,
                    "samples": samples,
                    "world_size": d.world_size,
                    "loss": stats["loss"],
                    "scheduler": scheduler.state_dict(),
                    "data": gather(data.state_dict()),
                }
                path = save_checkpoint(
                    run_dir, step, model, optimizer, train_state, cfg.checkpoint.keep_latest, tokenizer
                )
                logger.log({"event": "checkpoint", "step": step, "path": path})
            if stopping and step < t.steps:
                reason = "preempted" if preempted else "train.stop_after"
                logger.log({"event": "stopped", "step": step, "reason": reason})
                logger.close()
                dist.destroy_process_group()
                return

    final = {
        "event": "final",
        "step": t.steps,
        "state_bytes_per_rank": gather(sharded_state_bytes(model, optimizer)),
        "peak_mem_gib_per_rank": gather(peak_memory_bytes(d.device) / GIB),
    }
    with torch.no_grad():  # the export check: plain Transformers must reproduce this number
        fixed = data.fixed_batch(t.micro_batch_size)
        final["fixed_batch_loss"] = (loss_fn(model, fixed, d.device)[0] / (fixed.labels != -100).sum()).item()
    if held_out:
        final["eval_loss"] = evaluate(model, held_out, loss_fn, d.device, sizes.tp)
    logger.log(final)
    if cfg.checkpoint.export:
        path = export_final(model, cfg, tokenizer, d.device.type)
        logger.log({"event": "exported", "path": path, "state_dict_type": cfg.fsdp.state_dict_type})
    logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
