"""The output layer and its cross-entropy, a chunk of tokens at a time, so the logits of a whole
micro-batch never exist: at a 128k vocabulary they take GiBs per sequence, held three times over on the
plain path (docs/performance.md, "The output layer in chunks"). Liger's fused kernel does the same on CUDA
only; this is plain torch."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from common.wrap import reshard


def chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """(rows, fp32 logits, labels) for each `chunk` rows of `hidden` [tokens, dim]."""
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        yield rows, F.linear(hidden[rows], weight).float(), labels[rows]


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T` against `labels` (-100: no loss), chunk by chunk. The loss
    ends the graph and is a scalar, so the gradients are computed in forward while each chunk's logits exist
    (as Liger's fused kernel does) and backward only scales them: three matmuls per chunk, as on the plain
    path, and no recompute. `with_grads=False` (evaluation) computes the loss alone."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, with_grads: bool):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # fp32 until backward scales them: chunk sums in bf16 lose precision (docs/performance.md).
        grad_hidden = torch.empty_like(hidden, dtype=torch.float32) if with_grads else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_grads else None
        for rows, logits, target in chunk_logits(hidden, weight, labels, chunk):
            # The loss is log-sum-exp minus the label's logit, and the softmax is built in the logits' own
            # buffer: one logits-sized buffer per chunk, and no hidden temporaries that the planner's fake
            # tensors would miss (logsumexp's kernel makes one; F.cross_entropy holds a log-softmax).
            keep = (target != -100).unsqueeze(1)
            picked = logits.gather(1, target.clamp(min=0).unsqueeze(1))
            maxes = logits.amax(dim=-1, keepdim=True)
            exp = logits.sub_(maxes).exp_()
            sum_exp = exp.sum(dim=-1, keepdim=True)
            total += (sum_exp.log() + maxes - picked).masked_fill_(~keep, 0).sum()
            if not with_grads:
                continue
            # d(loss)/d(logits) = softmax - one_hot(label), zero for ignored tokens; no data-dependent
            # shapes, so the planner's fake tensors run it.
            grad_logits = exp.div_(sum_exp)
            grad_logits.scatter_add_(1, target.clamp(min=0).unsqueeze(1), -keep.to(grad_logits.dtype))
            grad_logits = grad_logits.mul_(keep).to(hidden.dtype)
            grad_hidden[rows] = grad_logits @ weight
            if weight.dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), hidden[rows])
            else:
                grad_weight += grad_logits.t() @ hidden[rows]
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is None:
            raise RuntimeError("ChunkedCrossEntropy ran with with_grads=False; it has no gradients")
        hidden_dtype, weight_dtype = ctx.dtypes
        grad_hidden = grad_hidden.mul_(grad_total).to(hidden_dtype)
        return grad_hidden, grad_weight.mul_(grad_total).to(weight_dtype), None, None, None


def compute_loss_in_output_layer(model: nn.Module) -> None:
    """Let the output layer compute the chunked loss in its own forward while `head.loss_labels` is set: a
    new forward, not a wrapper module, so FSDP's hooks and the parameter names stay as they are."""
    head = model.get_output_embeddings()
    plain = head.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if head.loss_labels is None:
            return plain(hidden)
        wanted = head.loss_labels
        with_grads = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
        hidden = hidden.flatten(0, -2)
        head.loss_sum = ChunkedCrossEntropy.apply(
            hidden, head.weight, wanted.labels, wanted.chunk, with_grads
        )
        return head.loss_sum  # Transformers returns it as `.logits`; token_loss_sum reads it from the head

    head.forward = forward
    head.loss_labels = head.loss_sum = None


def token_loss_sum(model: nn.Module, labels: torch.Tensor, chunk_tokens: int, **inputs) -> torch.Tensor:
    """The model's cross-entropy summed over tokens (label -100: none). With chunk_tokens > 0 the output
    layer computes it inside its own forward (compute_loss_in_output_layer, called once on the model),
    `chunk_tokens` tokens at a time, so FSDP all-gathers its weight once per micro-batch, as for the plain
    layer. 0: full logits, then the loss."""
    # Models that transform the head's output (Gemma's soft-capping, Cohere's logit scale) would apply that
    # to the loss: they take full logits.
    transforms = any(getattr(model.config, key, None) for key in ("final_logit_softcapping", "logit_scale"))
    head = model.get_output_embeddings()
    # A tensor-parallel head splits the vocabulary, which the chunks do not (a vocab-parallel cross-entropy
    # would): it takes full logits, which its plan gathers.
    vocab_split = "tp" in (getattr(getattr(head.weight, "device_mesh", None), "mesh_dim_names", None) or ())
    if chunk_tokens and not hasattr(head, "loss_labels"):
        raise RuntimeError("call compute_loss_in_output_layer(model) before token_loss_sum with chunks")
    if not chunk_tokens or transforms or vocab_split:
        logits = model(**inputs).logits
        summed = F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
    else:
        head.loss_labels = SimpleNamespace(labels=labels.flatten(), chunk=chunk_tokens)
        try:
            returned = model(**inputs).logits
            summed = head.loss_sum
        finally:
            head.loss_labels = head.loss_sum = None
        if returned.dim() != 0:  # a model that reshapes its head's output: never a silently wrong loss
            raise RuntimeError(
                f"{type(model).__name__} reshapes its output layer's result; set train.loss_chunk_tokens=0"
            )
    if not torch.is_grad_enabled():
        # Evaluation: no backward will free the units kept all-gathered after forward (common/wrap.py).
        reshard(model)
    return summed
