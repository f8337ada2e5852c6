"""This machine's limits, and how close pretrain_fsdp.py gets to them, measured in one run.

    python benchmarks/roofline.py [--steps 8] [--layers 12] [--micro-batch 2] [--extra key=value ...] [--bf16]
                                [--tiny]

1. Roofline. Matmul peak: n x n torch.mm on one CPU thread (what each OMP_NUM_THREADS=1 rank gets), fp32 and
   bf16, 5 timed calls per size after a warm-up, into a preallocated output; alone, and on both cores at once
   (2 processes, as the 2 training ranks run). MFU's peak is the best sample with both cores busy, of the
   run's dtype (--bf16: bf16 parameters, fp32 reduction); on a GPU, bf16. Collective bandwidth: all-gather
   and reduce-scatter of a 64 MiB tensor between 2 ranks (gloo on CPU, NCCL on GPUs), in bytes of the full
   tensor per second, the unit in which metrics.comm_stats counts FSDP's traffic.
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


def matmul_flops(
    device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...], repeats: int
) -> list[float]:
    """FLOP/s of `repeats` timed n x n matmuls per size, each after an untimed one (first touch of the
    output, kernel choice) and into a preallocated output, as a training step's steady state is."""
    samples = []
    for n in sizes:
        a, b, out = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))
        torch.mm(a, b, out=out)
        calls = max(1, int(2e10 // (2 * n**3)))  # about 20 GFLOP per sample
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                torch.mm(a, b, out=out)
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(calls * 2 * n**3 / (time.perf_counter() - start))
    return samples


def peak_plan(device: torch.device, tiny: bool) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    if tiny:
        return [(torch.float32, (128,))]
    if device.type == "cuda":
        return [(torch.bfloat16, (4096, 8192))]
    return [(torch.float32, (1024, 2048, 3072)), (torch.bfloat16, (1024, 2048, 3072))]


def matmul_peaks_busy(tiny: bool) -> None:
    """Under torchrun: every rank measures at once, one thread each, as the training ranks share the cores;
    rank 0 prints every rank's samples (JSON)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {}
    for dtype, sizes in peak_plan(torch.device("cpu"), tiny):
        dist.barrier()
        mine = matmul_flops(torch.device("cpu"), dtype, sizes, 1 if tiny else 5)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results[str(dtype).removeprefix("torch.")] = [x for rank in every for x in rank]
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


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


def on_two_ranks(flag: str, tiny: bool) -> dict:
    """Run this file with `flag` on 2 ranks; rank 0's JSON line."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        os.path.abspath(__file__),
        flag,
        *(["--tiny"] if tiny else []),
    ]
    out = run_command(cmd, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(samples: list[float]) -> str:
    ordered = sorted(samples)
    return " / ".join(f"{x / 1e9:,.1f}" for x in (ordered[0], ordered[len(ordered) // 2], ordered[-1]))


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
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 reduction; the bf16 peak")
    parser.add_argument("--tiny", action="store_true", help="small sizes: checks that the benchmark runs")
    parser.add_argument("--collectives", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--matmuls", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collectives:
        return collective_bandwidth(2**16 if args.tiny else COLLECTIVE_BYTES)
    if args.matmuls:
        return matmul_peaks_busy(args.tiny)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)
    repeats = 1 if args.tiny else 5
    plan = peak_plan(device, args.tiny)
    alone = {str(dtype).removeprefix("torch."): matmul_flops(device, dtype, n, repeats) for dtype, n in plan}
    busy = on_two_ranks("--matmuls", args.tiny) if device.type == "cpu" else alone
    print(
        "| n x n torch.mm, 1 thread per core | sizes | alone: min / median / best GFLOP/s "
        "| both cores busy: min / median / best |\n|---|---|---|---|"
    )
    for dtype, sizes in plan:
        name = str(dtype).removeprefix("torch.")
        print(f"| {name} | {', '.join(map(str, sizes))} | {spread(alone[name])} | {spread(busy[name])} |")
    # MFU's denominator: the best a core did while the other was busy too, as in training.
    dtype = "bfloat16" if args.bf16 or device.type == "cuda" else "float32"
    peak = max(busy.get(dtype) or busy["float32"])
    bandwidth = on_two_ranks("--collectives", args.tiny)
    print(
        "\n| matmul peak per " + ("GPU" if device.type == "cuda" else "core") + f" ({dtype}) "
        "| all-gather GB/s | reduce-scatter GB/s |\n|---|---|---|"
    )
    print(
        f"| {peak / 1e9:,.1f} GFLOP/s | {bandwidth['all_gather'] / 1e9:.2f} | "
        f"{bandwidth['reduce_scatter'] / 1e9:.2f} |\n",
        flush=True,
    )
    if args.bf16:
        args.extra = [
            *args.extra,
            'fsdp.mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"}',
        ]

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
    setting = " ".join([f"micro-batch {args.micro_batch}", *(["bf16"] if args.bf16 else []), *args.extra])
    print(
        f"| {setting} | {ready['params'] / 1e6:.0f}M | {step2['tokens_per_s']:,.0f} | "
        f"{step2['mfu']:.1%} | {step_time:.2f} | {compute_time:.2f} | {step_time / compute_time:.2f} | "
        f"{comm_time:.2f} |"
    )


if __name__ == "__main__":
    main()
