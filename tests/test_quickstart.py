"""The README's quickstart command, run exactly as written (plus a run directory), trains: the loss falls."""

import os
import re
import shlex
import subprocess

import pytest

from launch import REPO, env, free_port, losses, read_metrics


def quickstart_command() -> list[str]:
    readme = open(os.path.join(REPO, "README.md")).read()
    line = re.search(r"^pip install -r requirements.txt && (torchrun .*)$", readme, re.M)
    assert line, "README.md lost its quickstart line"
    return shlex.split(line.group(1))


@pytest.mark.slow
def test_readme_quickstart_trains_and_the_loss_falls(tmp_path):
    cmd = quickstart_command()
    assert cmd[:3] == ["torchrun", "--nproc_per_node", "2"]
    subprocess.run(
        [*cmd, f"checkpoint.dir={tmp_path}", "metrics.log_every=1"],
        cwd=REPO,
        env=env(PET_MASTER_PORT=str(free_port())),
        check=True,
        timeout=600,
        capture_output=True,
    )
    curve = losses(read_metrics(tmp_path))
    assert len(curve) == 60 and curve[0] > 8.0, curve  # starts at about ln(vocab) = 8.3
    assert max(curve[-5:]) < curve[0] - 1.5, curve
    assert os.path.exists(tmp_path / "export" / "model.safetensors")
