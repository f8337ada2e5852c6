"""What a person sees: short human lines on the terminal, JSON in metrics.jsonl, no library noise."""

import os
import subprocess
import sys

import pytest

from common.config import ConfigError, ModelConfig
from common.model import load_model_config
from common.ops.config_sources import load_config
from common.ops.metrics import event_line
from launch import REPO, TINY, read_metrics, run, steps


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("quiet")
    proc = run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={run_dir}", "train.steps=6", "metrics.log_every=5"],
        nproc=0,
    )
    return proc, read_metrics(run_dir), run_dir


def test_the_first_step_is_logged_whatever_log_every(quiet_run):
    _, records, _ = quiet_run
    assert [r["step"] for r in steps(records)] == [1, 5, 6]
    assert steps(records)[0]["loss"] > 8.0  # ln(4096) = 8.3 for an untrained model


def test_events_are_short_lines_on_the_terminal_and_json_in_the_log(quiet_run):
    proc, records, _ = quiet_run
    lines = proc.stdout.splitlines()
    ready = next(line for line in lines if line.startswith("model_ready: "))
    final = next(line for line in lines if line.startswith("final: "))
    assert "params 598,336, world_size 1, mesh {dp_shard 1}" in ready and "fsdp_units 5" in ready
    assert "fixed_batch_loss 8." in final and len(final.split("fixed_batch_loss ")[1]) <= 6  # 4 digits
    assert not any(line.startswith("{") for line in lines)
    assert {r.get("event") for r in records} >= {"model_ready", "final", "exported"}
    assert isinstance(next(r for r in records if r.get("event") == "final")["fixed_batch_loss"], float)


def test_no_progress_bars_or_deprecation_warnings_from_a_run(quiet_run):
    proc, _, _ = quiet_run
    for noise in ("Writing model shards", "Loading weights", "it/s]", "FutureWarning", "DeprecationWarning"):
        assert noise not in proc.stderr, proc.stderr[-2000:]


def test_help_shows_the_usage_examples_as_written():
    proc = run("pretrain_fsdp.py", ["--help"], nproc=0)
    assert (
        "\n    torchrun --nproc_per_node 8 scripts/pretrain_fsdp.py --config configs/llama.json"
        in proc.stdout
    )


def test_event_line_rounds_floats_and_folds_equal_ranks():
    line = event_line(
        {"event": "final", "loss": 2.718281828, "tokens": 12345, "peak_gib_per_rank": [0.5, 0.5]}
    )
    assert line == "final: loss 2.718, tokens 12,345, peak_gib_per_rank 0.5 (x2)"


def test_the_wrap_policy_error_lists_the_valid_values_once():
    with pytest.raises(ConfigError) as error:
        load_config(TINY, ["fsdp.auto_wrap_policy=EVERY_LAYER"])
    assert str(error.value).count("NO_WRAP") == 1 and "did you mean" not in str(error.value)
    with pytest.raises(ConfigError, match="did you mean 'NO_WRAP'"):
        load_config(TINY, ["fsdp.auto_wrap_policy=NO_WRAPP"])


def test_sequences_longer_than_the_model_positions_are_warned_about(capsys):
    cfg = ModelConfig(
        config={
            "vocab_size": 64,
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 512,
        }
    )
    load_model_config(cfg, 512)
    assert capsys.readouterr().err == ""
    load_model_config(cfg, 1024)
    assert "data.seq_len (1024) exceeds the model's max_position_embeddings (512)" in capsys.readouterr().err


def plot(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(REPO, "scripts", "plot_metrics.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_plot_metrics_writes_one_png_per_call_overlaying_runs(quiet_run, tmp_path):
    _, _, run_dir = quiet_run
    assert plot(str(run_dir)).returncode == 0
    overlay = tmp_path / "two_runs.png"
    assert plot(str(run_dir), str(run_dir), "--out", str(overlay)).returncode == 0
    for png in (run_dir / "metrics.png", overlay):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_plot_metrics_names_a_missing_or_empty_run_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"event": "model_ready"}\n')
    for run_dir, message in (
        (tmp_path / "missing", "has no metrics.jsonl"),
        (tmp_path / "empty", "no step records"),
    ):
        proc = plot(str(run_dir))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
