"""Weights in and out: each rank reading and writing its share, against the path before it, in the same run.

    python benchmarks/weights_io.py [--tiny]

A 531M-parameter Llama in bf16 (1.0 GiB of safetensors) is loaded by scripts/pretrain_fsdp.py (train 0 steps)
on 1, 2 and 4 CPU ranks and exported FULL in fp32, split at 1GB, through tests/with_host_memory.py. "before"
is the path the recipe took before (WEIGHTS_IO=rank0: from_pretrained on every rank, the export gathered to
rank 0 and written by it alone); "shares" is today's. Page cache cold (the checkpoint's pages dropped with
posix_fadvise before the run) and warm (read once just before). Per rank: the rise of anonymous memory at
load and at export over the rank's share of the fp32 weights, the seconds each took, and the MiB the load
read (with read(), plus the pages of mapped files it touched: the rise of RssFile). Prints a markdown table.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.launch import host_memory_env, pretrain, save_release, tiny

SIZE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=10, num_attention_heads=16)
if tiny():
    SIZE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
MIB = 2**20


def write_checkpoint(path: str) -> tuple[int, int]:
    """The bf16 checkpoint; returns its parameter count and its largest tensor's fp32 bytes."""
    config = LlamaConfig(vocab_size=4096, num_key_value_heads=SIZE["num_attention_heads"], **SIZE)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    save_release(model, path)
    return sum(p.numel() for p in model.parameters()), max(p.numel() for p in model.parameters()) * 4


def drop_page_cache(path: str) -> None:
    """The checkpoint's clean pages out of the page cache, no root needed."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def warm_page_cache(path: str) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            while f.read(64 * MIB):
                pass


def measured(checkpoint: str, work: str, world: int, path: str, cache: str) -> list[dict]:
    """One run; each rank's load and export records."""
    run_dir, out = (
        os.path.join(work, f"{path}-{cache}-{world}"),
        os.path.join(work, f"mem-{path}-{cache}-{world}"),
    )
    if cache == "cold":
        drop_page_cache(checkpoint)
    else:
        warm_page_cache(checkpoint)
    pretrain(
        run_dir, "train.steps=0", f"model.name_or_path={checkpoint}", "model.config={}",
        "fsdp.state_dict_type=FULL_STATE_DICT", "checkpoint.max_shard_size=1GB",
        "checkpoint.export_dtype=float32",
        nproc=world, timeout=1800, wrapper="with_host_memory.py",
        extra_env={**host_memory_env(out), "WEIGHTS_IO": path},
    )  # fmt: skip
    records = []
    for rank in range(world):
        with open(f"{out}.load.rank{rank}.json") as f, open(f"{out}.export.rank{rank}.json") as g:
            records.append({"load": json.load(f), "export": json.load(g)})
    return records


def rise(record: dict, field: str = "RssAnon") -> float:
    return record["peak"][field] - record["before"][field]


def row(load: dict, export: dict, share: float) -> str:
    """share MiB | load: rise, over share, s, MiB read | export: rise, over share, s."""
    read = load["read_bytes"] / MIB + rise(load, "RssFile")
    return (
        f"{share:.0f} | {rise(load):.0f} | {rise(load) / share:.2f} | {load['seconds']:.1f} | {read:.0f} | "
        f"{rise(export):.0f} | {rise(export) / share:.2f} | {export['seconds']:.1f}"
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        checkpoint = os.path.join(work, "llama")
        params, largest = write_checkpoint(checkpoint)
        print(f"{params / 1e6:.0f}M parameters; largest tensor {largest / MIB:.0f} MiB in fp32\n")
        print(
            "| path | page cache | ranks | rank | share MiB | load: rise MiB | over share | load s | "
            "read MiB | export: rise MiB | over share | export s |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for cache in ("warm",) if tiny() else ("cold", "warm"):
            for world in (2,) if tiny() else (1, 2, 4):
                for path in ("before", "shares"):
                    runs = measured(checkpoint, work, world, "rank0" if path == "before" else path, cache)
                    for rank, r in enumerate(runs):
                        share = params * 4 / world / MIB
                        print(
                            f"| {path} | {cache} | {world} | {rank} | {row(r['load'], r['export'], share)} |"
                        )


if __name__ == "__main__":
    main()
