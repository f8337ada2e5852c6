"""Memory: per-rank sharded state against world size, and peak memory with each memory-saving key.

    python benchmarks/memory_scaling.py [--tiny]

A 30M-parameter Llama (debug_tiny widened) trained for 2 steps by scripts/pretrain_fsdp.py. Part 1: the
parameter and AdamW bytes each rank holds (from its local shards) at 1, 2 and 4 ranks; FSDP should give
1/N (goal at N=4: <= 0.26x of N=1). Part 2: 2 ranks, peak RSS during training (VmHWM, reset after loading,
glibc told to return freed memory) with activation checkpointing, reshard_after_forward and cpu_offload
toggled one at a time. Prints markdown tables.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.launch import final, last_step, run_recipe, tiny

MODEL = [
    "model.config.hidden_size=512",
    "model.config.intermediate_size=1408",
    "model.config.num_hidden_layers=8",
    "model.config.num_attention_heads=8",
    "model.config.num_key_value_heads=8",
    "data.seq_len=256",
    "train.steps=2",
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
]
MIB = 2**20
if tiny():
    MODEL = ["train.steps=2", "train.global_batch_size=8", "train.micro_batch_size=2"]


def main() -> None:
    print("| ranks | params MiB / rank | AdamW state MiB / rank | total vs 1 rank |")
    print("|---|---|---|---|")
    base = None
    for world in (1, 2) if tiny() else (1, 2, 4):
        state = final(run_recipe(world, MODEL))["state_bytes_per_rank"][0]
        total = state["param_bytes"] + state["optimizer_bytes"]
        base = base or total
        print(
            f"| {world} | {state['param_bytes'] / MIB:.1f} | {state['optimizer_bytes'] / MIB:.1f} | "
            f"{total / base:.3f} |",
            flush=True,
        )

    print("\n| 2 ranks | peak RSS during training, GiB (rank 0) | vs default |")
    print("|---|---|---|")
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    default = None
    for name, overrides in [
        ("default (reshard, no AC, no offload)", []),
        ("activation_checkpointing=true", ["fsdp.activation_checkpointing=true"]),
        ("reshard_after_forward=false", ["fsdp.reshard_after_forward=false"]),
        ("cpu_offload=true", ["fsdp.cpu_offload=true"]),
    ][: 2 if tiny() else None]:
        peak = last_step(run_recipe(2, MODEL + overrides, env))["peak_mem_gib"]
        default = default or peak
        print(f"| {name} | {peak:.3f} | {peak / default:.2f} |", flush=True)


if __name__ == "__main__":
    main()
