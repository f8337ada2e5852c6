"""Llama pretraining with FSDP2 (`fully_shard`) or HSDP, from scratch or from a Hugging Face checkpoint.

    python scripts/pretrain_fsdp.py --config configs/debug_llama.json             # one process, CPU or GPU
    torchrun --nproc_per_node 8 scripts/pretrain_fsdp.py --config configs/llama.json train.steps=100

The story of main(): config -> process group and mesh -> data -> model on `meta` -> fully_shard ->
materialise and initialise (or load) -> train loop -> export.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import TYPE_CHECKING

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from common import loss
from common.checkpoint import (
    checkpoints_dir,
    load_checkpoint,
    load_trained_weights,
    save_checkpoint,
    train_state,
)
from common.config import Config, ConfigError, TrainConfig
from common.data.batches import Batch
from common.data.checks import check_batch_sizes
from common.data.held_out import held_out_batches
from common.data.image_records import refuse_images
from common.data.train_batches import build_batches
from common.evaluate import eval_mode, evaluate
from common.export import export_final
from common.load_weights import load_or_init_weights
from common.mesh import build_meshes, init_distributed, resolve_device, resolve_dp_sizes
from common.model import build_meta_model, load_model_config, materialise
from common.ops import loss_check
from common.ops.async_save import BackgroundSaves
from common.ops.cli import parse_args, refuse_set_keys, run_cli
from common.ops.integrity import verify_model_checksums
from common.ops.metrics import (
    MetricsLogger,
    StepLog,
    checkpoint_record,
    final_record,
    flops_per_token,
    model_ready_record,
)
from common.ops.profiling import prepare_diagnostics
from common.ops.run_dir import find_resume_checkpoint, load_or_set_aside
from common.ops.stopping import StopRules
from common.optim import build_optimizer, clip_grad_norm_, lr_multiplier
from common.wrap import apply_fsdp, resolve_layer_classes

if TYPE_CHECKING:
    from common.cp import CpState


def token_loss_sum(
    model: torch.nn.Module, batch: Batch, device: torch.device, cp_state: CpState | None, chunk_tokens: int
) -> torch.Tensor:
    """Summed token loss; with context parallelism, over this rank's positions of each sequence only.
    Position ids that restart per packed document (data.document_mask) or SFT example keep attention
    inside it. The output layer and loss run chunk_tokens tokens at a time (common/loss.py)."""
    inputs, labels = batch.model_inputs(device), batch.labels.to(device)  # image-text rows: their images too
    if cp_state is None:
        return loss.token_loss_sum(model, labels, chunk_tokens, **inputs)
    # Labels were shifted on the full row; inputs, labels and positions are sharded the same way.
    inputs = cp_state.shard_inputs(inputs["input_ids"], inputs["position_ids"])
    return loss.token_loss_sum(model, cp_state.shard(labels), chunk_tokens, **inputs)


def train_step(
    model, optimizer, scheduler, micro_batches, device, cp_state: CpState | None, t: TrainConfig, tp: int
) -> dict:
    """One optimizer step over this rank's micro-batches: mean token loss, grad norm, tokens, the lr.

    The loss is divided by the number of target tokens summed over all ranks and micro-batches, and FSDP
    sums gradients (see apply_fsdp), so N ranks x k micro-batches give exactly the one-process update,
    with or without padding.
    """
    # Counted on the shards each rank trains on: cp shards partition a sequence, so no token counts twice;
    # the tp ranks of a group hold the same batch, so they count once.
    shard = (lambda labels: labels) if cp_state is None else cp_state.shard
    local_tokens = sum(int((shard(b.labels) != -100).sum()) for b in micro_batches)
    global_tokens = torch.tensor(local_tokens, device=device, dtype=torch.float64)
    dist.all_reduce(global_tokens)
    global_tokens /= tp
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    for i, batch in enumerate(micro_batches):
        model.set_requires_gradient_sync(t.sync_each_batch or i == len(micro_batches) - 1)
        summed = token_loss_sum(model, batch, device, cp_state, t.loss_chunk_tokens)
        (summed / global_tokens.float()).backward()
        loss_sum += summed.detach()
    grad_norm = clip_grad_norm_(model.parameters(), t.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr = scheduler.get_last_lr()[0]  # this step's
    scheduler.step()
    dist.all_reduce(loss_sum)
    loss_sum /= tp
    return {
        "loss": (loss_sum / global_tokens).item(),
        "grad_norm": grad_norm,
        "tokens": int(global_tokens.item()),
        "lr": lr,
    }


@torch.no_grad()
def batch_loss_sum(model, batch: Batch, device, cp_state: CpState | None, chunk_tokens: int) -> torch.Tensor:
    """Summed token loss over the whole batch: under CP, over every cp rank's positions."""
    summed = token_loss_sum(model, batch, device, cp_state, chunk_tokens)
    if cp_state is not None:
        dist.all_reduce(summed, group=cp_state.group)  # each cp rank scored its own positions
    return summed


