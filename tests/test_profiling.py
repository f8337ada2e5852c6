"""metrics.profile_steps and metrics.memory_snapshot (common/profiling.py): a trace per rank that shows the
collectives a run counts, and a memory snapshot after the chosen steps and on an out-of-memory error."""

import json
import os
from collections import Counter

import pytest
import torch

import common.ops.profiling
from common.config import Config
from common.ops.profiling import StepDiagnostics, prepare_diagnostics
from launch import event, pretrain, steps

STEP = ["train.steps=3", "train.micro_batch_size=4", "checkpoint.export=false"]


def test_profile_steps_write_a_trace_per_rank_with_every_all_gather_and_reduce_scatter(tmp_path):
    records = pretrain(tmp_path, *STEP, "metrics.comm_stats=true", "metrics.profile_steps=[2, 3]")
    assert event(records, "profiler_trace")["path"] == str(tmp_path / "profile" / "rank0-steps2-3.json")
    profiled = [r for r in steps(records) if r["step"] in (2, 3)]
    for rank in range(2):
        with open(tmp_path / "profile" / f"rank{rank}-steps2-3.json") as f:
            names = Counter(e["name"] for e in json.load(f)["traceEvents"])
        assert (names["train step 1"], names["train step 2"], names["train step 3"]) == (0, 1, 1)
        all_gathers = sum(n for name, n in names.items() if name.startswith("FSDP::all_gather ("))
        assert all_gathers == sum(r["all_gather_calls"] for r in profiled) > 0
        assert names["c10d::_reduce_scatter_base_"] == sum(r["reduce_scatter_calls"] for r in profiled) > 0


@pytest.fixture
def fake_cuda_history(monkeypatch):
    """torch.cuda.memory's recorder, as a list of calls: CI has no CUDA."""
    calls = []
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw))
    )
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    return calls


def test_memory_snapshot_is_dumped_after_the_profiled_steps_and_on_out_of_memory(
    tmp_path, capsys, fake_cuda_history
):
    cfg = Config()
    cfg.checkpoint.dir, cfg.metrics.memory_snapshot, cfg.metrics.profile_steps = str(tmp_path), True, [2, 3]
    with pytest.raises(torch.OutOfMemoryError), StepDiagnostics(cfg, torch.device("cpu"), 1) as diagnostics:
        for step in range(1, 6):
            diagnostics.before(step)
            if step == 5:
                raise torch.OutOfMemoryError("CUDA out of memory")
            events = diagnostics.after(step)
            assert [e["event"] for e in events] == {2: [], 3: ["profiler_trace", "memory_snapshot"]}.get(
                step, []
            )
    snapshots = tmp_path / "memory_snapshot"
    assert fake_cuda_history == [
        ("record", {"max_entries": 100_000}),
        ("dump", str(snapshots / "rank0-step3.pickle")),
        ("dump", str(snapshots / "rank0-oom-step5.pickle")),
        ("record", {"enabled": None}),
    ]
    assert "out of memory at step 5; snapshot " in capsys.readouterr().out


def test_on_cuda_the_flight_recorder_dumps_under_the_run_directory(tmp_path, monkeypatch, capsys):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(common.ops.profiling, "resolve_device", lambda preference: torch.device("cuda", 0))
    cfg = Config()
    cfg.checkpoint.dir = str(tmp_path)
    prepare_diagnostics(cfg)
    prefix = str(tmp_path / "flight_recorder" / "rank_")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == prefix and os.path.isdir(tmp_path / "flight_recorder")
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(os.environ["TORCH_FR_BUFFER_SIZE"]) > 0
    assert f"each rank writes its last collectives to {prefix}N" in capsys.readouterr().out
