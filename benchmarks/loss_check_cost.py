"""What the start-up loss check (common/loss_check.py) costs, against one training step of the same run.

    python benchmarks/loss_check_cost.py [--steps 6]

pretrain_fsdp.py on configs/debug_llama.json (the quickstart: 4 micro-batches of 4 x 256 tokens per rank and
step) and on debug_sft.json, on 1 and 2 CPU processes. The check's seconds are model_ready's
loss_at_start.seconds (it runs the model's first forwards, with their warm-up); a step's are tokens /
tokens_per_s, for the first step and the median of the rest. Prints a markdown table with the ratio to a
steady step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.launch import REPO, event, pretrain, steps  # noqa: E402

CONFIGS = {
    "debug_llama.json": ["metrics.log_every=1", "checkpoint.export=false", "checkpoint.interval=0"],
    "debug_sft.json": ["metrics.log_every=1", "checkpoint.export=false", "checkpoint.interval=0"],
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print("| config | processes | check (s) | first step (s) | steady step (s) | check / steady step |")
    print("|---|---|---|---|---|---|")
    for name, overrides in CONFIGS.items():
        for nproc in (1, 2):
            with tempfile.TemporaryDirectory() as run_dir:
                records = pretrain(
                    run_dir,
                    f"train.steps={args.steps}",
                    *overrides,
                    "checkpoint.load_best_model_at_end=false",
                    nproc=nproc,
                    config=os.path.join(REPO, "configs", name),
                    timeout=900,
                )
            check = event(records, "model_ready")["loss_at_start"]["seconds"]
            seconds = [r["tokens"] / r["tokens_per_s"] for r in steps(records)]
            step = statistics.median(seconds[1:])
            row = f"| {name} | {nproc} | {check:.3f} | {seconds[0]:.3f} | {step:.3f} | {check / step:.2f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
