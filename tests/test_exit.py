"""Leaving the process: gloo must not abort it after the work is done, and nothing written may be lost."""

import json
import os
import subprocess
import sys

from launch import REPO, TINY, env, read_metrics

# gloo work still in flight when the script returns, on tensors that Python held: the worker that frees
# such a work during interpreter finalization aborted the process about half the time (SIGABRT,
# "terminate called without an active exception") before common/ops/cli.end_process.
IN_FLIGHT = f"""
import sys
sys.path.insert(0, {REPO!r})
import torch, torch.distributed as dist
from common.ops.cli import run_cli
from common.mesh import init_distributed

def main(argv):
    init_distributed("cpu", 1)
    tensors = [torch.ones(1 << 18) for _ in range(500)]
    works = [dist.group.WORLD.allreduce([t]) for t in tensors]
    del works, tensors
    print("main returned", flush=True)

run_cli(main)
"""

# A script run whose interpreter finalization would print a line: end_process skips it.
FINALIZED = (
    "import atexit, runpy, sys; atexit.register(print, 'finalized'); sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_collectives_in_flight_at_exit_never_abort_the_process(tmp_path):
    script = tmp_path / "in_flight.py"
    script.write_text(IN_FLIGHT)
    for _ in range(6):  # an unguarded exit passes all six about once in 64 tries
        proc = subprocess.run(
            [sys.executable, str(script)], env=env(), capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "main returned", proc.stderr[-3000:]


def test_the_exit_that_skips_teardown_keeps_every_output(tmp_path):
    run_dir = tmp_path / "run"
    script = os.path.join(REPO, "scripts", "pretrain_fsdp.py")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            FINALIZED,
            script,
            "--config",
            TINY,
            f"checkpoint.dir={run_dir}",
            "train.steps=2",
        ],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finalized" not in proc.stdout  # the process did leave through end_process
    # What the run wrote last is there in full: the terminal's last line, the metrics log, the export.
    assert proc.stdout.splitlines()[-1].startswith("exported: path ")
    assert read_metrics(run_dir)[-1]["event"] == "exported"
    with open(run_dir / "export" / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 2
    assert (run_dir / "export" / "model.safetensors").stat().st_size > 1_000_000
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step-2"]
