"""Held-out evaluation: the token-weighted loss, perplexity and next-token accuracy over every rank's share of
the held-out rows. The same code scores a saved checkpoint and the model during training, so their numbers
agree. Under context parallelism each cp rank scores its positions of every sequence, and the
tokens are counted on the full rows, before sharding."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from common.loss import token_loss_sum

if TYPE_CHECKING:
    from common.cp import CpState


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
    `attention`: "torch_cp" runs torch's ring attention (CUDA). The loss is the training loss's, through the
    model's own forward (common/loss.py), so whatever the model does to its logits counts here too."""
    counts_tokens = cp_state is None or cp_state.mesh.get_local_rank("cp") == 0  # once per sequence
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, tokens, correct
    with eval_mode(model):
        for batch in batches:
            if counts_tokens:
                totals[1] += int((batch.labels != -100).sum())
            totals[[0, 2]] += score_shard(model, batch, device, cp_state, attention, chunk_tokens).cpu()
    dist.all_reduce(totals)  # a CPU tensor: gloo carries it, also beside NCCL
    loss_sum, tokens, correct = (totals / replicas).tolist()
    return {
        "eval_loss": loss_sum / tokens,
        "perplexity": math.exp(loss_sum / tokens),
        "accuracy": correct / tokens,
        "tokens": round(tokens),
    }


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) inside, in the mode it had after, also after an error."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def score_shard(model, batch, device, cp_state: CpState | None, attention: str, chunk: int) -> torch.Tensor:
    """[summed token loss, correct argmax predictions] (float64) on this rank's share of the batch (its cp
    positions), the output layer run `chunk` tokens at a time."""
    inputs, labels = batch.model_inputs(device), batch.labels.to(device)
    input_ids, position_ids = inputs["input_ids"], inputs["position_ids"]
    score = partial(token_loss_sum, model, count_correct=True, chunk_tokens=chunk, use_cache=False)
    if cp_state is None:
        return score(labels, **inputs)
    if attention == "torch_cp":  # eval.attention on CUDA: torch's ring attention
        from common.cp import score_with_torch_cp

        return score_with_torch_cp(score, input_ids, labels, cp_state)
    return score(cp_state.shard(labels), **cp_state.shard_inputs(input_ids, position_ids))
