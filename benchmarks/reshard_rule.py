"""Which units to reshard after forward, and whether explicit prefetching helps, on 2 gloo ranks.

    python benchmarks/reshard_rule.py [--steps 8] [--repeats 2] [--tiny]

Runs scripts/pretrain_fsdp.py (a 46M-parameter Llama: hidden 512, MLP 1536, 8 layers, a 32,000-token
vocabulary, seq 512, micro-batch 2, one micro-batch per step) in four ways, alternating, `--repeats` times:

- every unit resharded after forward (what the recipe did before torchtitan's rule);
- the default: the last decoder layer and the norm + lm_head unit stay all-gathered, because backward
  needs them first (`common/wrap.py`, `needed_first_in_backward`);
- the default plus explicit prefetching: each layer's forward starts the next layer's all-gather, and each
  layer's backward the all-gathers of the two layers before it (`set_modules_to_forward_prefetch`,
  `set_modules_to_backward_prefetch`; FSDP2 alone prefetches one layer ahead in backward only);
- `fsdp.reshard_after_forward=false`.

Reports all-gathers per step (calls and MB), peak RSS per rank and tokens/s (median step after the first
two), with the ratios to the first row. glibc is told to return large blocks (MALLOC_MMAP_THRESHOLD_), or
peak RSS could not tell the rows apart.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.vs_trainer import MODEL as BODY
from tests.launch import TINY, read_metrics, run, steady_step, steps, torchrun

MODEL = dict(BODY, vocab_size=32000)
VARIANTS = {
    "every unit resharded": [],
    "default (last layer, output layer kept)": [],
    "default + explicit prefetch": [],
    "reshard_after_forward=false": ["fsdp.reshard_after_forward=false"],
}


def as_rank(variant: str, script: str) -> None:
    """Inside torchrun: patch common.wrap for `variant`, then run the recipe as __main__."""
    import common.wrap as wrap

    if variant == "every unit resharded":
        wrap.needed_first_in_backward = lambda *args: []
    if variant == "default + explicit prefetch":
        apply_fsdp = wrap.apply_fsdp

        def apply_fsdp_and_prefetch(model, *args, **kwargs):
            result = apply_fsdp(model, *args, **kwargs)
            layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
            for i, layer in enumerate(layers):
                layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
                layer.set_modules_to_backward_prefetch(layers[max(i - 2, 0) : i][::-1])
            return result

        wrap.apply_fsdp = apply_fsdp_and_prefetch
    sys.argv = [script, *sys.argv[4:]]
    runpy.run_path(script, run_name="__main__")


def measure(variant: str, overrides: list[str], steps_: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        args = [
            "--config",
            TINY,
            f"checkpoint.dir={run_dir}",
            "checkpoint.export=false",
            "metrics.tensorboard=false",
            "metrics.comm_stats=true",
            f"train.steps={steps_}",
            *overrides,
            *VARIANTS[variant],
        ]
        launcher = [*torchrun(2), os.path.abspath(__file__), "--as-rank", variant]
        env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
        run("pretrain_fsdp.py", args, timeout=3600, extra_env=env, launcher=launcher)
        records = read_metrics(run_dir)
    step = steady_step(records)
    final = next(r for r in records if r.get("event") == "final")
    return {
        "ag_calls": steps(records)[-1]["all_gather_calls"],
        "ag_mb": steps(records)[-1]["all_gather_bytes"] / 1e6,
        "peak_gib": max(final["peak_mem_gib_per_rank"]),
        "tokens_per_s": step["tokens_per_s"],
    }


def main() -> None:
    if sys.argv[1:2] == ["--as-rank"]:
        return as_rank(sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="debug_tiny-sized, 1 repeat: checks that it runs")
    args = parser.parse_args()
    model, seq = MODEL, 512
    if args.tiny:
        model = dict(MODEL, vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        seq, args.steps, args.repeats = 64, 3, 1
    overrides = [
        f"model.config={json.dumps(model)}",
        f"data.seq_len={seq}",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
    ]
    runs = {variant: [] for variant in VARIANTS}
    for _ in range(args.repeats):  # alternate, so drift on a noisy machine hits every row alike
        for variant in VARIANTS:
            runs[variant].append(measure(variant, overrides, args.steps))
    print(
        "| 2 gloo ranks | all-gathers / step | all-gather MB / step | peak RSS GiB / rank | vs first "
        "| tokens/s (median) | vs first |\n|---|---|---|---|---|---|---|"
    )
    base = None
    for variant, rs in runs.items():
        row = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        base = base or row
        print(
            f"| {variant} | {row['ag_calls']:.0f} | {row['ag_mb']:.1f} | {row['peak_gib']:.3f} | "
            f"{row['peak_gib'] / base['peak_gib']:.2f} | {row['tokens_per_s']:,.0f} | "
            f"{row['tokens_per_s'] / base['tokens_per_s']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
