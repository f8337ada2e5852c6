"""Held-out evaluation: the token-weighted loss, perplexity and next-token accuracy over every rank's share of
the held-out rows. The same code scores a saved checkpoint and the model during training, so their numbers
agree. Under context parallelism each cp rank scores its positions of every sequence, and the
tokens are counted on the full rows, before sharding."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import context_parallel

from common.cp import CpState
from common.loss import chunk_logits
from common.wrap import reshard


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list,
    device: torch.device,
    cp_state: CpState | None,
    chunk_tokens: int,
    replicas: int = 1,
    attention: str = "allgather",
) -> dict:
    """{eval_loss, perplexity, accuracy, tokens} over every rank's `batches` (common/data/held_out.py).
    `replicas`: ranks that score the same rows and positions (tensor-parallel peers), counted once;
    `attention`: "torch_cp" runs torch's ring attention (CUDA)."""
    hidden = {}  # the decoder's output: the head runs chunk by chunk in head_loss, never on all tokens
    hook = model.get_decoder().register_forward_hook(
        lambda module, args, out: hidden.update(last=out.last_hidden_state)
    )
    training = model.training
    model.eval()
    counts_tokens = cp_state is None or cp_state.mesh.get_local_rank("cp") == 0  # once per sequence
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, tokens, correct
    try:
        for batch in batches:
            if counts_tokens:
                totals[1] += int((batch.labels != -100).sum())
            labels = forward_shard(model, batch, device, cp_state, attention)
            totals[[0, 2]] += head_loss(model, hidden["last"], labels, chunk_tokens).cpu()
            reshard(model)  # units kept all-gathered after forward (common/wrap.py): no backward frees them
    finally:
        hook.remove()
        model.train(training)
    dist.all_reduce(totals)  # a CPU tensor: gloo carries it, also beside NCCL
    loss_sum, tokens, correct = (totals / replicas).tolist()
    return {
        "eval_loss": loss_sum / tokens,
        "perplexity": math.exp(loss_sum / tokens),
        "accuracy": correct / tokens,
        "tokens": round(tokens),
    }


def forward_shard(model, batch, device, cp_state: CpState | None, attention: str) -> torch.Tensor:
    """Run the model on this rank's share of the batch (its cp positions); returns the labels it scores."""
    input_ids, labels = batch.input_ids.to(device), batch.labels.to(device)
    position_ids = None if batch.position_ids is None else batch.position_ids.to(device)
    if cp_state is None:
        model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=1, use_cache=False)
        return labels
    if attention == "torch_cp":  # torch shards the three buffers in place, then runs ring attention
        position_ids = torch.arange(input_ids.shape[1], device=device).repeat(len(input_ids), 1)
        buffers = [input_ids, labels, position_ids]
        mesh = cp_state.mesh["cp"]
        with context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)
        ):
            model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=1, use_cache=False)
        return labels
    model(**cp_state.shard_inputs(input_ids, position_ids), logits_to_keep=1, use_cache=False)
    return cp_state.shard(labels)


def head_loss(model, hidden: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """[sum of token losses, correct argmax] (float64), the output layer run `chunk` tokens at a time. The
    sums stay on the device: no host sync per chunk."""
    head = model.get_output_embeddings()
    owner = head if isinstance(head, FSDPModule) else model  # a tied head lives in the root unit
    owner.unshard()  # one all-gather of the head's weight for all chunks
    weight = head.weight.full_tensor() if isinstance(head.weight, DTensor) else head.weight  # a TP head
    totals = torch.zeros(2, dtype=torch.float64, device=hidden.device)
    for _, logits, target in chunk_logits(hidden.flatten(0, 1), weight, labels.flatten(), chunk):
        totals[0] += F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
        totals[1] += ((logits.argmax(-1) == target) & (target != -100)).sum()
    owner.reshard()
    return totals
