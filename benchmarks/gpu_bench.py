"""One prepared run for a single-GPU machine: a smoke test of every script, then tokens/s and MFU.

    bash benchmarks/gpu_bench.sh [OUT_DIR]          # on the GPU machine (no network needed), under 10 minutes
    python benchmarks/gpu_bench.py OUT_DIR --tiny   # the same logic on CPU, tiny sizes (the suite's smoke)

Smoke: pretrain_fsdp.py (debug_tiny, NCCL, bf16 parameters by default on CUDA) with a FULL export;
eval_cp.py on that export through both attention paths (torch's context_parallel and the all-gather one) at
cp 1, which must agree; finetune_moe_ep_fsdp.py (debug_moe). tpu_xla_fsdp.py needs torch_xla, so it is not
part of a GPU run. Speed: pretrain_fsdp.py on a Llama-shaped 1.2B model (hidden 2048, MLP 8192, 16 layers, 32
heads / 8 K/V heads, vocab 128256, seq 4096, 4 sequences per step; bf16 parameters, fp32 reduction), compile
and activation checkpointing on and off. MFU is against the datasheet bf16 peak (common/ops/metrics.py) with
flops_per_token = 6 N + 12 L H S. Writes OUT_DIR/gpu_bench.json (one record) and OUT_DIR/gpu_bench.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.launch import REPO, steady_step

LLAMA_1B = [
    "model.config.hidden_size=2048",
    "model.config.intermediate_size=8192",
    "model.config.num_hidden_layers=16",
    "model.config.num_attention_heads=32",
    "model.config.num_key_value_heads=8",
    "model.config.vocab_size=128256",
    "model.config.max_position_embeddings=4096",
    "data.seq_len=4096",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.steps=20",
    "train.warmup_steps=2",
    "checkpoint.export=false",
    "checkpoint.interval=0",
    "metrics.log_every=1",
]
TINY_SPEED = ["train.steps=4", "checkpoint.export=false", "checkpoint.interval=0"]
VARIANTS = {
    "eager": [],
    "compile": ["train.compile=true"],
    "eager + AC": ["fsdp.activation_checkpointing=true"],
    "compile + AC": ["train.compile=true", "fsdp.activation_checkpointing=true"],
}


def script(name: str, config: str, run_dir: str, *overrides: str, device: str) -> list[dict]:
    """Run one recipe on one device (torchrun, 1 process) and return its metrics records."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        os.path.join(REPO, "scripts", name),
        "--config",
        os.path.join(REPO, "configs", config),
        f"checkpoint.dir={run_dir}",
        f"train.device={device}",
        "metrics.tensorboard=false",
        *overrides,
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    path = os.path.join(run_dir, "eval_results.json" if name == "eval_cp.py" else "metrics.jsonl")
    with open(path) as f:
        return [json.load(f)] if name == "eval_cp.py" else [json.loads(line) for line in f]


def smoke(out: str, device: str) -> dict:
    results, start = {}, time.perf_counter()
    train = script(
        "pretrain_fsdp.py", "debug_tiny.json", f"{out}/smoke_pretrain", "train.steps=5", device=device
    )
    results["pretrain_fsdp.py final loss"] = [r for r in train if "loss" in r][-1]["loss"]
    export = f"{out}/smoke_pretrain/export"
    paths = ["allgather", "torch_cp"] if device == "cuda" else ["allgather"]  # torch's CP needs CUDA kernels
    for attention in paths:
        result = script(
            "eval_cp.py",
            "debug_eval_cp.json",
            f"{out}/smoke_eval_{attention}",
            f"model.name_or_path={export}",
            "data.seq_len=256",
            "parallelism.cp_size=1",
            f"eval.attention={attention}",
            device=device,
        )[0]
        results[f"eval_cp.py eval_loss ({attention})"] = result["eval_loss"]
    moe = script(
        "finetune_moe_ep_fsdp.py", "debug_moe.json", f"{out}/smoke_moe", "train.steps=5", device=device
    )
    results["finetune_moe_ep_fsdp.py final loss"] = [r for r in moe if "loss" in r][-1]["loss"]
    losses = [v for k, v in results.items() if "eval_loss" in k]
    if max(losses) - min(losses) > 1e-2:  # bf16 exports: the two attention kernels round differently
        raise RuntimeError(f"the eval_cp.py attention paths disagree: {results}")
    results["seconds"] = round(time.perf_counter() - start, 1)
    return results


def speed(out: str, device: str, tiny: bool) -> list[dict]:
    rows = []
    for name, overrides in list(VARIANTS.items())[: 1 if tiny else None]:
        config, sizes = ("debug_tiny.json", TINY_SPEED) if tiny else ("debug_llama.json", LLAMA_1B)
        records = script(
            "pretrain_fsdp.py", config, f"{out}/speed_{len(rows)}", *sizes, *overrides, device=device
        )
        median = steady_step(records)
        ready = next(r for r in records if r.get("event") == "model_ready")
        rows.append(
            {
                "variant": name,
                "params": ready["params"],
                "overrides": overrides,
                "tokens_per_s": median["tokens_per_s"],
                "mfu": median["mfu"],
                "peak_mem_gib": max(r["peak_mem_gib"] for r in records if "peak_mem_gib" in r),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="runs/gpu_bench")
    parser.add_argument(
        "--tiny", action="store_true", help="CPU and tiny sizes: checks this script, measures nothing"
    )
    args = parser.parse_args()
    import torch

    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible; run with --tiny to check the script on CPU")
    os.makedirs(args.out, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit.strip(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (--tiny)",
        "smoke": smoke(args.out, device),
        "speed": speed(args.out, device, args.tiny),
    }
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(record, f, indent=2)
    lines = [
        f"{record['gpu']}, torch {record['torch']}, commit {record['commit']}, {record['date']}",
        "",
        "| pretrain_fsdp.py, 1 GPU | params | tokens/s | MFU | peak memory GiB |",
        "|---|---|---|---|---|",
    ]
    for row in record["speed"]:
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        lines.append(
            f"| {row['variant']} | {row['params'] / 1e9:.2f}B | {row['tokens_per_s']:,.0f} | {mfu} | "
            f"{row['peak_mem_gib']:.1f} |"
        )
    table = "\n".join(lines)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write(table + "\n")
    print(json.dumps(record["smoke"]), table, sep="\n")


if __name__ == "__main__":
    main()
