"""Evaluation loss, perplexity and token accuracy of a checkpoint with context parallelism (cp) x data parallelism.

    torchrun --nproc_per_node 4 scripts/eval_cp.py --config configs/debug_eval_cp.json parallelism.cp_size=2

The story of main(): config -> (dp, cp) mesh -> model on `meta` -> fully_shard over all ranks -> load the
checkpoint (HF directory, FULL export, or SHARDED export) -> for each batch: shift labels on the full sequence,
shard inputs, labels and positions over cp, forward with all-gather-K/V attention, chunked head + loss ->
all-reduce sums -> eval_results.json.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.nn.functional import all_gather
from transformers import AttentionInterface

from common.checkpoint import is_sharded_export, load_hf_weights, load_sharded_export
from common.config import Config, ConfigError, parse_args, run_cli
from common.data import build_batches
from common.mesh import build_dp_mesh, init_distributed
from common.metrics import peak_memory_bytes, reset_peak_memory
from common.model import build_meta_model, init_buffers, load_model_config
from common.wrap import apply_fsdp, resolve_layer_classes

# The cp group and the global positions of this rank's queries and of all keys, set per batch. The attention
# function is called by the model's own layers, so it can only read them from here.
CP: dict = {}


def allgather_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention over a sequence sharded across the cp group: gather K and V, mask by global position.

    torch's context_parallel needs CUDA SDPA kernels (on CPU it has no sharding strategy for
    _scaled_dot_product_flash_attention_for_cpu); this works on any device and in backward (autograd all-gather).
    """
    if CP["size"] > 1:
        key = torch.cat(all_gather(key.contiguous(), group=CP["group"]), dim=2)
        value = torch.cat(all_gather(value.contiguous(), group=CP["group"]), dim=2)
    mask = CP["query_positions"][:, None] >= CP["key_positions"][None, :]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("cp_allgather", allgather_kv_attention)


def shard_positions(seq_len: int, cp_size: int, cp_rank: int, load_balance: bool) -> torch.Tensor:
    """The positions a cp rank holds: chunk r, or chunks r and 2cp-1-r (head-tail) to balance causal work."""
    if not load_balance:
        return torch.arange(seq_len).chunk(cp_size)[cp_rank]
    chunks = torch.arange(seq_len).chunk(2 * cp_size)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])


def check_lengths(cfg: Config) -> None:
    cp, seq_len = cfg.parallelism.cp_size, cfg.data.seq_len
    multiple = 2 * cp if cfg.eval.load_balance else cp
    if seq_len % multiple:
        lower, upper = seq_len // multiple * multiple, (seq_len // multiple + 1) * multiple
        nearest = f"{lower} or {upper}" if lower else str(upper)
        raise ConfigError(f"data.seq_len={seq_len} is not divisible by {multiple} (cp_size={cp}"
                          f"{', x2 for eval.load_balance' if cfg.eval.load_balance else ''}); use {nearest}")


@torch.no_grad()
def head_loss(model, hidden: torch.Tensor, labels: torch.Tensor, chunk: int) -> tuple[float, int, int]:
    """(sum of token losses, valid tokens, correct argmax) with lm_head run `chunk` tokens at a time."""
    head = model.get_output_embeddings()
    owner = head if isinstance(head, FSDPModule) else model  # a tied head lives in the root unit
    owner.unshard()  # one all-gather of the head's weight for all chunks
    hidden, labels = hidden.flatten(0, 1), labels.flatten()
    loss_sum, valid, correct = 0.0, 0, 0
    for start in range(0, hidden.shape[0], chunk):
        logits = F.linear(hidden[start:start + chunk], head.weight).float()
        target = labels[start:start + chunk]
        keep = target != -100
        loss_sum += F.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item()
        valid += int(keep.sum())
        correct += int(((logits.argmax(-1) == target) & keep).sum())
    owner.reshard()
    return loss_sum, valid, correct


