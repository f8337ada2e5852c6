"""Expert parallelism on CPU: tokens/s and memory per rank for ep = 1, 2, 4 at a fixed world size of 4.

    python benchmarks/moe_ep.py [--tiny]

A 28M-parameter Qwen3-MoE with 16 experts (90% of the weights), fine-tuned for 8 steps on the
generated arithmetic task by scripts/finetune_moe_ep_fsdp.py. ep=1 is plain FSDP2 (experts all-gathered
with their layer), the baseline for the ratios; ep=4 keeps whole experts on their rank (efsdp=1) and
moves tokens by all-to-all instead. Throughput is the median over steps 3-8; peak RSS is per rank
during training (glibc told to return freed memory). Prints a markdown table.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.launch import REPO, final, run_recipe, tiny

MODEL = [
    "model.config.hidden_size=256",
    "model.config.moe_intermediate_size=512",
    "model.config.num_experts=16",
    "model.config.num_hidden_layers=4",
    "model.config.num_attention_heads=8",
    "model.config.num_key_value_heads=4",
    "model.config.head_dim=32",
    "data.seq_len=256",
    "train.steps=8",
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
    "metrics.log_every=1",
    "data.eval_dataset=null",
    "eval.interval=0",
    "metrics.comm_stats=true",
]
MOE = os.path.join(REPO, "configs", "debug_moe.json")
MIB = 2**20
if tiny():
    MODEL = [
        "train.steps=4",
        "metrics.log_every=1",
        "data.eval_dataset=null",
        "eval.interval=0",
        "metrics.comm_stats=true",
    ]


def main() -> None:
    print(
        "| ep (world 4) | efsdp | tokens/s | vs ep=1 | peak RSS GiB / rank (max) | params+AdamW MiB / rank | "
        "FSDP all-gather MiB / step |"
    )
    print("|---|---|---|---|---|---|---|")
    base = None
    for ep in (1, 2) if tiny() else (1, 2, 4):
        records = run_recipe(
            4,
            MODEL + [f"parallelism.ep_size={ep}"],
            {"MALLOC_MMAP_THRESHOLD_": "131072"},
            script="finetune_moe_ep_fsdp.py",
            config=MOE,
        )
        steps = [r for r in records if "step" in r and "event" not in r]
        tps = statistics.median(r["tokens_per_s"] for r in steps[2:])
        base = base or tps
        end = final(records)
        state = end["state_bytes_per_rank"][0]
        gathered = statistics.median(r["all_gather_bytes"] for r in steps[2:])
        print(
            f"| {ep} | {4 // ep} | {tps:,.0f} | {tps / base:.2f}x "
            f"| {max(end['peak_mem_gib_per_rank']):.3f} | "
            f"{(state['param_bytes'] + state['optimizer_bytes']) / MIB:.1f} | {gathered / MIB:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
