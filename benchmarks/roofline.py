"""This machine's limits, and how close pretrain_fsdp.py gets to them, measured in one run.

    python benchmarks/roofline.py [--steps 8] [--layers 12] [--micro-batch 2] [--extra key=value ...] [--tiny]

1. Roofline. Matmul peak: the best of several large square torch.mm, fp32 on one CPU thread (what each
   OMP_NUM_THREADS=1 rank gets) or bf16 on a GPU. Collective bandwidth: all-gather and reduce-scatter of a
   64 MiB tensor between 2 ranks (gloo on CPU, NCCL on GPUs), in bytes of the full tensor per second, the unit
   in which metrics.comm_stats counts FSDP's traffic.
2. The recipe. pretrain_fsdp.py trains a ~100M-parameter Llama (hidden 768, MLP 3072, 12 layers, 12 heads,
   seq 512, vocab 32000) on 2 ranks, --micro-batch sequences per rank per step, with metrics.peak_flops set to
   the measured peak, so its MFU is against this machine: MFU = tokens/s x flops_per_token / (peak x ranks),
   flops_per_token = 6 N (N without the input embedding, a lookup) + 12 L H S (attention scores and values,
   forward and backward; causal masking not subtracted, as in PaLM and torchtitan). Communication: the bytes
   one step moves (comm_stats) / the measured bandwidth, against the step time; and the step time against a
   compute-only run (1 rank, the same per-rank batch, no collectives): <= 1.1x means communication is hidden.

Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from tests.launch import run_command, run_recipe, steady_step

COLLECTIVE_BYTES = 64 * 2**20


def matmul_peak(device: torch.device, tiny: bool = False) -> float:
    """FLOP/s of the best n x n matmul: fp32 on one CPU thread, bf16 on a GPU."""
    dtype, sizes = (
        (torch.bfloat16, (4096, 8192)) if device.type == "cuda" else (torch.float32, (512, 1024, 2048))
    )
    sizes = (256,) if tiny else sizes
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            repeats = 1 if tiny else max(1, int(2e10 // (2 * n**3)))
            for _ in range(repeats):
                torch.mm(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = max(best, repeats * 2 * n**3 / (time.perf_counter() - start))
    return best


def collective_bandwidth(num_bytes: int) -> None:
    """Under torchrun: time all-gather and reduce-scatter; rank 0 prints the full tensor's bytes/s (JSON)."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    world = dist.get_world_size()
    full = torch.ones(num_bytes // 4, device=device)
    shard = torch.ones(num_bytes // 4 // world, device=device)
    results = {}
    for name, call in [
        ("all_gather", lambda: dist.all_gather_into_tensor(full, shard)),
        ("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, full)),
    ]:
        call()  # connection set-up
        times = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            call()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        results[name] = num_bytes / sorted(times)[len(times) // 2]
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


def measure_bandwidth(world: int, tiny: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        os.path.abspath(__file__),
        "--collectives",
        *(["--tiny"] if tiny else []),
    ]
    out = run_command(cmd, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument(
        "--micro-batch", type=int, default=2, help="sequences per rank per step (one micro-batch)"
    )
    parser.add_argument(
        "--extra", nargs="*", default=[], help="more pretrain_fsdp.py overrides, e.g. train.compile=true"
    )
    parser.add_argument("--tiny", action="store_true", help="small sizes: checks that the benchmark runs")
    parser.add_argument("--collectives", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collectives:
        return collective_bandwidth(2**16 if args.tiny else COLLECTIVE_BYTES)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)
    peak = matmul_peak(device, args.tiny)
    bandwidth = measure_bandwidth(2, args.tiny)
    unit = "GPU (bf16)" if device.type == "cuda" else "core (fp32, 1 thread)"
    print("| matmul peak per " + unit + " | all-gather GB/s | reduce-scatter GB/s |\n|---|---|---|")
    print(
        f"| {peak / 1e9:,.1f} GFLOP/s | {bandwidth['all_gather'] / 1e9:.2f} | "
        f"{bandwidth['reduce_scatter'] / 1e9:.2f} |\n",
        flush=True,
    )

    model = [
        "model.config.hidden_size=768",
        "model.config.intermediate_size=3072",
        f"model.config.num_hidden_layers={args.layers}",
        "model.config.num_attention_heads=12",
        "model.config.num_key_value_heads=12",
        "model.config.vocab_size=32000",
        "model.config.max_position_embeddings=512",
        "data.seq_len=512",
        "data.embedded_max_bytes=4000000",
    ]
    if args.tiny:
        model, args.steps = [], 4
    model += [
        f"train.steps={args.steps}",
        "train.warmup_steps=1",
        "metrics.comm_stats=true",
        f"metrics.peak_flops={peak}",
        *args.extra,
    ]
    per_rank = [f"train.micro_batch_size={args.micro_batch}"]
    two = run_recipe(2, [*model, *per_rank, f"train.global_batch_size={2 * args.micro_batch}"])
    # rank 0's share, alone
    one = run_recipe(1, [*model, *per_rank, f"train.global_batch_size={args.micro_batch}"])
    ready = next(r for r in two if r.get("event") == "model_ready")
    step2, step1 = steady_step(two), steady_step(one)
    step_time = step2["tokens"] / step2["tokens_per_s"]
    compute_time = step1["tokens"] / step1["tokens_per_s"]
    comm_time = (
        step2["all_gather_bytes"] / bandwidth["all_gather"]
        + step2["reduce_scatter_bytes"] / bandwidth["reduce_scatter"]
    )
    print(
        "| ~100M Llama, 2 ranks | params | tokens/s | MFU vs measured peak | step s "
        "| compute-only step s (1 rank) "
        "| step / compute-only | comm bytes / bandwidth, s |\n|---|---|---|---|---|---|---|---|"
    )
    setting = " ".join([f"micro-batch {args.micro_batch}", *args.extra])
    print(
        f"| {setting} | {ready['params'] / 1e6:.0f}M | {step2['tokens_per_s']:,.0f} | "
        f"{step2['mfu']:.1%} | {step_time:.2f} | {compute_time:.2f} | {step_time / compute_time:.2f} | "
        f"{comm_time:.2f} |"
    )


if __name__ == "__main__":
    main()
