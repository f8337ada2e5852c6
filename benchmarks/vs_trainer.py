"""pretrain_fsdp.py against the Transformers Trainer + Accelerate FSDP2, side by side on 2 gloo ranks on CPU.

    python benchmarks/vs_trainer.py [--repeats 3] [--steps 30] [--vocab 4096] [--seq 512] [--global-batch 8]
                                    [--micro-batch 2] [--budget-gib 0] [--lora R] [--tiny]

Both train the same Llama body (hidden 512, MLP 1536, 8 layers, 8 heads: 27M parameters) with a `--vocab`
output layer, at `--seq`, on the same rows of the embedded corpus, with the same global batch (2 ranks x
`--micro-batch` x accumulation), AdamW settings, schedule, clipping and number of steps
(benchmarks/trainer_baseline.py says how, and what it took to make the Trainer really run FSDP2 on CPU; it
checks that it did). Two comparisons: both at their defaults, and both at their best documented settings
for this model and machine (ours: per-layer torch.compile with 512-token loss chunks; the Trainer:
torch_compile=True). Runs alternate
ours / Trainer, `--repeats` times each. Tokens/s is over the steps after the first 5 (start-up and
compilation left out); peak RSS is per rank during training (after the model is built), the larger rank,
with glibc returning large blocks (MALLOC_MMAP_THRESHOLD_) so the peak is what was live. Prints min / median
/ max and the ratios.

`--budget-gib G` adds the largest micro-batch (1, 2, 4, ...; one micro-batch per step, 2 steps, defaults)
whose peak RSS per rank stays within G GiB, for each recipe. A size whose peak, extrapolated linearly from the
two before it, would pass G is not run, so the machine is never pushed past its memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.launch import REPO, run_command, run_recipe

MODEL = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
}
WARMUP_STEPS = 5
DATA_BYTES = 4_000_000  # enough embedded-corpus rows that no sample repeats
# Peak RSS then tracks live memory: glibc returns large freed blocks instead of keeping them.
ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def ours(steps: int, best: bool, model: dict, seq: int, batch: tuple[int, int], lora: int = 0) -> dict:
    """`lora` R > 0: rank-R adapters (alpha 2R) on every linear layer of a frozen base, as the Trainer's."""
    global_batch, micro = batch
    overrides = [
        *([f"lora.r={lora}", f"lora.alpha={2 * lora}"] if lora else []),
        f"model.config={json.dumps(model)}",
        f"data.seq_len={seq}",
        f"data.embedded_max_bytes={DATA_BYTES}",
        f"train.steps={steps}",
        f"train.global_batch_size={global_batch}",
        f"train.micro_batch_size={micro}",
        "train.warmup_steps=2",
        # 512-token chunks: compiled, as fast as our eager defaults, and a smaller peak (docs/performance.md).
        *(["train.compile=true", "train.loss_chunk_tokens=512"] if best else []),
    ]
    records = run_recipe(2, overrides, extra_env=ENV)
    timed = [
        r for r in records if "step" in r and "event" not in r and r["step"] > min(WARMUP_STEPS, steps - 1)
    ]
    final = next(r for r in records if r.get("event") == "final")
    return {
        "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["tokens"] / r["tokens_per_s"] for r in timed),
        "peak_rss_gib": max(final["peak_mem_gib_per_rank"]),
        "final_loss": timed[-1]["loss"],
    }


def trainer(steps: int, best: bool, model: dict, seq: int, batch: tuple[int, int], lora: int = 0) -> dict:
    global_batch, micro = batch
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            os.path.join(REPO, "benchmarks", "trainer_baseline.py"),
            "--model-config",
            json.dumps(model),
            f"--seq-len={seq}",
            f"--embedded-max-bytes={DATA_BYTES}",
            f"--steps={steps}",
            f"--global-batch-size={global_batch}",
            f"--micro-batch-size={micro}",
            "--warmup-steps=2",
            f"--timing-warmup={min(WARMUP_STEPS, steps - 1)}",
            f"--out={out}",
            *(["--best"] if best else []),
            *([f"--lora-r={lora}", f"--lora-alpha={2 * lora}"] if lora else []),
        ]
        run_command(cmd, timeout=3600, extra_env=ENV)
        with open(out) as f:
            result = json.load(f)
    assert result["fsdp2_verified"], "the Trainer did not run FSDP2"
    return {
        "tokens_per_s": result["tokens_per_s"],
        "peak_rss_gib": max(result["peak_rss_gib_per_rank"]),
        "final_loss": result["final_loss"],
    }


