"""Context parallelism on CPU: peak memory per rank and tokens/s for one long sequence at cp = 1, 2, 4.

    python benchmarks/cp_memory.py [--tiny]

A 4-layer Llama with Llama-like proportions (hidden 256, MLP 1024, 8 query heads sharing 2 K/V heads;
randomly initialised and exported by pretrain_fsdp.py with train.steps=0) scores one 16,384-token sequence
of the embedded corpus with scripts/eval_cp.py. cp=1 is the baseline. Activations are per local token, so
what evaluation adds on top of the memory held after loading (interpreter, torch, weights) should fall about
as 1/cp, except for the all-gathered K/V, which every rank holds in full. Peak RSS is per rank
(glibc told to return freed memory). Prints a markdown table.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.launch import REPO, TINY, run_command, tiny

MODEL = [
    "model.config.hidden_size=256",
    "model.config.intermediate_size=1024",
    "model.config.num_hidden_layers=4",
    "model.config.num_attention_heads=8",
    "model.config.num_key_value_heads=2",
    "model.config.max_position_embeddings=16384",
]
SEQ = 16384
if tiny():
    MODEL, SEQ = ["model.config.max_position_embeddings=256"], 256


def evaluate(export: str, cp: int, run_dir: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={cp}",
        os.path.join(REPO, "scripts", "eval_cp.py"),
        "--config",
        os.path.join(REPO, "configs", "debug_eval_cp.json"),
        f"model.name_or_path={export}",
        f"checkpoint.dir={run_dir}",
        f"data.seq_len={SEQ}",
        "eval.max_sequences=1",
        f"parallelism.cp_size={cp}",
        "data.embedded_max_bytes=1000000",
    ]
    run_command(cmd, timeout=3600, extra_env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    with open(os.path.join(run_dir, "eval_results.json")) as f:
        return json.load(f)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # A model to score: the from-scratch init of debug_tiny widened, exported without training.
        run_command(
            [
                sys.executable,
                os.path.join(REPO, "scripts", "pretrain_fsdp.py"),
                "--config",
                TINY,
                f"checkpoint.dir={tmp}/model",
                "train.steps=0",
                "data.seq_len=64",
                *MODEL,
            ],
            timeout=3600,
        )
        print(
            f"| cp (1 sequence of {SEQ:,} tokens) | peak RSS GiB / rank (max) "
            "| of which evaluation (peak - after load) "
            "| vs cp=1 | tokens/s | eval_loss |"
        )
        print("|---|---|---|---|---|---|")
        base = None
        for cp in (1, 2) if tiny() else (1, 2, 4):
            r = evaluate(f"{tmp}/model/export", cp, f"{tmp}/cp{cp}")
            peak = max(r["peak_mem_gib_per_rank"])
            used = max(p - a for p, a in zip(r["peak_mem_gib_per_rank"], r["mem_after_load_gib_per_rank"]))
            base = base or used
            print(
                f"| {cp} | {peak:.3f} | {used:.3f} | {used / base:.2f} | {r['tokens_per_s']:,.0f} | "
                f"{r['eval_loss']:.6f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
