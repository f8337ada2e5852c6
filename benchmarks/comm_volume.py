"""FSDP communication per training step, measured against theory.

    python benchmarks/comm_volume.py [--steps 3] [--tiny]

Runs scripts/pretrain_fsdp.py (configs/debug_tiny.json, an MLP width that does not divide the world size, so
padding shows) with `metrics.comm_stats=true` on 2 and 4 CPU ranks, reshard_after_forward true and false, and
compares the all-gather and reduce-scatter bytes of the last step with

    Psi = sum over parameters of ceil(dim0 / W) * W * prod(other dims) * bytes per element  (dim 0 padded)
    all-gather     = k * (2 Psi - Psi_kept) with reshard_after_forward, k * Psi without  (k = micro-batches
                     per step; forward, and again in backward except the units backward needs first, the
                     last decoder layer and the output layer, whose padded bytes are Psi_kept)
    reduce-scatter = Psi          (once per step, on the last micro-batch; k * Psi with train.sync_each_batch)

Prints a markdown table; the ratios should be 1.00.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.launch import TINY, last_step, run_recipe

OVERRIDES = [
    "model.config.intermediate_size=130",
    "metrics.comm_stats=true",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
]


def padded_param_bytes(world: int, element_size: int = 4) -> tuple[int, int]:
    """Psi, and the part of it in the units kept all-gathered after forward (common/wrap.py)."""
    from transformers import LlamaConfig

    from common.model import build_meta_model
    from common.ops.config_sources import load_config
    from common.wrap import needed_first_in_backward, plan_units, resolve_layer_classes

    cfg = load_config(TINY, OVERRIDES)
    model = build_meta_model(LlamaConfig(**cfg.model.config), cfg.model)
    layer_classes = resolve_layer_classes(model, cfg.fsdp)
    kept = needed_first_in_backward(model, plan_units(model, cfg.fsdp, layer_classes), layer_classes)
    kept_params = {id(p) for unit in kept for module in unit for p in module.parameters()}
    total = kept_total = 0
    for param in model.parameters():
        dim0 = math.ceil(param.shape[0] / world) * world
        size = dim0 * math.prod(param.shape[1:]) * element_size
        total += size
        kept_total += size if id(param) in kept_params else 0
    return total, kept_total


def measure(world: int, reshard: bool, steps: int) -> dict:
    return last_step(
        run_recipe(
            world, [f"train.steps={steps}", f"fsdp.reshard_after_forward={str(reshard).lower()}", *OVERRIDES]
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="one step: checks that the benchmark runs")
    args = parser.parse_args()
    args.steps = 1 if args.tiny else args.steps
    print(
        "| ranks | reshard_after_forward | all-gather MB (measured) | theory | ratio "
        "| reduce-scatter MB (measured) | theory | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world in (2,) if args.tiny else (2, 4):  # --tiny: one of each code path
        psi, psi_kept = padded_param_bytes(world)
        k = 8 // (2 * world)  # global batch 8, micro-batch 2
        for reshard in (True, False):
            r = measure(world, reshard, args.steps)
            ag_theory = k * (2 * psi - psi_kept if reshard else psi)
            rs_theory = psi  # once per step, on the last micro-batch (train.sync_each_batch=false)
            print(
                f"| {world} | {reshard} | {r['all_gather_bytes'] / 1e6:.3f} | {ag_theory / 1e6:.3f} | "
                f"{r['all_gather_bytes'] / ag_theory:.2f} | {r['reduce_scatter_bytes'] / 1e6:.3f} | "
                f"{rs_theory / 1e6:.3f} | {r['reduce_scatter_bytes'] / rs_theory:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
