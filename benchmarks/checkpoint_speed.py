"""Resume-checkpoint save and load throughput against the raw sequential write speed of the same disk.

    torchrun --nproc_per_node 2 benchmarks/checkpoint_speed.py [--dir /tmp/ckpt-bench] [--repeats 3] [--tiny]

A Llama of about 270M parameters is sharded with the recipe's own apply_fsdp; each repeat saves and loads
a full resume checkpoint (model + AdamW state = 3x the fp32 parameter bytes) with common/checkpoint.py,
and writes the same number of bytes with plain file I/O (each rank its share, fsync'd) as the baseline.
Save includes everything a training run pays: state dict, DCP write + fsync, the rename, and deleting the
previous checkpoint (keep_latest=1). Load reads what the page cache still holds, as a restart right after
a save on the same node would.
Prints a markdown table of MB/s (min / median / max over repeats) and the ratio to raw, and what the
checkpoint's manifest (every file's XXH3 checksum, common/manifest.py) costs of a save.

Then the training stall: --steps training steps with a checkpoint every --every steps, written
synchronously (save_checkpoint) or in the background (checkpoint.async_save: BackgroundSaves.start,
completed by finish_if_written as training does), against the same steps with no checkpoint. Prints the time
training waited per checkpoint (median) and steps/s, with the ratios to sync and to no checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from transformers import LlamaConfig

from common import manifest
from common.checkpoint import load_checkpoint, save_checkpoint
from common.config import FsdpConfig, ModelConfig
from common.mesh import build_dp_mesh, init_distributed
from common.model import build_meta_model, init_weights
from common.ops.async_save import BackgroundSaves
from common.ops.metrics import MetricsLogger
from common.wrap import apply_fsdp


def raw_write(path: str, num_bytes: int) -> None:
    chunk = os.urandom(1 << 20) * 64  # 64 MiB of incompressible data
    with open(path, "wb") as f:
        written = 0
        while written < num_bytes:
            n = min(len(chunk), num_bytes - written)
            f.write(chunk[:n])
            written += n
        f.flush()
        os.fsync(f.fileno())


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def train_with_checkpoints(model, optimizer, run_dir: str, mode: str, steps: int, every: int) -> tuple:
    """(seconds training waited per checkpoint, steps/s) for mode none | sync | async."""
    tokens = torch.zeros(1, 64, dtype=torch.long, device=next(model.parameters()).device)
    stalls = []
    dist.barrier()
    start = time.perf_counter()
    with BackgroundSaves(MetricsLogger(None, enabled=False)) as background:  # logs nothing
        for step in range(1, steps + 1):
            model(input_ids=tokens).logits.float().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            background.finish_if_written()
            if mode == "none" or step % every:
                continue
            waited = time.perf_counter()
            state = {"step": step, "samples": 0, "scheduler": {}, "data": []}
            if mode == "sync":
                save_checkpoint(run_dir, step, model, optimizer, state, 1)
            else:  # one write at a time, as training does
                background.start(run_dir, step, model, optimizer, state, 1)
            stalls.append(time.perf_counter() - waited)
    dist.barrier()
    return stalls, steps / (time.perf_counter() - start)


def print_stall_table(model, optimizer, args, ranks: int) -> None:
    results = {
        mode: train_with_checkpoints(
            model, optimizer, os.path.join(args.dir, mode), mode, args.steps, args.every
        )
        for mode in ("none", "sync", "async")
    }
    if dist.get_rank() != 0:
        return
    print(f"\n{args.steps} training steps, a checkpoint every {args.every}, {ranks} ranks\n")
    print(
        "| checkpoints | training waits per checkpoint, s (median) | vs sync | steps/s | vs no checkpoints |"
    )
    print("|---|---|---|---|---|")
    sync_stall, free_rate = statistics.median(results["sync"][0]), results["none"][1]
    for mode, (stalls, rate) in results.items():
        stall = statistics.median(stalls) if stalls else 0.0
        print(f"| {mode} | {stall:.3f} | {stall / sync_stall:.2f} | {rate:.3f} | {rate / free_rate:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/fsdp2-recipes-ckpt-bench")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=12, help="training steps of the stall measurement")
    parser.add_argument("--every", type=int, default=3, help="a checkpoint every this many steps")
    parser.add_argument(
        "--tiny", action="store_true", help="a 1-layer, narrow model: checks that the benchmark runs"
    )
    args = parser.parse_args()
    d = init_distributed("auto", 10)
    width = 64 if args.tiny else 1024
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=1 if args.tiny else args.layers,
        num_attention_heads=16,
        num_key_value_heads=16,
    )
    model = build_meta_model(config, ModelConfig())
    apply_fsdp(model, build_dp_mesh(d.device.type, 1, d.world_size), FsdpConfig(), d.device.type)
    model.to_empty(device=d.device)
    init_weights(model, 0, 0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=d.device)).logits.sum().backward()
    optimizer.step()  # a training run's optimizer already has its state when it checkpoints
    optimizer.zero_grad()
    params = sum(p.numel() for p in model.parameters())
    ckpt_bytes = 3 * 4 * params  # fp32 weights + AdamW exp_avg + exp_avg_sq
    run_dir = os.path.join(args.dir, "run")
    raw_dir = os.path.join(args.dir, "raw")
    if d.is_main:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(raw_dir)
    dist.barrier()

    results = {"save": [], "load": [], "raw write": []}
    checksum_seconds = []  # seconds each save spends on its manifest: every rank's checksums of its own files
    for repeat in range(args.repeats):
        state = {"step": repeat, "samples": 0, "scheduler": scheduler.state_dict(), "data": []}
        results["save"].append(
            timed(lambda: save_checkpoint(run_dir, repeat + 1, model, optimizer, state, 1))
        )
        path = os.path.join(run_dir, "checkpoints", f"step-{repeat + 1}")
        own = [n for n in os.listdir(path) if n.startswith(f"__{d.rank}_")]
        checksum_seconds.append(
            timed(lambda: manifest.file_entries(path, own))
        )  # as complete_save does, again
        results["load"].append(timed(lambda: load_checkpoint(path, model, optimizer, scheduler)))
        share = ckpt_bytes // d.world_size
        results["raw write"].append(
            timed(lambda: raw_write(os.path.join(raw_dir, f"rank{d.rank}.bin"), share))
        )

    if d.is_main:
        mb = ckpt_bytes / 1e6
        raw_median = mb / statistics.median(results["raw write"])
        print(
            f"\n{params / 1e6:.0f}M parameters, {mb:.0f} MB per checkpoint, {d.world_size} ranks, "
            f"{args.repeats} repeats, {args.dir}\n"
        )
        print("| operation | MB/s min | MB/s median | MB/s max | median / raw write |")
        print("|---|---|---|---|---|")
        for name, seconds in results.items():
            rates = sorted(mb / s for s in seconds)
            print(
                f"| {name} | {rates[0]:,.0f} | {statistics.median(rates):,.0f} | {rates[-1]:,.0f} | "
                f"{statistics.median(rates) / raw_median:.2f} |"
            )
        save, sums = statistics.median(results["save"]), statistics.median(checksum_seconds)
        print(
            f"\nThe manifest's checksums (each rank its own files, in parallel): {sums:.3f} s of a "
            f"{save:.3f} s save, {sums / save:.1%} (medians; the save includes them)"
        )
    print_stall_table(model, optimizer, args, d.world_size)
    if d.is_main:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
