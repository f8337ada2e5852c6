"""AdamW, the learning-rate schedule, and gradient clipping that works across several device meshes."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

from common.config import Config


def lr_multiplier(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine (or warmup-stable-decay) down to min_lr_ratio."""
    t = cfg.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "wsd":
        decay_start = int(t.steps * (1 - t.wsd_decay_ratio))
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, t.steps - decay_start)
        return 1.0 - (1.0 - t.min_lr_ratio) * progress
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    # No weight decay on norms and biases (1-D), as in Llama and torchtitan. Frozen weights (a LoRA base)
    # get no optimizer state.
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = {"params": [p for p in trained if p.ndim >= 2], "weight_decay": cfg.train.weight_decay}
    no_decay = {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0}
    # Fused AdamW is the faster one where it exists (docs/performance.md); XLA has only foreach.
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        [decay, no_decay],
        lr=cfg.train.lr,
        betas=tuple(cfg.train.betas),
        eps=cfg.train.eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


class NonFiniteGradients(Exception):
    """The gradient norm is NaN or inf: the optimizer step must not run (AdamW would spread it)."""

    def __init__(self, norm: float):
        super().__init__(norm)
        self.norm = norm


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> float:
    """Clip to a global L2 norm; returns the norm before clipping. torch's clip_grad_norm_ needs every
    DTensor gradient on one mesh, but EP puts experts on another: norm per (mesh, placements), combined."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups = defaultdict(list)
    for g in grads:
        groups[(g.device_mesh, g.placements) if isinstance(g, DTensor) else None].append(g)
    squares = []
    for group in groups.values():
        # float64: a float32 sum of squares drifts enough to hide parity gaps (docs/performance.md).
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in group])
        )
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = float(torch.stack(squares).sum().sqrt()) if squares else 0.0
    if not math.isfinite(total):  # every rank has the same all-reduced norm, so every rank stops here
        raise NonFiniteGradients(total)
    if max_norm > 0 and total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))
    return total
