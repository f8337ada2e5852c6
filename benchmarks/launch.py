"""Run a training script under torchrun and return its metrics.jsonl records (for the benchmarks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "debug_tiny.json")


def run_recipe(
    world: int,
    overrides: list[str],
    extra_env: dict | None = None,
    script: str = "pretrain_fsdp.py",
    config: str = TINY,
) -> list[dict]:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world}",
            os.path.join(REPO, "scripts", script),
            "--config",
            config,
            f"checkpoint.dir={run_dir}",
            "checkpoint.export=false",
            "metrics.tensorboard=false",
            *overrides,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **(extra_env or {}))
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


def tiny() -> bool:
    """`--tiny` on a benchmark's command line: the smallest sizes, so the test suite checks it still runs
    (its numbers then mean nothing)."""
    return "--tiny" in sys.argv[1:]


def steady_step(records: list[dict]) -> dict:
    """The median step by tokens/s, leaving out the first two (allocator and, with compile, tracing)."""
    steps = sorted(
        (r for r in records if "step" in r and "event" not in r and r["step"] > 2),
        key=lambda r: r["tokens_per_s"],
    )
    return steps[len(steps) // 2]


def last_step(records: list[dict]) -> dict:
    return [r for r in records if "step" in r and "event" not in r][-1]


def final(records: list[dict]) -> dict:
    return next(r for r in records if r.get("event") == "final")
