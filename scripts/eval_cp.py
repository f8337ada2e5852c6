"""Evaluation loss, perplexity and token accuracy of a checkpoint, with context parallelism (cp) x data
parallelism (dp).

    torchrun --nproc_per_node 4 scripts/eval_cp.py --config configs/debug_eval_cp.json parallelism.cp_size=2

The story of main(): config -> (dp, cp) mesh -> model on `meta` -> fully_shard over all ranks -> load the
checkpoint (HF directory, FULL export, SHARDED export, or a training checkpoint `checkpoints/step-N`) -> for
each batch: shift labels on the full sequence, shard inputs, labels and positions over cp, forward with
context-parallel attention, chunked head + loss -> all-reduce sums -> eval_results.json.

Attention (eval.attention): `torch_cp` is torch's context_parallel (ring attention with
parallelism.cp_comm_strategy), CUDA only; `allgather` is common/cp.py's all-gather-K/V attention, which runs
on any device. `auto` picks torch_cp on CUDA and allgather elsewhere.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

# torch's table of SDPA kernels that context_parallel can run as ring attention (private: no public way to
# ask). It lists the CUDA kernels; tests/cpu_ring_attention.py adds the CPU one for the test suite.
from torch.distributed.tensor.experimental._context_parallel._attention import custom_ops as cp_kernels

from common import cp, loss
from common.config import Config, ConfigError
from common.data.batches import load_tokenizer
from common.data.embedded import ensure_embedded_tokenizer
from common.data.held_out import held_out_rows, rank_batches
from common.data.image_records import refuse_images
from common.data.sft import is_sft
from common.evaluate import evaluate
from common.load_weights import is_sharded_export, load_hf_weights, load_sharded_export
from common.mesh import build_dp_mesh, gather_objects, init_distributed, resolve_device
from common.model import build_meta_model, load_model_config, materialise
from common.ops import loss_check
from common.ops.cli import parse_args, run_cli
from common.ops.integrity import verify_model_checksums
from common.ops.metrics import GIB, event_line, peak_memory_bytes, reset_peak_memory
from common.ops.profiling import prepare_diagnostics
from common.wrap import apply_fsdp, resolve_layer_classes

CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def check_config(cfg: Config, world_size: int) -> str:
    """Bad sizes and keys fail here, before any process group or memory; returns the attention to use."""
    p, e, defaults = cfg.parallelism, cfg.eval, Config()
    cp.check_cp(cfg.data.seq_len, p.cp_size, e.load_balance)
    for key in ("sp_size", "tp_size", "ep_size", "dp_replicate_size"):
        if getattr(p, key) != 1:  # never silently ignored
            raise ConfigError(
                f"parallelism.{key} is {getattr(p, key)} but eval_cp.py shards over dp x cp only; set it to 1"
            )
    refuse_images(
        cfg.data, "eval_cp.py scores text only yet (pretrain_fsdp.py's eval.interval scores them)", False
    )
    if world_size % p.cp_size:
        raise ConfigError(f"parallelism.cp_size={p.cp_size} does not divide the world size {world_size}")
    if not e.load_balance and p.cp_size == 1:
        raise ConfigError(
            "eval.load_balance is false but parallelism.cp_size is 1, so no sequence is sharded; remove it"
        )
    if p.dp_shard_size not in (-1, world_size // p.cp_size):
        raise ConfigError(
            f"parallelism.dp_shard_size is {p.dp_shard_size} but world size {world_size} / cp_size "
            f"{p.cp_size} leaves {world_size // p.cp_size} data-parallel ranks; set it to -1"
        )
    if p.fsdp_size != -1:  # Transformers' name, which only the MoE recipe reads
        raise ConfigError(
            f"parallelism.fsdp_size is {p.fsdp_size} but eval_cp.py shards the weights over every rank "
            f"(dp x cp); set it to -1"
        )
    attention = e.attention
    on_cuda = resolve_device(cfg.train.device).type == "cuda"
    # SFT rows pack examples that must not attend to each other, as data.document_mask keeps documents apart.
    data = cfg.data
    source, split = (data.eval_dataset, data.eval_split) if data.eval_dataset else (data.dataset, data.split)
    documents = data.document_mask or is_sft(source, data.text_field, split)
    if attention == "auto":
        attention = "torch_cp" if on_cuda and p.cp_size > 1 and not documents else "allgather"
    if attention == "torch_cp" and documents:
        raise ConfigError(
            "eval.attention is 'torch_cp' but data.document_mask is true; torch's context_parallel "
            "supports plain causal attention only, so use auto or allgather"
        )
    if attention == "torch_cp" and not on_cuda and CPU_SDPA not in cp_kernels:
        raise ConfigError(
            "eval.attention is 'torch_cp', which needs CUDA SDPA kernels (torch has no CP sharding "
            "rule for the CPU kernel); use auto or allgather"
        )
    if p.cp_comm_strategy != "allgather" and attention != "torch_cp":
        raise ConfigError(
            f"parallelism.cp_comm_strategy is {p.cp_comm_strategy!r} but the attention here is {attention}, "
            f"which all-gathers K/V; remove it, or set eval.attention=torch_cp (CUDA) to use it"
        )
    if cfg.lora.r:
        raise ConfigError(
            f"lora.r is {cfg.lora.r}, but eval_cp.py scores a model directory; train with "
            f"lora.merge_on_export=true and evaluate that export, and set lora.r=0 here"
        )
    if not cfg.model.name_or_path:
        raise ConfigError("model.name_or_path is empty; name the HF directory or export to evaluate")
    if cfg.data.streaming:
        raise ConfigError(
            "data.streaming is true; eval_cp.py evaluates local data (the embedded corpus or files)"
        )
    if cfg.metrics.profile_steps or cfg.metrics.memory_snapshot:
        raise ConfigError(
            "metrics.profile_steps or metrics.memory_snapshot is set; they trace training steps, which "
            "eval_cp.py has none of, so remove them (docs/debugging.md)"
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
    # A training run's config evaluates its checkpoints as it is: what only training reads is named once.
    training = {
        "train": [key for key in vars(cfg.train) if key not in ("device", "verify_loss_at_start")],
        "fsdp": [
            "activation_checkpointing",
            "ac_policy",
            "activation_checkpointing_offload",
            "state_dict_type",
        ],
        "checkpoint": [
            *("interval", "keep_latest", "resume", "export", "async_save", "load_best_model_at_end"),
            *("max_shard_size", "export_dtype", "export_writers"),
        ],
        "metrics": ["log_every", "comm_stats", "tensorboard", "peak_flops"],
        "eval": ["interval", "early_stopping_patience", "early_stopping_threshold"],
        "lora": [key for key in vars(cfg.lora) if key != "r"],
    }
    if cfg.data.tokenizer:
        training["data"] = ["embedded_vocab_size"]  # a tokenizer of its own is used, not the embedded one
    unused = [
        f"{section}.{key}"
        for section, keys in training.items()
        for key in keys
        if getattr(getattr(cfg, section), key) != getattr(getattr(defaults, section), key)
    ]
    if unused and os.environ.get("RANK", "0") == "0":
        print(
            f"config: eval_cp.py evaluates, so these training keys do nothing: {', '.join(unused)}",
            flush=True,
        )
    return attention


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv, description=__doc__)
    p, e, seq_len = cfg.parallelism, cfg.eval, cfg.data.seq_len
    attention = check_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    hf_config = load_model_config(cfg.model, seq_len)
    if p.cp_size > 1 or attention == "torch_cp":  # at cp 1, the model's own attention
        cfg.model.attn_implementation = cp.use_cp_attention(hf_config, torch_cp=attention == "torch_cp")
    cp.check_cp(seq_len, p.cp_size, e.load_balance, hf_config.get_text_config())  # image-text: its LM
    model = build_meta_model(hf_config, cfg.model)  # on `meta`: no memory yet
    loss.compute_loss_in_output_layer(model)  # eval.loss_chunk_tokens: no full-vocabulary logits
    resolve_layer_classes(model, cfg.fsdp)  # a bad class name fails before any process group exists

    # A (dp, cp) mesh: each cp rank holds its (head-tail, with eval.load_balance) share of every sequence.
    prepare_diagnostics(cfg)  # NCCL's flight recorder dumps under the run directory on a timeout
    d = init_distributed(cfg.train.device, p.timeout_minutes)
    verify_model_checksums(cfg.model, cfg.checkpoint.verify_checksums)  # each rank its share of the files
    dp_size = d.world_size // p.cp_size
    cp_state = cp.build_cp_state(seq_len, p.cp_size, e.load_balance, d.device)
    set_rotate_method(p.cp_comm_strategy)  # torch_cp only: how K/V shards travel between cp ranks
    # torch_cp only: its head-tail shards, the same as ours; torch 2.13 has no public switch for it.
    _cp_options.enable_load_balance = e.load_balance
    # The held-out rows (data.eval_dataset, else data.dataset's first rows), the same as training evaluates;
    # each data-parallel rank takes its share, and every cp rank of it the same rows.
    ensure_embedded_tokenizer(cfg.data, d.is_main)
    rows = held_out_rows(cfg.data, e, load_tokenizer(cfg.data), d.is_main)
    batches = rank_batches(rows, e.batch_size, cp_state.dp_rank, dp_size)

    # Weights sharded over every rank (dp x cp), as Accelerate does; loaded exactly like pretrain_fsdp.py.
    apply_fsdp(model, build_dp_mesh(d.device.type, 1, d.world_size), cfg.fsdp, d.device.type, training=False)
    materialise(model, d.device, cfg.fsdp.cpu_offload)  # this rank's shards allocated, buffers computed
    if is_sharded_export(cfg.model.name_or_path):  # a SHARDED export or a training checkpoint: both are DCP
        load_sharded_export(model, cfg.model.name_or_path)
    else:
        source, broadcast = cfg.model.name_or_path, cfg.fsdp.cpu_ram_efficient_loading
        load_hf_weights(model, source, broadcast, cfg.model.trust_remote_code)
    # Before scoring: the evaluation loss is Transformers' own on the first held-out rows.
    checked = loss_check.verify_loss_at_start(model, None, batches, d.device, cfg, None, attention)
    reset_peak_memory(d.device)
    loaded = gather_objects(peak_memory_bytes(d.device) / GIB)  # after the reset: what loading left behind

    start_time = time.perf_counter()
    # Token-weighted over dp x cp: the cp shards partition each sequence, so no token counts twice.
    results = evaluate(model, batches, d.device, cp_state, e.loss_chunk_tokens, attention=attention)
    results["tokens_per_s"] = results["tokens"] / (time.perf_counter() - start_time)
    layout = dict(sequences=len(rows.labels), seq_len=seq_len, cp_size=p.cp_size, dp_size=dp_size)
    results.update(
        layout,
        attention=attention,
        load_balance=e.load_balance,
        mem_after_load_gib_per_rank=loaded,
        **checked,
    )
    results["peak_mem_gib_per_rank"] = gather_objects(peak_memory_bytes(d.device) / GIB)
    if d.is_main:
        os.makedirs(cfg.checkpoint.dir, exist_ok=True)
        with open(os.path.join(cfg.checkpoint.dir, "eval_results.json"), "w") as f:
            json.dump(results, f, indent=2)
        print(event_line({"event": "eval_results", **results}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
