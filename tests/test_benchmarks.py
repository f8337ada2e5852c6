"""Every benchmark still runs and prints its table, at tiny sizes. Benchmarks are never timed in tests: the
numbers from a --tiny run mean nothing and are not checked."""

import os
import subprocess
import sys

import pytest

from launch import REPO, env, free_port


@pytest.mark.parametrize(
    "args",
    [
        ["comm_volume.py", "--tiny"],
        ["memory_scaling.py", "--tiny"],
        ["moe_ep.py", "--tiny"],
        ["cp_memory.py", "--tiny"],
        ["roofline.py", "--tiny"],
        ["loss_chunks.py", "--tiny"],
        ["vs_trainer.py", "--tiny", "--budget-gib", "8", "--lora", "4"],  # LoRA on both sides, and the search
        ["vlm_vs_trainer.py", "--tiny"],
        ["reshard_rule.py", "--tiny"],
        ["ac_policy.py", "--tiny"],
        ["weights_io.py", "--tiny"],
        ["export_write_once.py", "--tiny"],
        ["export_fsync.py", "--tiny"],
        ["loss_check_cost.py", "--steps", "2"],
        ["gpu_bench.py", "{tmp}", "--tiny"],
    ],
    ids=lambda args: args[0],
)
def test_benchmark_runs_and_prints_a_markdown_table(tmp_path, args):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", args[0]), *args[1:]],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "|---|" in proc.stdout


def test_checkpoint_speed_runs_under_torchrun(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(REPO, "benchmarks", "checkpoint_speed.py"),
        "--tiny",
        "--repeats=1",
        f"--dir={tmp_path}/ckpt",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| save |" in proc.stdout and "| load |" in proc.stdout
    assert "| sync |" in proc.stdout and "| async |" in proc.stdout
    assert "The manifest's checksums (each rank its own files, in parallel): " in proc.stdout
