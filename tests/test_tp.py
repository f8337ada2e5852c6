"""Tensor parallelism for dense models in pretrain_fsdp.py: the model's own Transformers TP plan on `meta`,
then FSDP (2-D FSDP x TP, 3-D HSDP x TP); one-process parity with accumulation, checkpoints across layouts,
exports that plain Transformers loads, and Accelerate's TP + HSDP template under `accelerate launch`."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.data.train_batches import build_batches
from common.ops.config_sources import load_config
from launch import (
    REPO,
    TINY,
    each_rank,
    estimate,
    event,
    free_port,
    losses,
    pretrain,
    read_metrics,
    run,
    steps,
)

STEPS = ["train.steps=4", "train.micro_batch_size=1", "checkpoint.interval=2"]  # 2 to 8 micro-batches a step
STEPS += ["eval.interval=2", "data.eval_dataset=embedded", "eval.max_sequences=4", "eval.batch_size=2"]
SIX = [*STEPS, "train.steps=6", "checkpoint.interval=3", "eval.interval=3"]  # for 3 + 3 = 6


def evals(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["tokens"], r["eval_loss"]) for r in records if r.get("event") == "eval"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp_reference")
    return run_dir, pretrain(run_dir, *STEPS, nproc=0)


@pytest.mark.parametrize(
    "nproc,overrides",
    [
        pytest.param(2, ["parallelism.tp_size=2"], marks=pytest.mark.compat),
        (4, ["parallelism.tp_size=2"]),  # fsdp 2 x tp 2
        (8, ["parallelism.dp_replicate_size=2", "parallelism.dp_shard_size=2", "parallelism.tp_size=2"]),
    ],
    ids=["tp2", "fsdp2xtp2", "hsdp2x2xtp2"],
)
def test_tensor_parallel_layouts_equal_one_process(tmp_path, one_process, nproc, overrides):
    ref_dir, ref = one_process
    records = pretrain(tmp_path, *STEPS, *overrides, nproc=nproc, timeout=600)
    assert event(records, "model_ready")["tp_size"] == 2
    # TP really splits the layers: each rank holds about 1/(dp_shard x tp) of the state, not 1/dp_shard
    dp_shard = 2 if nproc > 2 else 1
    state = max(sum(rank.values()) for rank in event(records, "final")["state_bytes_per_rank"])
    assert state < 0.6 * sum(event(ref, "final")["state_bytes_per_rank"][0].values()) / dp_shard
    assert losses(records) == pytest.approx(losses(ref), abs=1e-5)
    ours, theirs = evals(records), evals(ref)  # steps 0, 2 and 4; each token counted once
    assert [e[:2] for e in ours] == [e[:2] for e in theirs] and len(theirs) == 3
    assert [e[2] for e in ours] == pytest.approx([e[2] for e in theirs], abs=1e-5)
    norms = [r["grad_norm"] for r in steps(records)]
    assert norms == pytest.approx([r["grad_norm"] for r in steps(ref)], abs=1e-5)
    ours, theirs = (
        load_file(tmp_path / "export" / "model.safetensors"),
        load_file(ref_dir / "export" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-5


def test_tp_checkpoints_resume_exactly_and_on_another_layout_and_export_for_transformers(tmp_path):
    straight = pretrain(tmp_path / "straight", *SIX, "parallelism.tp_size=2", nproc=2)
    first = pretrain(tmp_path / "tp", *SIX, "parallelism.tp_size=2", "train.stop_after=3", nproc=2)
    resumed = pretrain(tmp_path / "tp", *SIX, "parallelism.tp_size=2", nproc=2)[len(first) :]
    assert event(resumed, "model_ready")["start_step"] == 3
    assert losses(resumed) == losses(straight)[3:]  # 3 + 3 = 6, exactly
    step_3 = tmp_path / "tp" / "checkpoints" / "step-3"
    other = pretrain(tmp_path / "fsdp", *SIX, f"checkpoint.resume={step_3}", nproc=2)  # tp 2 -> fsdp 2
    assert event(other, "model_ready")["start_step"] == 3
    assert losses(other) == pytest.approx(losses(straight)[3:], abs=1e-5)
    export = tmp_path / "tp" / "export"
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    cfg = load_config(TINY, [f"data.tokenizer={export}", "train.micro_batch_size=1"])
    batch = build_batches(cfg.data, cfg.train, 0, 1, is_main=True)[1].fixed_batch(1)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)
    assert loss.item() == pytest.approx(
        event(read_metrics(tmp_path / "tp"), "final")["fixed_batch_loss"], abs=1e-5
    )


def test_a_sharded_tp_export_converts_and_the_planner_plans_tp(tmp_path):
    """A SHARDED export written by tp 2 loads into one process (train.steps=0 converts it to FULL), and
    the planner's state bytes for tp 2 equal the real run's, rank by rank."""
    records = pretrain(
        tmp_path / "tp", "train.steps=2", "parallelism.tp_size=2", "fsdp.state_dict_type=SHARDED_STATE_DICT"
    )
    sharded = tmp_path / "tp" / "export"
    converted = pretrain(
        tmp_path / "full", "train.steps=0", f"model.name_or_path={sharded}", "model.config={}", nproc=0
    )
    assert event(converted, "final")["fixed_batch_loss"] == pytest.approx(
        event(records, "final")["fixed_batch_loss"], abs=1e-5
    )
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "export") is not None
    planned = estimate(TINY, 2, "parallelism.tp_size=2", device="cpu", quick=True)
    assert planned["state_bytes_per_rank"] == event(records, "final")["state_bytes_per_rank"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["parallelism.tp_size=2", "parallelism.cp_size=2"], "which pretrain_fsdp.py does not combine"),
        (["parallelism.tp_size=2", "lora.r=4"], "PEFT's layers hide the layers the TP plan names"),
        (["parallelism.tp_size=3"], "parallelism.tp_size=3 does not divide the world size 2"),
    ],
)
def test_tp_combinations_it_cannot_run_are_one_line(tmp_path, overrides, message):
    args = ["--config", TINY, f"checkpoint.dir={tmp_path}", *overrides]
    for code, stderr in each_rank("pretrain_fsdp.py", args):
        lines = [line for line in stderr.splitlines() if "config error:" in line]
        assert code == 2 and len(lines) == 1 and message in lines[0], stderr[-2000:]


def test_accelerates_tp_hsdp_template_trains_under_accelerate_launch_on_8_processes(tmp_path):
    template = os.path.join(REPO, "configs", "fsdp", "accelerate_tp_hsdp.yaml")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", template]
    launcher += ["--main_process_port", str(free_port())]
    run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", *STEPS],
        launcher=launcher,
        timeout=600,
    )
    records = read_metrics(tmp_path)
    ready = event(records, "model_ready")
    assert (ready["world_size"], ready["mesh"], ready["tp_size"]) == (
        8,
        {"dp_replicate": 2, "dp_shard": 2},
        2,
    )
    with open(tmp_path / "run_config.json") as f:
        assert json.load(f)["parallelism"]["tp_size"] == 2
    assert len(losses(records)) == 4