def spread(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def largest_micro_batch(recipe, model: dict, seq: int, budget_gib: float, most: int) -> tuple[int, dict]:
    """The largest power-of-2 micro-batch up to `most` whose peak RSS per rank stays within the budget, and
    every peak measured."""
    peaks, best = {}, 0
    micro = 1
    while micro <= most:
        if len(peaks) >= 2:
            (m0, p0), (m1, p1) = list(peaks.items())[-2:]
            if p1 + (p1 - p0) / (m1 - m0) * (micro - m1) > budget_gib:
                break  # extrapolated past the budget: not run
        peaks[micro] = recipe(2, False, model, seq, (2 * micro, micro))["peak_rss_gib"]
        if peaks[micro] > budget_gib:
            break
        best, micro = micro, 2 * micro
    return best, peaks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--repeats", type=int, default=3, help="0: only the largest micro-batch (--budget-gib)"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument(
        "--global-batch", type=int, default=8, help="sequences per step (2 ranks x micro-batch x k)"
    )
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per forward")
    parser.add_argument(
        "--budget-gib", type=float, default=0, help="also find the largest micro-batch within"
    )
    parser.add_argument("--tiny", action="store_true", help="debug_tiny-sized, 1 repeat: checks that it runs")
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        help="R > 0: both train rank-R LoRA adapters (alpha 2R) on a frozen base",
    )
    args = parser.parse_args()
    recipes = {"ours": partial(ours, lora=args.lora), "Trainer": partial(trainer, lora=args.lora)}
    model = dict(MODEL, vocab_size=args.vocab, max_position_embeddings=args.seq)
    seq, batch = args.seq, (args.global_batch, args.micro_batch)
    if args.tiny:
        model = dict(
            model,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
        seq, args.repeats, args.steps = 64, 1, WARMUP_STEPS + 2
        model["max_position_embeddings"] = seq
    lora = f", LoRA rank {args.lora} on every linear layer" if args.lora else ""
    print(
        f"vocabulary {model['vocab_size']:,}, seq {seq}, global batch {batch[0]}, "
        f"micro-batch {batch[1]}{lora}\n"
    )
    print(
        "| comparison | recipe | tokens/s min / median / max | peak RSS GiB / rank (median) | final loss | "
        "tokens/s vs Trainer | memory vs Trainer |\n|---|---|---|---|---|---|---|"
    )
    for best in () if not args.repeats else (False,) if args.tiny else (False, True):
        runs = {"ours": [], "Trainer": []}
        for _ in range(args.repeats):  # alternate, so drift on a noisy machine hits both alike
            for name, recipe in recipes.items():
                runs[name].append(recipe(args.steps, best, model, seq, batch))
        median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
        for name, rs in runs.items():
            speed = median[name]["tokens_per_s"] / median["Trainer"]["tokens_per_s"]
            memory = median[name]["peak_rss_gib"] / median["Trainer"]["peak_rss_gib"]
            print(
                f"| {'best' if best else 'defaults'} | {name} "
                f"| {spread([r['tokens_per_s'] for r in rs], ',.0f')} | "
                f"{median[name]['peak_rss_gib']:.3f} | {median[name]['final_loss']:.4f} | {speed:.2f}x | "
                f"{memory:.2f}x |",
                flush=True,
            )
    if args.budget_gib:
        print(
            f"\n| within {args.budget_gib:g} GiB per rank | largest micro-batch "
            "| peak RSS GiB / rank by micro-batch |"
        )
        print("|---|---|---|")
        for name, recipe in recipes.items():
            most = 1 if args.tiny else 256
            largest, peaks = largest_micro_batch(recipe, model, seq, args.budget_gib, most)
            measured = ", ".join(f"{m}: {p:.2f}" for m, p in peaks.items())
            print(f"| {name} | {largest} | {measured} |", flush=True)


if __name__ == "__main__":
    main()
