"""Before step 1, each recipe proves on rows of its own data that the losses it trains and evaluates with are
the model's own: Transformers' forward with `labels`, in eval mode. Lists of names and structural probes miss
what released checkpoints carry (a trained output-layer bias, a logit transform, an in-place scale); the
numbers do not (docs/features.md, "Which models")."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import transformers
from torch import nn

from common import loss
from common.config import Config, ConfigError, resolve_mixed_precision
from common.data.batches import Batch
from common.evaluate import eval_mode, score_shard
from common.wrap import reshard

if TYPE_CHECKING:
    from common.cp import CpState

# Relative tolerance per compute dtype. fp32: the paths differ in summation order only. bf16: room above what
# was measured on CPU (docs/features.md, "The start-up loss check"); a chunked loss past it takes full logits.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-3}
# At most 2 rows of 256 positions: Transformers' loss takes their full logits, half of what one chunk of the
# default train.loss_chunk_tokens holds, and the check costs less than a step (docs/features.md).
PROBE_ROWS = 2
PROBE_TOKENS = 256


def probe_rows(data, held_out: list, rows: int) -> Batch | None:
    """The data's first rows (a stream's: the first held-out batch), at most PROBE_ROWS of them, cut to their
    first PROBE_TOKENS positions where those hold targets."""
    if hasattr(data, "fixed_batch"):
        batch = data.fixed_batch(min(rows, PROBE_ROWS))
    elif held_out:
        batch = held_out[0]
    else:
        return None
    if batch.images is not None:  # whole rows: an image's tokens match its pixels
        return batch
    short = Batch(
        *(
            None if t is None else t[:PROBE_ROWS, :PROBE_TOKENS].contiguous()
            for t in dataclasses.astuple(batch)
        )
    )
    return short if (short.labels != -100).any() else batch


def verify_loss_at_start(
    model: nn.Module,
    data,
    held_out: list,
    device,
    cfg: Config,
    train_loss: Callable[[Batch, CpState | None], torch.Tensor] | None,
    attention: str = "allgather",
) -> dict:
    """Before step 1: the recipe's training loss (`train_loss(batch, cp_state)`, this rank's summed token
    loss; None: an evaluation recipe) and its evaluation loss are Transformers' own on the data's first
    rows; what it skips is said in one line.
    Returns the numbers for model_ready."""
    t, e, p = cfg.train, cfg.eval, cfg.parallelism
    batch = probe_rows(data, held_out, t.micro_batch_size)
    skipped = None
    if not t.verify_loss_at_start:
        skipped = "train.verify_loss_at_start is false"
    elif batch is None:
        skipped = "a stream without held-out rows"
    elif attention == "torch_cp":
        skipped = (
            "eval.attention is torch_cp, whose ring attention runs on whole rows (set allgather to check)"
        )
    if skipped:
        print_on_rank0(
            f"loss check skipped: {skipped}; the loss is not compared with Transformers' own before step 1"
        )
        return {}
    if p.tp_size > 1:
        print_on_rank0(
            "loss check: under TP Transformers' own loss runs on the same tensor-parallel model, so the "
            "check proves the output layer and the loss, not the TP layers (test_tp.py compares those)"
        )
    paths = {} if train_loss is None else {"train": train_loss}
    if e.interval or train_loss is None:
        paths["eval"] = lambda batch, cp_state: score_shard(
            model, batch, device, cp_state, "allgather", e.loss_chunk_tokens
        )[0]
    # Under CP both losses run with the CP attention, each cp rank on its positions of the probe's rows.
    probe_cp = None
    if p.cp_size > 1:
        from common import cp  # CP's module, where its config asks for it

        probe_cp = cp.build_cp_state(batch.input_ids.shape[1], p.cp_size, True, device)
    dtype = resolve_mixed_precision(cfg.fsdp, device.type)["param_dtype"]
    return check_loss_at_start(model, batch, device, paths, dtype, probe_cp)


def own_labels(batch: Batch, cp_state: CpState | None) -> torch.Tensor:
    """The labels of this rank's positions (under CP, its share of every row)."""
    return batch.labels if cp_state is None else cp_state.shard(batch.labels)