def gather_peaks(device: torch.device, world_size: int) -> list[float]:
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak_memory_bytes(device) / 2**30)
    return peaks


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv, description=__doc__)
    p, e = cfg.parallelism, cfg.eval
    check_lengths(cfg)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size % p.cp_size:
        raise ConfigError(f"parallelism.cp_size={p.cp_size} does not divide the world size {world_size}")
    if e.attention not in ("auto", "allgather"):
        raise ConfigError(f"eval.attention is {e.attention!r}; use auto or allgather (torch_cp is not available yet)")
    if not cfg.model.name_or_path:
        raise ConfigError("model.name_or_path is empty; name the HF directory or export to evaluate")
    if cfg.data.streaming:
        raise ConfigError("data.streaming is true; eval_cp.py evaluates local data (the embedded corpus or files)")
    if cfg.data.tokenizer is None and os.path.exists(os.path.join(cfg.model.name_or_path, "tokenizer_config.json")):
        cfg.data.tokenizer = cfg.model.name_or_path  # evaluate with the tokenizer the checkpoint was trained with
    cfg.model.attn_implementation = "cp_allgather"
    hf_config = load_model_config(cfg.model)
    model = build_meta_model(hf_config, cfg.model)
    resolve_layer_classes(model, cfg.fsdp)

    d = init_distributed(cfg.train.device, p.timeout_minutes)
    dp_size = d.world_size // p.cp_size
    mesh = init_device_mesh(d.device.type, (dp_size, p.cp_size), mesh_dim_names=("dp", "cp"))
    dp_rank, cp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    tokenizer, data = build_batches(cfg.data, cfg.train.seed, dp_size, 1, 0, 1, is_main=d.is_main)

    # Weights sharded over every rank (dp x cp), as Accelerate does; loaded exactly like pretrain_fsdp.py.
    apply_fsdp(model, build_dp_mesh(d.device.type, 1, d.world_size), cfg.fsdp, d.device.type)
    model.to_empty(device=torch.device("cpu") if cfg.fsdp.cpu_offload else d.device)
    init_buffers(model, d.device)
    if is_sharded_export(cfg.model.name_or_path):
        load_sharded_export(model, cfg.model.name_or_path)
    else:
        load_hf_weights(model, cfg.model.name_or_path, cfg.fsdp.cpu_ram_efficient_loading, cfg.model.trust_remote_code)
    model.eval()
    reset_peak_memory(d.device)
    hidden = {}
    model.get_decoder().register_forward_hook(lambda module, args, out: hidden.update(last=out.last_hidden_state))

    L = cfg.data.seq_len
    positions = shard_positions(L, p.cp_size, cp_rank, e.load_balance)
    CP.update(size=p.cp_size, group=mesh.get_group("cp"), query_positions=positions.to(d.device),
              key_positions=torch.cat([shard_positions(L, p.cp_size, r, e.load_balance)
                                       for r in range(p.cp_size)]).to(d.device))
    num = min(e.max_sequences, len(data.rows))
    per_step = dp_size * e.batch_size
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, valid tokens, correct tokens
    start_time = time.perf_counter()
    batch = data.fixed_batch(num)  # the first `num` sequences, unshuffled; labels already shifted
    with torch.no_grad():
        for first in range(0, num, per_step):
            # Every rank runs every step (FSDP's all-gathers need all ranks); rows past the end have no targets.
            index = [first + dp_rank * e.batch_size + i for i in range(e.batch_size)]
            rows = [i if i < num else 0 for i in index]
            input_ids, labels = batch.input_ids[rows], batch.labels[rows].clone()
            labels[[j for j, i in enumerate(index) if i >= num]] = -100
            shard = (input_ids[:, positions], labels[:, positions], positions.expand(len(rows), -1))
            model(input_ids=shard[0].to(d.device), position_ids=shard[2].to(d.device), logits_to_keep=1)
            loss_sum, valid, correct = head_loss(model, hidden["last"], shard[1].to(d.device), e.loss_chunk_tokens)
            totals += torch.tensor([loss_sum, valid, correct], dtype=torch.float64)
    dist.all_reduce(totals)  # over dp x cp: token counts were never multiplied by cp, shards partition sequences
    loss_sum, tokens, correct = totals.tolist()
    results = {"eval_loss": loss_sum / tokens, "perplexity": math.exp(loss_sum / tokens), "accuracy": correct / tokens,
               "tokens": int(tokens), "sequences": num, "seq_len": L, "cp_size": p.cp_size, "dp_size": dp_size,
               "load_balance": e.load_balance, "tokens_per_s": tokens / (time.perf_counter() - start_time),
               "peak_mem_gib_per_rank": gather_peaks(d.device, d.world_size)}
    if d.is_main:
        os.makedirs(cfg.checkpoint.dir, exist_ok=True)
        with open(os.path.join(cfg.checkpoint.dir, "eval_results.json"), "w") as f:
            json.dump(results, f, indent=2)
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
