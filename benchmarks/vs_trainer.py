"""pretrain_fsdp.py against the Transformers Trainer + Accelerate FSDP2, side by side on 2 gloo ranks on CPU.

    python benchmarks/vs_trainer.py [--repeats 3] [--steps 30] [--tiny]

Both train the same Llama (hidden 512, MLP 1536, 8 layers, 8 heads, vocab 4096: 34M parameters, seq 512) on
the same rows of the embedded corpus, with the same global batch (8 sequences: 2 ranks x micro-batch 2 x 2
accumulation steps), AdamW settings, schedule, clipping and number of steps (benchmarks/trainer_baseline.py
says how, and what it took to make the Trainer really run FSDP2 on CPU; it checks that it did). Two
comparisons: both at their defaults, and both at their best documented settings for this model and machine
(ours: per-layer torch.compile; the Trainer: torch_compile=True). Runs alternate ours / Trainer, `--repeats`
times each. Tokens/s is over the steps after the first 5 (start-up and compilation left out); peak RSS is per
rank during training (after the model is built), the larger rank. Prints min / median / max and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

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
SEQ, GLOBAL, MICRO, WARMUP_STEPS = 512, 8, 2, 5
DATA_BYTES = 4_000_000  # enough embedded-corpus rows that no sample repeats


def ours(steps: int, best: bool, model: dict, seq: int) -> dict:
    overrides = [
        f"model.config={json.dumps(model)}",
        f"data.seq_len={seq}",
        f"data.embedded_max_bytes={DATA_BYTES}",
        f"train.steps={steps}",
        f"train.global_batch_size={GLOBAL}",
        f"train.micro_batch_size={MICRO}",
        "train.warmup_steps=2",
        *(["train.compile=true"] if best else []),
    ]
    records = run_recipe(2, overrides)
    timed = [r for r in records if "step" in r and "event" not in r and r["step"] > WARMUP_STEPS]
    final = next(r for r in records if r.get("event") == "final")
    return {
        "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["tokens"] / r["tokens_per_s"] for r in timed),
        "peak_rss_gib": max(final["peak_mem_gib_per_rank"]),
        "final_loss": timed[-1]["loss"],
    }


def trainer(steps: int, best: bool, model: dict, seq: int) -> dict:
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
            f"--global-batch-size={GLOBAL}",
            f"--micro-batch-size={MICRO}",
            "--warmup-steps=2",
            f"--timing-warmup={WARMUP_STEPS}",
            f"--out={out}",
            *(["--best"] if best else []),
        ]
        run_command(cmd, timeout=3600)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="debug_tiny-sized, 1 repeat: checks that it runs")
    args = parser.parse_args()
    model, seq = MODEL, SEQ
    if args.tiny:
        model = dict(
            MODEL,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
        seq, args.repeats, args.steps = 64, 1, WARMUP_STEPS + 2
    print(
        "| comparison | recipe | tokens/s min / median / max | peak RSS GiB / rank (median) | final loss | "
        "tokens/s vs Trainer | memory vs Trainer |\n|---|---|---|---|---|---|---|"
    )
    for best in (False,) if args.tiny else (False, True):
        runs = {"ours": [], "Trainer": []}
        for _ in range(args.repeats):  # alternate, so drift on a noisy machine hits both alike
            runs["ours"].append(ours(args.steps, best, model, seq))
            runs["Trainer"].append(trainer(args.steps, best, model, seq))
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


if __name__ == "__main__":
    main()