@torch.no_grad()
def transformers_loss_sum(model: nn.Module, batch: Batch, device, cp_state: CpState | None) -> torch.Tensor:
    """The model's own loss (its forward with labels, Transformers' loss_function) times the target tokens,
    on this rank's positions."""
    labels = own_labels(batch, cp_state).to(device).contiguous()
    inputs = batch.model_inputs(device)
    if cp_state is not None:
        inputs = cp_state.shard_inputs(inputs["input_ids"], inputs["position_ids"])
    inputs["use_cache"] = False
    if hasattr(model.config, "output_router_logits"):  # the cross-entropy alone, without the router loss
        inputs["output_router_logits"] = False
    # The labels are shifted already, which shift_labels tells Transformers.
    try:
        out = model(**inputs, labels=labels, shift_labels=labels)  # every rank: FSDP's forward is collective
    except (AttributeError, TypeError) as e:  # the same on every rank: Transformers' code, not the data
        raise ConfigError(
            f"model_type {model.config.model_type!r}: its own forward in Transformers "
            f"{transformers.__version__} fails on text ({type(e).__name__}: {e}), so its loss cannot be "
            f"checked or trained here"
        ) from None
    reshard(model)  # no backward frees the units kept all-gathered after forward
    tokens = (labels != -100).sum()
    return out.loss.double() * tokens if tokens else torch.zeros((), dtype=torch.float64)


@torch.no_grad()
def check_loss_at_start(
    model: nn.Module,
    batch: Batch,
    device: torch.device,
    paths: dict[str, Callable[[Batch, CpState | None], torch.Tensor]],
    compute_dtype: str,
    cp_state: CpState | None = None,
) -> dict:
    """Each of the recipe's loss `paths` (train, eval) on `batch` against Transformers' own loss, in eval
    mode. A chunked loss that disagrees, where full logits agree, gives way to full logits with one line; a
    loss that still disagrees is one line and exit 2. Returns the numbers for model_ready."""
    start = time.perf_counter()
    with eval_mode(model):
        tokens = int(summed_over_ranks(own_labels(batch, cp_state) != -100))
        want = transformers_mean_loss(model, batch, device, cp_state, tokens)
        got = mean_loss_of_each_path(model, paths, batch, tokens, cp_state)
        wrong = [name for name, value in got.items() if not within_tolerance(value, want, compute_dtype)]
        head = model.get_output_embeddings()
        if wrong and head.use_chunked_loss:
            said = ", ".join(f"{name} {loss_text(got[name])}" for name in wrong)
            head.use_chunked_loss = False
            got = mean_loss_of_each_path(model, paths, batch, tokens, cp_state)
            wrong = [name for name, value in got.items() if not within_tolerance(value, want, compute_dtype)]
            if not wrong:  # said once the full logits are proven
                loss.use_full_logits(model, f"gives a chunked loss of {said} where its own is {want:.6f}")
        if wrong and not within_tolerance(
            again := transformers_mean_loss(model, batch, device, cp_state, tokens), want, compute_dtype
        ):
            raise ConfigError(
                f"{type(model).__name__}'s forward is not deterministic in eval mode: Transformers' own loss "
                f"on the same {tokens} tokens was {want:.6f}, then {again:.6f} (random hashing or sampling "
                f"inside it?), so no loss can be checked against it; set train.verify_loss_at_start=false to "
                f"train it anyway"
            )
        if wrong:
            name = wrong[0]
            raise ConfigError(
                f"{type(model).__name__}'s {name} loss is {loss_text(got[name])} where Transformers' own "
                f"(its forward with labels) is {want:.6f} on the same {tokens} tokens, with full logits too: "
                f"the model's loss is not cross-entropy over its logits (a loss_function of its own?); set "
                f"train.verify_loss_at_start=false to train with the recipe's loss anyway"
            )
        seconds = round(time.perf_counter() - start, 3)
        return {"loss_at_start": {"transformers": want, **got, "tokens": tokens, "seconds": seconds}}


def transformers_mean_loss(
    model: nn.Module, batch: Batch, device, cp_state: CpState | None, tokens: int
) -> float:
    """Transformers' own mean token loss over every rank's positions."""
    return float(summed_over_ranks(transformers_loss_sum(model, batch, device, cp_state)) / tokens)


def mean_loss_of_each_path(
    model: nn.Module, paths: dict, batch: Batch, tokens: int, cp_state
) -> dict[str, float | None]:
    """Each path's mean token loss; None where the model changed the chunked head's result."""
    out = {}
    for name, path in paths.items():
        try:
            out[name] = float(summed_over_ranks(path(batch, cp_state)) / tokens)
        except loss.HeadResultChanged:
            reshard(model)
            out[name] = None
    return out


def summed_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """Summed over the ranks, so every rank decides the same (a rank past the held-out rows scores none)."""
    value = value.detach().double().sum().reshape(1).cpu()
    dist.all_reduce(value)  # a CPU tensor: gloo carries it, also beside NCCL
    return value[0]


def print_on_rank0(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def within_tolerance(value: float | None, want: float, compute_dtype: str) -> bool:
    return value is not None and abs(value - want) <= TOLERANCE[compute_dtype] * abs(want)


def loss_text(value: float | None) -> str:
    return "changed by the model after the output layer" if value is None else f"{value:.6f}"
