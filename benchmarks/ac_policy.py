"""Activation checkpointing policies side by side: memory and speed of each `fsdp.ac_policy` on 2 gloo ranks.

    python benchmarks/ac_policy.py [--steps 6] [--repeats 2] [--tiny]

Runs scripts/pretrain_fsdp.py on the Trainer comparison's 27M-parameter body (hidden 512, MLP 1536, 8
layers) with a 32,000-token vocabulary, seq 512, micro-batch 8, one micro-batch per step: no activation
checkpointing, then `fsdp.ac_policy` "op" (matmul and attention outputs saved), every 2nd layer, and
"full", alternating, `--repeats` times. Reports peak RSS per rank (glibc returns large blocks, so the peak is
what was live) and tokens/s (the median step after the first two), with their ratios to no AC.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.vs_trainer import MODEL as BODY
from tests.launch import losses, run_recipe, steady_step

AC = "fsdp.activation_checkpointing=true"
POLICIES = {
    "no AC": [],
    "op": [AC, "fsdp.ac_policy=op"],
    "every 2nd layer": [AC, "fsdp.ac_policy=2"],
    "full": [AC],
}


def measure(overrides: list[str]) -> dict:
    records = run_recipe(2, overrides, extra_env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    final = next(r for r in records if r.get("event") == "final")
    return {
        "peak_gib": max(final["peak_mem_gib_per_rank"]),
        "tokens_per_s": steady_step(records)["tokens_per_s"],
        "loss": losses(records)[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="debug_tiny-sized, 1 repeat: checks that it runs")
    args = parser.parse_args()
    model, seq, micro = dict(BODY, vocab_size=32000, max_position_embeddings=512), 512, 8
    if args.tiny:
        model = dict(model, vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        seq, micro, args.steps, args.repeats = 64, 2, 3, 1
    common = [
        f"model.config={json.dumps(model)}",
        f"data.seq_len={seq}",
        f"train.global_batch_size={2 * micro}",
        f"train.micro_batch_size={micro}",
        f"train.steps={args.steps}",
    ]
    # --tiny: two policies show the script runs (tests/test_estimate_memory.py runs all four for real)
    policies = dict(list(POLICIES.items())[:2]) if args.tiny else POLICIES
    runs = {policy: [] for policy in policies}
    for _ in range(args.repeats):  # alternate, so drift on a noisy machine hits every row alike
        for policy, keys in policies.items():
            runs[policy].append(measure(common + keys))
    print(
        "| 2 gloo ranks | peak RSS GiB / rank | vs no AC | tokens/s (median) | vs no AC | final loss |\n"
        "|---|---|---|---|---|---|"
    )
    base = None
    for policy, rs in runs.items():
        row = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        base = base or row
        print(
            f"| {policy} | {row['peak_gib']:.3f} | {row['peak_gib'] / base['peak_gib']:.2f} | "
            f"{row['tokens_per_s']:,.0f} | {row['tokens_per_s'] / base['tokens_per_s']:.2f} | "
            f"{row['loss']:.4f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