@torch.no_grad()
def fixed_batch_loss(model, data, device, cp_state: CpState | None, t: TrainConfig) -> float | None:
    """Mean token loss on a fixed batch (the data's first rows), in eval mode (no dropout), to check exports
    against; none for a stream, which has no first rows that another run could rebuild."""
    if not hasattr(data, "fixed_batch"):
        return None
    batch = data.fixed_batch(t.micro_batch_size)
    with eval_mode(model):
        summed = batch_loss_sum(model, batch, device, cp_state, t.loss_chunk_tokens)
    return (summed / (batch.labels != -100).sum()).item()


def verify_loss_at_start(model, data, held_out, device, cfg: Config) -> dict:
    """Before step 1: this script's training and evaluation losses are Transformers' own on rows of its data
    (common/ops/loss_check.py); under CP, with the CP attention."""
    chunk = cfg.train.loss_chunk_tokens
    train_loss = lambda batch, cp_state: token_loss_sum(model, batch, device, cp_state, chunk)
    return loss_check.verify_loss_at_start(model, data, held_out, device, cfg, train_loss)


def check_config(cfg: Config, world_size: int) -> tuple[int, int, int]:
    """Bad sizes fail here, before any process group or memory: (dp_replicate, dp_shard, dp_size)."""
    p, t = cfg.parallelism, cfg.train
    for key in ("ep_size", "sp_size"):
        if getattr(p, key) != 1:
            raise ConfigError(
                f"parallelism.{key} is {getattr(p, key)} but pretrain_fsdp.py has no expert or sequence "
                f"parallelism; set it to 1 (EP: finetune_moe_ep_fsdp.py)"
            )
    if p.tp_size > 1 and p.cp_size > 1:
        raise ConfigError(
            f"parallelism.tp_size ({p.tp_size}) and cp_size ({p.cp_size}) are both > 1, which "
            f"pretrain_fsdp.py does not combine (CP's attention gathers whole K/V heads); pick one"
        )
    if p.tp_size > 1 and cfg.lora.r:
        raise ConfigError(
            f"parallelism.tp_size is {p.tp_size} and lora.r is {cfg.lora.r}: PEFT's layers hide the layers "
            f"the TP plan names; set one of them to its default (tp_size=1 or lora.r=0)"
        )
    if cfg.fsdp.xla:
        raise ConfigError(
            "fsdp.xla is true, which is the PyTorch/XLA recipe: run scripts/tpu_xla_fsdp.py, or set "
            "fsdp.xla=false"
        )
    if cfg.fsdp.xla_fsdp_settings or cfg.fsdp.xla_fsdp_grad_ckpt or not cfg.fsdp.xla_fsdp_v2:
        raise ConfigError(
            "fsdp.xla_fsdp_settings / xla_fsdp_grad_ckpt / xla_fsdp_v2 differ from their defaults but "
            "fsdp.xla is false; they apply only to scripts/tpu_xla_fsdp.py with fsdp.xla=true"
        )
    if p.fsdp_size != -1:  # Transformers' name, which the MoE recipe uses for its dense FSDP dimension
        raise ConfigError(
            f"parallelism.fsdp_size is {p.fsdp_size} but pretrain_fsdp.py calls the FSDP dimension "
            f"dp_shard_size; set parallelism.dp_shard_size={p.fsdp_size} and fsdp_size=-1"
        )
    if p.cp_comm_strategy != "allgather":
        raise ConfigError(
            f"parallelism.cp_comm_strategy is {p.cp_comm_strategy!r} but training always all-gathers K/V "
            f"over the cp group (common/cp.py); remove it (it is eval_cp.py's, with eval.attention=torch_cp)"
        )
    if t.router_aux_loss_coef is not None:
        raise ConfigError(
            f"train.router_aux_loss_coef is {t.router_aux_loss_coef} but pretrain_fsdp.py trains no router "
            f"loss; leave it unset (MoE with its router loss: finetune_moe_ep_fsdp.py)"
        )
    if p.cp_size > 1 or p.tp_size > 1:  # CP would split an image's tokens from its pixels; TP: untested
        why = f"parallelism cp_size {p.cp_size} / tp_size {p.tp_size}: they train text only; set both to 1"
        refuse_images(cfg.data, why)
    # Evaluation during training load-balances cp shards and all-gathers K/V, whatever these two say.
    refuse_set_keys(cfg, {f"eval.{key}": "only eval_cp.py reads it" for key in ("load_balance", "attention")})
    dp_replicate, dp_shard = resolve_dp_sizes(p, world_size)
    dp_size = world_size // (p.cp_size * p.tp_size)  # the cp and tp ranks of a data-parallel group share it
    check_batch_sizes(cfg.train, dp_size)
    return dp_replicate, dp_shard, dp_size


