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

import os
import sys
from collections.abc import Callable
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch
import torch.distributed as dist

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
from common.data.sft import build_sft_batches
from common.evaluate import eval_mode, evaluate
from common.export import export_final
from common.load_weights import load_or_init_weights
from common.mesh import gather_objects, init_distributed
from common.model import build_meta_model, load_model_config, materialise
from common.moe import (
    MoeSizes,
    RouterLogits,
    apply_tp_ep,
    build_moe_meshes,
    data_parallel_rank,
    fsdp_meshes,
    moe_parts,
    no_load_balancing_loss,
    resolve_moe_sizes,
    router_load,
)
from common.ops import loss_check
from common.ops.async_save import BackgroundSaves
from common.ops.cli import parse_args, refuse_set_keys, run_cli
from common.ops.integrity import verify_model_checksums
from common.ops.metrics import MetricsLogger, StepLog, checkpoint_record, final_record, model_ready_record
from common.ops.profiling import prepare_diagnostics
from common.ops.run_dir import find_resume_checkpoint, load_or_set_aside
from common.ops.stopping import StopRules
from common.optim import build_optimizer, clip_grad_norm_, lr_multiplier
from common.wrap import apply_fsdp, resolve_layer_classes


class MoeLoss:
    """Token-summed cross-entropy on answer tokens, plus the model's router load-balancing loss."""

    def __init__(self, model, aux_loss_fn, num_experts: int, t: TrainConfig, tp: int):
        self.router_logits = RouterLogits(model)
        # A tensor-parallel head splits the vocabulary, which the chunked loss does not (a vocab-parallel
        # cross-entropy would): it takes full logits there.
        self.chunk_tokens = t.loss_chunk_tokens if tp == 1 else 0
        self.aux_loss_fn, self.num_experts = aux_loss_fn, num_experts
        text = model.config.get_text_config()  # an image-text release's language model
        self.top_k = text.num_experts_per_tok
        # train.router_aux_loss_coef, or else the model config's own
        coef = t.router_aux_loss_coef
        self.coef = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef

    def __call__(self, model, batch: Batch, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cross-entropy summed over answer tokens, router aux loss, [layers, experts] token counts)."""
        mask = batch.token_mask.to(device)
        # Restarting position ids and no attention mask make Transformers build a per-example causal mask
        # (packing); a KV cache would switch that detection off.
        self.router_logits.take()  # drop what an activation-checkpointing recompute left behind
        ce = loss.token_loss_sum(
            model,
            batch.labels.to(device),
            self.chunk_tokens,
            input_ids=batch.input_ids.to(device),
            position_ids=batch.position_ids.to(device),
            use_cache=False,
        )
        router_logits = self.router_logits.take()
        aux = self.aux_loss_fn(router_logits, self.num_experts, self.top_k, mask)
        return ce, aux, router_load(router_logits, self.top_k, mask)


def global_sum(value: torch.Tensor, tp: int) -> torch.Tensor:
    """Sum over data-parallel ranks: tensor-parallel peers hold the same batch, so they count once."""
    value = value.clone()
    dist.all_reduce(value)
    return value / tp


def train_step(
    model, optimizer, scheduler, micro_batches, loss_fn: MoeLoss, device, t: TrainConfig, tp: int
) -> dict:
    """One optimizer step; the loss is divided by the global answer-token count and FSDP sums gradients
    (see apply_fsdp), so any (fsdp, ep, tp) layout gives the one-process update."""
    targets = [(b.labels != -100).sum() for b in micro_batches]
    global_tokens = global_sum(torch.stack(targets).sum().double().to(device), tp)
    processed = global_sum(sum(b.token_mask.sum() for b in micro_batches).double().to(device), tp)
    ce_sum = aux_sum = torch.zeros((), device=device, dtype=torch.float64)
    load = 0
    for i, (batch, tokens) in enumerate(zip(micro_batches, targets)):
        # Reduce-scatter after every micro-batch or only the last one: train.sync_each_batch.
        model.set_requires_gradient_sync(t.sync_each_batch or i == len(micro_batches) - 1)
        ce, aux, counts = loss_fn(model, batch, device)
        # The aux loss is a per-micro-batch mean; weighting it by the batch's answer tokens makes its sum
        # over ranks a token-weighted mean that does not depend on how the batch is split.
        weighted_aux = aux * tokens.to(device)
        ((ce + loss_fn.coef * weighted_aux) / global_tokens.float()).backward()
        ce_sum, aux_sum, load = ce_sum + ce.detach(), aux_sum + weighted_aux.detach(), load + counts
    grad_norm = clip_grad_norm_(model.parameters(), t.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr = scheduler.get_last_lr()[0]  # this step's
    scheduler.step()
    ce_sum, aux_sum, load = (global_sum(x, tp) for x in (ce_sum, aux_sum, load.double()))
    return {
        "loss": (ce_sum / global_tokens).item(),
        "lr": lr,
        "router_aux_loss": (aux_sum / global_tokens).item(),
        "grad_norm": grad_norm,
        "tokens": int(global_tokens.item()),
        "tokens_processed": int(processed.item()),
        "tokens_per_expert_max": load.max(dim=1).values.tolist(),
        "tokens_per_expert_mean": load.mean(dim=1).tolist(),
    }


@torch.no_grad()
def fixed_batch_loss(model, data, loss_fn: MoeLoss, device, micro_batch: int) -> float:
    """Mean answer-token loss on a fixed batch (the data's first rows), in eval mode (no dropout): plain
    Transformers must reproduce it from the export."""
    batch = data.fixed_batch(micro_batch)
    with eval_mode(model):
        summed = loss_fn(model, batch, device)[0]
    return (summed / (batch.labels != -100).sum()).item()


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


def moe_details(experts: list, loss_fn: MoeLoss) -> dict:
    """What model_ready logs for an MoE run: every rank's expert layout, and the loss's settings."""
    return {
        "experts": loss_fn.num_experts,
        "expert_layout_per_rank": gather_objects(expert_layout(experts)),
        "router_aux_loss_coef": loss_fn.coef,
        "loss_chunk_tokens": loss_fn.chunk_tokens,
    }


# Keys the other recipes read and this one has no use for: refused, so none is silently ignored
NO_ADAPTERS = "finetune_moe_ep_fsdp.py trains no adapters (lora.r must be 0)"
UNUSED_KEYS = {
    "data.text_field": "SFT records have prompt and answer fields, not a text field",
    "data.streaming": "SFT data is read whole, not streamed",
    "data.document_mask": "SFT rows always restart their positions per example",
    "fsdp.xla_fsdp_v2": "it applies only to scripts/tpu_xla_fsdp.py",
    "metrics.peak_flops": "finetune_moe_ep_fsdp.py logs no MFU",
    "eval.load_balance": "finetune_moe_ep_fsdp.py has no context parallelism",
    "eval.attention": "it is eval_cp.py's key",
    **{
        f"lora.{key}": NO_ADAPTERS
        for key in ("alpha", "dropout", "target_modules", "base_dtype", "merge_on_export")
    },
}


def check_config(cfg: Config, world_size: int, model) -> tuple[MoeSizes, int, Callable]:
    """Bad sizes and keys fail here, before any process group or memory: (sizes, experts, aux loss)."""
    t, p = cfg.train, cfg.parallelism
    if t.compile:
        raise ConfigError(
            "train.compile is true but EP's all-to-all reads split sizes on the host every layer, "
            "which breaks compiled graphs; set train.compile=false"
        )
    if cfg.lora.r:
        raise ConfigError(
            f"lora.r is {cfg.lora.r} but finetune_moe_ep_fsdp.py does not train adapters: PEFT's layers "
            f"would sit between Transformers' TP/EP plans and the modules they shard; set lora.r=0 (dense "
            f"models: scripts/pretrain_fsdp.py)"
        )
    if cfg.data.dataset == "embedded":
        raise ConfigError("data.dataset is 'embedded' (pretraining text); give SFT JSONL or 'arithmetic'")
    refuse_images(cfg.data, "finetune_moe_ep_fsdp.py trains MoE releases on text only yet")
    if cfg.fsdp.xla:
        raise ConfigError(
            "fsdp.xla is true, which is the PyTorch/XLA recipe: run scripts/tpu_xla_fsdp.py, or set "
            "fsdp.xla=false"
        )
    if cfg.fsdp.xla_fsdp_settings or cfg.fsdp.xla_fsdp_grad_ckpt:
        raise ConfigError(
            "fsdp.xla_fsdp_settings / xla_fsdp_grad_ckpt are set but fsdp.xla is false; they apply "
            "only to scripts/tpu_xla_fsdp.py with fsdp.xla=true"
        )
    refuse_set_keys(cfg, UNUSED_KEYS)
    for key in ("cp_size", "sp_size"):
        if getattr(p, key) != 1:
            raise ConfigError(
                f"parallelism.{key} is {getattr(p, key)} but finetune_moe_ep_fsdp.py has no context "
                f"parallelism; set it to 1"
            )
    if p.dp_shard_size != -1:
        raise ConfigError(
            f"parallelism.dp_shard_size is {p.dp_shard_size}; finetune_moe_ep_fsdp.py uses "
            f"Transformers' name for it, set parallelism.fsdp_size instead"
        )
    parts = moe_parts(model)
    if parts is None:
        raise ConfigError(
            f"model {cfg.model.name_or_path or 'model.config'} is a {type(model).__name__}, not a "
            f"mixture-of-experts model the recipe can train (it needs an expert plan naming the model's "
            f"expert modules, and routers that record their logits); use scripts/pretrain_fsdp.py for dense "
            f"models"
        )
    num_experts, aux_loss_fn = parts
    if aux_loss_fn is no_load_balancing_loss and t.router_aux_loss_coef:
        raise ConfigError(
            f"train.router_aux_loss_coef is {t.router_aux_loss_coef} but {type(model).__name__} has no "
            f"load-balancing loss (it balances its experts by its routing); leave it unset"
        )
    sizes = resolve_moe_sizes(p, world_size, num_experts)
    check_batch_sizes(t, sizes.dp)
    resolve_layer_classes(model, cfg.fsdp)  # a bad class name fails before any process group exists
    return sizes, num_experts, aux_loss_fn


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv, description=__doc__)
    t, c, e = cfg.train, cfg.checkpoint, cfg.eval
    hf_config = load_model_config(cfg.model, cfg.data.seq_len)
    model = build_meta_model(hf_config, cfg.model, t.gradient_checkpointing)  # on `meta`: no memory yet
    sizes, num_experts, aux_loss_fn = check_config(cfg, int(os.environ.get("WORLD_SIZE", 1)), model)
    loss.compute_loss_in_output_layer(model)  # train.loss_chunk_tokens: no full-vocabulary logits

    # Two views of the same ranks: dense (dp_replicate, fsdp, tp) and expert (dp_replicate, efsdp, ep).
    prepare_diagnostics(cfg)  # NCCL's flight recorder dumps under the run directory on a timeout
    d = init_distributed(t.device, cfg.parallelism.timeout_minutes)
    verify_model_checksums(cfg.model, cfg.checkpoint.verify_checksums)  # each rank its share of the files
    device, (dense_mesh, expert_mesh) = d.device, build_moe_meshes(d.device.type, sizes)
    dp_rank = data_parallel_rank(dense_mesh)  # tp peers share a batch
    torch.manual_seed(t.seed)

    vocab_size = hf_config.get_text_config().vocab_size  # an image-text release: its language model's
    tokenizer, data = build_sft_batches(cfg.data, t, dp_rank, sizes.dp, d.is_main, vocab_size)  # SFT data
    held_out = held_out_batches(cfg.data, e, tokenizer, dp_rank, sizes.dp, d.is_main) if e.interval else []
    resume_from = find_resume_checkpoint(c.dir, c.resume, c.verify_checksums)  # rank 0 picks an undamaged one

    # TP and EP from the model's own plans, then FSDP: experts over (dp_replicate, efsdp), the rest over
    # (dp_replicate, fsdp). Still on `meta`: no rank ever holds the full model.
    experts = apply_tp_ep(model, sizes, dense_mesh, expert_mesh)
    dp_mesh, efsdp_mesh = fsdp_meshes(dense_mesh, expert_mesh)
    sharding = apply_fsdp(model, dp_mesh, cfg.fsdp, device.type, experts=experts, expert_mesh=efsdp_mesh)
    materialise(model, device, cfg.fsdp.cpu_offload)  # this rank's shards allocated, buffers computed
    optimizer = build_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    if not resume_from or not all(p.requires_grad for p in model.parameters()):  # frozen: not in checkpoints
        load_or_init_weights(model, cfg)
    # Weights, optimizer, scheduler and RNG, resharded to this world size; its train_state.
    resume_from, state = load_or_set_aside(resume_from, c, load_checkpoint, model, optimizer, scheduler)
    start_step, samples = state.get("step", 0), state.get("samples", 0)  # samples: the data position
    loss_fn = MoeLoss(model, aux_loss_fn, num_experts, t, sizes.tp)
    train_loss = lambda batch, _: loss_fn(model, batch, device)[0]  # cross-entropy; the router loss is ours
    checked = loss_check.verify_loss_at_start(model, data, held_out, device, cfg, train_loss)

    logger = MetricsLogger(cfg, d.is_main)
    details = dict(
        resumed_from=resume_from, start_step=start_step, **moe_details(experts, loss_fn), **checked
    )
    logger.log(model_ready_record(model, device, cfg.fsdp, dense_mesh, **details, **sharding))
    step_log = StepLog(cfg, logger, start_step, device)  # no MFU: only the routed experts compute
    score = partial(evaluate, model, held_out, device, None, e.loss_chunk_tokens, replicas=sizes.tp)
    if held_out and start_step == 0:  # the baseline before training: step 0
        step_log.log_eval(0, score())
    stop, background, stopping = StopRules(cfg, start_step, device, state), BackgroundSaves(logger), None
    with step_log, stop, background:
        for step in range(start_step + 1, t.steps + 1):
            batches = data.micro_batches(samples)
            stats = train_step(model, optimizer, scheduler, batches, loss_fn, device, t, sizes.tp)
            samples += t.global_batch_size
            stopping = stop.after_step(step, stats["loss"])  # None, or "preempted", "train.stop_after"
            background.finish_if_written()  # a background write that every rank has finished
            step_log.log(step, {**stats, "samples": samples}, tokens=stats["tokens_processed"])
            if held_out and (step % e.interval == 0 or step == t.steps):
                stopping = stopping or stop.after_eval(step, step_log.log_eval(step, score()))
            if stopping or step == t.steps or (c.interval and step % c.interval == 0):
                state = train_state(step, samples, stats["loss"], scheduler, data, **stop.state_dict())
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
        fixed_loss = fixed_batch_loss(model, data, loss_fn, device, t.micro_batch_size)
        logger.log({**final_record(model, optimizer, device, fixed_loss), "step": t.steps})
        if c.export:
            path = export_final(model, cfg, tokenizer, device.type)
            logger.log({"event": "exported", "path": path, "state_dict_type": cfg.fsdp.state_dict_type})
    logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
