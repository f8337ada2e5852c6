"""The output layer and its cross-entropy, a chunk of tokens at a time, so the logits of a whole
micro-batch never exist: at a 128k vocabulary they take GiBs per sequence, held three times over on the
plain path (docs/performance.md, "The output layer in chunks"). Liger's fused kernel does the same on CUDA
only; this is plain torch."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from common.wrap import reshard


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T + bias` against `labels` (-100: no loss), chunk by chunk
    (the bias is None for most heads; Phi, GPT-J and CodeGen train one). The loss ends the graph and is a
    scalar, so the gradients are computed in forward while each chunk's logits exist (as Liger's fused kernel
    does) and backward only scales them: three matmuls per chunk, as on the plain path, and no recompute.
    `with_grads=False` (evaluation) computes the loss alone. The second output counts the tokens whose label
    is the logits' argmax (evaluation's accuracy)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, with_grads: bool):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
        # fp32 until backward scales them: chunk sums in bf16 lose precision (docs/performance.md).
        grad_hidden = torch.empty_like(hidden, dtype=torch.float32) if with_grads else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_grads else None
        grad_bias = None if bias is None or not with_grads else torch.zeros_like(bias, dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits, target = F.linear(hidden[rows], weight, bias).float(), labels[rows]
            # The loss is log-sum-exp minus the label's logit, and the softmax is built in the logits' own
            # buffer: one logits-sized buffer per chunk, and no hidden temporaries that the planner's fake
            # tensors would miss (logsumexp's kernel makes one; F.cross_entropy holds a log-softmax).
            keep = (target != -100).unsqueeze(1)
            picked = logits.gather(1, target.clamp(min=0).unsqueeze(1))
            maxes, argmax = logits.max(dim=-1, keepdim=True)
            correct += ((argmax == target.unsqueeze(1)) & keep).sum()
            exp = logits.sub_(maxes).exp_()
            sum_exp = exp.sum(dim=-1, keepdim=True)
            total += (sum_exp.log() + maxes - picked).masked_fill_(~keep, 0).sum()
            if not with_grads:
                continue
            # d(loss)/d(logits) = softmax - one_hot(label), zero for ignored tokens; no data-dependent
            # shapes, so the planner's fake tensors run it.
            grad_logits = exp.div_(sum_exp)
            grad_logits.scatter_add_(1, target.clamp(min=0).unsqueeze(1), -keep.to(grad_logits.dtype))
            grad_logits = grad_logits.mul_(keep)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(dim=0)
            grad_logits = grad_logits.to(hidden.dtype)
            grad_hidden[rows] = grad_logits @ weight
            if weight.dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), hidden[rows])
            else:
                grad_weight += grad_logits.t() @ hidden[rows]
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, grad_correct):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        if grad_hidden is None:
            raise RuntimeError("ChunkedCrossEntropy ran with with_grads=False; it has no gradients")
        hidden_dtype, weight_dtype = ctx.dtypes
        grad_hidden = grad_hidden.mul_(grad_total).to(hidden_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(grad_total).to(weight_dtype)
        return grad_hidden, grad_weight.mul_(grad_total).to(weight_dtype), grad_bias, None, None, None


def compute_loss_in_output_layer(model: nn.Module) -> None:
    """Let the output layer compute the chunked loss in its own forward while `head.loss_labels` is set: a
    new forward, not a wrapper module, so FSDP's hooks and the parameter names stay as they are. Call it on
    the model on `meta`: it also checks, once, that the model returns its output layer's result unchanged
    (the planner's guess, on fake tensors; common/ops/loss_check.py proves it on real ones before step 1)."""
    head = model.get_output_embeddings()
    plain = head.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if head.loss_labels is None:
            return plain(hidden)
        wanted = head.loss_labels
        leaves = (hidden, head.weight, head.bias)
        with_grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves)
        hidden = hidden.flatten(0, -2)
        head.loss_sum, head.correct = ChunkedCrossEntropy.apply(
            hidden, head.weight, head.bias, wanted.labels, wanted.chunk, with_grads
        )
        return head.loss_sum  # Transformers returns it as `.logits`; token_loss_sum reads it from the head

    head.forward = forward
    head.loss_labels = head.loss_sum = head.correct = None
    head.use_chunked_loss = returns_head_output(model)
    if not head.use_chunked_loss:
        use_full_logits(model, "transforms its output layer's logits (a scale or soft-cap)")