# A feature's module is imported where its config asks for it: a dense run takes none (docs/layout.md).
def add_adapters(model: torch.nn.Module, cfg: Config) -> None:
    if cfg.lora.r:
        from common import lora

        lora.add_adapters(model, cfg.lora, resolve_device(cfg.train.device).type)


def use_context_parallel(cfg: Config, hf_config: PretrainedConfig) -> None:
    if cfg.parallelism.cp_size > 1:
        from common import cp

        cp.check_cp(cfg.data.seq_len, cfg.parallelism.cp_size, True, hf_config.get_text_config())
        cfg.model.attn_implementation = cp.use_cp_attention(hf_config)


def context_parallel_state(cfg: Config, device: torch.device) -> CpState | None:
    if cfg.parallelism.cp_size > 1:
        from common import cp

        return cp.build_cp_state(cfg.data.seq_len, cfg.parallelism.cp_size, True, device)
    return None


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh | None) -> None:
    if tp_mesh is not None:
        from common.tp import apply_tp

        apply_tp(model, tp_mesh)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv, description=__doc__)
    t, c, e, p, seq_len = cfg.train, cfg.checkpoint, cfg.eval, cfg.parallelism, cfg.data.seq_len
    dp_replicate, dp_shard, dp_size = check_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    hf_config = load_model_config(cfg.model, seq_len)
    text_config = hf_config.get_text_config()  # an image-text release's language model; else hf_config
    use_context_parallel(cfg, hf_config)  # cp_size > 1: attention all-gathers K/V over the cp group
    model = build_meta_model(hf_config, cfg.model, t.gradient_checkpointing)  # on `meta`: no memory yet
    resolve_layer_classes(model, cfg.fsdp)  # a bad class name fails before any process group exists
    add_adapters(model, cfg)  # lora.r > 0: PEFT's adapters; the base frozen
    loss.compute_loss_in_output_layer(model)  # train.loss_chunk_tokens: no full-vocabulary logits

    # Meshes: FSDP over dp_shard or HSDP over (dp_replicate, dp_shard); x cp with CP; x tp with TP.
    prepare_diagnostics(cfg)  # NCCL's flight recorder dumps under the run directory on a timeout
    d, device = init_distributed(t.device, p.timeout_minutes), resolve_device(t.device)
    verify_model_checksums(cfg.model, c.verify_checksums)  # each rank its share of the files: read once
    mesh, tp_mesh = build_meshes(device.type, dp_replicate, dp_shard * p.cp_size, p.tp_size)
    cp_state = context_parallel_state(cfg, device)  # cp_size > 1: this rank's positions of each row
    torch.manual_seed(t.seed)

    # Data before the model: a bad dataset fails before any memory. A dp rank's cp and tp peers share it.
    dp_rank = d.rank // (p.cp_size * p.tp_size)
    tokenizer, data = build_batches(cfg.data, t, dp_rank, dp_size, d.is_main, text_config.vocab_size)
    held_out = held_out_batches(cfg.data, e, tokenizer, dp_rank, dp_size, d.is_main) if e.interval else []
    resume_from = find_resume_checkpoint(c.dir, c.resume, c.verify_checksums)  # rank 0 picks an undamaged one

    # Shard first, then allocate: no rank ever holds the full fp32 model.
    apply_tensor_parallel(model, tp_mesh)  # the model's own Transformers TP plan; FSDP then shards each piece
    sharding = apply_fsdp(model, mesh, cfg.fsdp, device.type, compile_layers=t.compile)
    materialise(model, device, cfg.fsdp.cpu_offload)  # this rank's shards allocated, buffers computed
    optimizer = build_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    if not resume_from or not all(p.requires_grad for p in model.parameters()):  # frozen: not in checkpoints
        load_or_init_weights(model, cfg)
    # Trained weights, optimizer, scheduler, RNG and data position, resharded to this world size.
    resume_from, state = load_or_set_aside(resume_from, c, load_checkpoint, model, optimizer, scheduler, data)
    start_step, samples = state.get("step", 0), state.get("samples", 0)  # samples: the data position
    checked = verify_loss_at_start(model, data, held_out, device, cfg)  # or it stops: step 0
    logger = MetricsLogger(cfg, d.is_main)
    details = dict(tp_size=p.tp_size, resumed_from=resume_from, start_step=start_step, **checked)
    logger.log(model_ready_record(model, device, cfg.fsdp, mesh, **details, **sharding))
    step_log = StepLog(cfg, logger, start_step, device, flops_per_token(model, seq_len))
    score = partial(evaluate, model, held_out, device, cp_state, e.loss_chunk_tokens, replicas=p.tp_size)
    if held_out and start_step == 0:  # the baseline before training: step 0
        step_log.log_eval(0, score())
    stop, background, stopping = StopRules(cfg, start_step, device, state), BackgroundSaves(logger), None
    train = partial(train_step, model, optimizer, scheduler)
    with step_log, stop, background:
        for step in range(start_step + 1, t.steps + 1):
            result = train(data.micro_batches(samples), device, cp_state, t, p.tp_size)
            samples += t.global_batch_size
            stopping = stop.after_step(step, result["loss"])  # None, or "preempted", "train.stop_after"
            background.finish_if_written()  # a background write that every rank has finished
            step_log.log(step, {**result, "samples": samples})
            if held_out and (step % e.interval == 0 or step == t.steps):
                stopping = stopping or stop.after_eval(step, step_log.log_eval(step, score()))
            if stopping or step == t.steps or (c.interval and step % c.interval == 0):
                state = train_state(step, samples, result["loss"], scheduler, data, **stop.state_dict())
                if c.async_save:  # DCP writes in the background; completed and logged once written
                    background.start(c.dir, step, model, optimizer, state, c.keep_latest, tokenizer)
                else:
                    path = save_checkpoint(c.dir, step, model, optimizer, state, c.keep_latest, tokenizer)
                    logger.log(checkpoint_record(step, path))
            if stopping:
                logger.log({"event": "stopped", "step": step, "reason": stopping, **stop.state_dict()})
                break

    if stopping in (None, "early stopping"):
        if c.load_best_model_at_end and stop.best_step is not None:  # the step with the lowest eval_loss
            load_trained_weights(os.path.join(checkpoints_dir(c.dir), f"step-{stop.best_step}"), model)
        logger.log(final_record(model, optimizer, device, fixed_batch_loss(model, data, device, cp_state, t)))
        if c.export:
            path = export_final(model, cfg, tokenizer, device.type)
            logger.log({"event": "exported", "path": path, "state_dict_type": cfg.fsdp.state_dict_type})
    logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