def use_full_logits(model: nn.Module, why: str) -> None:
    """From now on training and evaluation take full logits: the chunked loss is not the model's."""
    model.get_output_embeddings().use_chunked_loss = False
    if os.environ.get("RANK", "0") == "0":
        print(
            f"{type(model).__name__} {why}, which the chunked loss cannot: training and evaluation take full "
            f"logits (train.loss_chunk_tokens and eval.loss_chunk_tokens have no effect; "
            f"docs/features.md#which-models)",
            file=sys.stderr,
            flush=True,
        )


class HeadResultChanged(RuntimeError):
    """The model did something to its output layer's result, which the chunked loss replaced."""


class _HiddenStates(dict):
    """A decoder's output holding only its last hidden state: any other field is None, by attribute or by
    index, and `**output` (image-text models re-wrap their language model's output) gives the one field."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__(last_hidden_state=hidden)

    def __getattr__(self, name: str) -> torch.Tensor | None:
        return self.get(name)

    def __getitem__(self, key: int | str) -> torch.Tensor | None:
        return self.get("last_hidden_state" if key == 0 else key)


@torch.no_grad()
def returns_head_output(model: nn.Module) -> bool:
    """Whether the model's forward returns its output layer's result as it is, found by running that forward
    on `meta` with the decoder and the head stubbed out (no kernels, no collectives, milliseconds): a model
    that scales or soft-caps its logits (Gemma 2/3, Cohere, Granite, ...) returns a new tensor. No list of
    config names keeps up with Transformers' models; none in Transformers 5.24 changes them in place."""
    head, decoder = model.get_output_embeddings(), model.get_decoder()
    hidden = torch.zeros(1, 2, head.weight.shape[1], device="meta")
    result = torch.zeros(1, 2, head.weight.shape[0], device="meta")
    own = {
        module: module.__dict__.get("forward") for module in (decoder, head)
    }  # a forward set on the instance
    decoder.forward = lambda *args, **kwargs: _HiddenStates(hidden)
    head.forward = lambda hidden: result
    try:
        return model(input_ids=torch.zeros(1, 2, dtype=torch.long, device="meta")).logits is result
    except RuntimeError:  # a forward that reads values on meta (ModernBERT-decoder's .item())
        return (
            True  # unknown here: the start-up loss check decides on real tensors (common/ops/loss_check.py)
        )
    finally:
        for module, forward in own.items():
            del module.forward
            if forward is not None:
                module.forward = forward


def token_loss_sum(
    model: nn.Module, labels: torch.Tensor, chunk_tokens: int, count_correct: bool = False, **inputs
) -> torch.Tensor:
    """The model's cross-entropy summed over tokens (label -100: none); with count_correct, [that sum, the
    tokens whose label is the argmax]. With chunk_tokens > 0 the output layer computes it inside its own
    forward (compute_loss_in_output_layer, called once on the model), `chunk_tokens` tokens at a time, so
    FSDP all-gathers its weight once per micro-batch, as for the plain layer. 0, or a model that transforms
    its logits: full logits, then the loss."""
    head = model.get_output_embeddings()
    # A tensor-parallel head splits the vocabulary, which the chunks do not (a vocab-parallel cross-entropy
    # would): it takes full logits, which its plan gathers.
    vocab_split = "tp" in (getattr(getattr(head.weight, "device_mesh", None), "mesh_dim_names", None) or ())
    if chunk_tokens and not hasattr(head, "loss_labels"):
        raise RuntimeError("call compute_loss_in_output_layer(model) before token_loss_sum with chunks")
    if not chunk_tokens or not head.use_chunked_loss or vocab_split:
        logits = model(**inputs).logits.float().flatten(0, 1)
        labels = labels.flatten()
        summed = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        correct = ((logits.argmax(-1) == labels) & (labels != -100)).sum() if count_correct else None
    else:
        head.loss_labels = SimpleNamespace(labels=labels.flatten(), chunk=chunk_tokens)
        try:
            returned = model(**inputs).logits
            summed, correct = head.loss_sum, head.correct
        finally:
            head.loss_labels = head.loss_sum = head.correct = None
        if returned is not summed:  # returns_head_output said otherwise: never a silently wrong loss
            raise HeadResultChanged(
                f"{type(model).__name__} changed its output layer's result; set loss_chunk_tokens=0"
            )
    if not torch.is_grad_enabled():
        # Evaluation: no backward will free the units kept all-gathered after forward (common/wrap.py).
        reshard(model)
    return torch.stack([summed.double(), correct.double()]) if count_correct else summed
