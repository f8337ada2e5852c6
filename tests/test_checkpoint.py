"""Resume checkpoints: exact resume, resume on another world size, restarts, crash safety, no hangs."""

import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from with_sample_log import read_sample_log

from common.ops.run_dir import find_resume_checkpoint
from launch import (
    REPO,
    TINY,
    each_rank,
    env,
    event,
    free_port,
    losses,
    pretrain,
    read_metrics,
    run,
    run_command,
    steps,
    torchrun,
)

STEPS = 20
CKPT = [f"train.steps={STEPS}", "checkpoint.interval=5"]
RESTART_ENV = {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"
}  # restarted gloo workers otherwise read stale store addresses


def weights(run_dir) -> dict:
    return load_file(os.path.join(run_dir, "export", "model.safetensors"))


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), [k for k in a if not (a[k] == b[k]).all()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference: 2 ranks, 20 steps, a checkpoint every 5 steps."""
    run_dir = tmp_path_factory.mktemp("straight")
    return run_dir, pretrain(run_dir, *CKPT)


@pytest.mark.compat
def test_stop_and_resume_is_bit_identical_and_keeps_the_latest_two(tmp_path, straight):
    ref_dir, ref = straight
    first = pretrain(tmp_path, *CKPT, "train.stop_after=10")
    assert event(first, "stopped")["step"] == 10
    resumed = read_metrics_after(tmp_path, lambda: pretrain(tmp_path, *CKPT))
    assert event(resumed, "model_ready")["start_step"] == 10
    assert losses(resumed) == losses(ref)[10:]  # steps 11-20, exactly, not approximately
    assert_bit_identical(weights(tmp_path), weights(ref_dir))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-15", "step-20"]


def read_metrics_after(run_dir, launch) -> list[dict]:
    """The records a relaunch appends to an existing metrics.jsonl."""
    before = len(read_metrics(run_dir))
    launch()
    return read_metrics(run_dir)[before:]


# 2 -> 4 here; 4 -> 2 is test_lora.py's resume on fewer ranks (the same data-position code)
@pytest.mark.parametrize("first,second", [pytest.param(2, 4, marks=pytest.mark.compat)])
def test_resume_on_another_world_size_neither_repeats_nor_skips_samples(tmp_path, first, second):
    common = ["train.steps=8", "checkpoint.interval=2", "train.micro_batch_size=2"]
    logged = dict(wrapper="with_sample_log.py", extra_env={"SAMPLE_LOG": str(tmp_path / "samples")})
    before = pretrain(tmp_path, *common, "train.stop_after=4", nproc=first, **logged)
    after = read_metrics_after(tmp_path, lambda: pretrain(tmp_path, *common, nproc=second, **logged))
    assert (
        event(after, "model_ready")["world_size"] == second and event(after, "model_ready")["start_step"] == 4
    )
    records = steps(before + after)
    assert [r["step"] for r in records] == list(range(1, 9))
    consumed = read_sample_log(str(tmp_path / "samples"))  # {a step's first sample: every rank's samples}
    assert sorted(consumed) == [(step - 1) * 8 for step in range(1, 9)]
    for first_sample, samples in consumed.items():
        assert sorted(samples) == list(range(first_sample, first_sample + 8)), (first_sample, samples)
    # Same samples, same math: the losses follow an uninterrupted run up to reduction-order rounding.
    reference = pretrain(tmp_path / "ref", *common, nproc=first)
    assert losses(after) == pytest.approx(losses(reference)[4:], abs=1e-5)


def test_torchrun_restarts_a_killed_worker_and_ends_bit_identical(tmp_path, straight):
    ref_dir, ref = straight
    run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", *CKPT],
        nproc=2,
        launcher=[
            "torchrun",
            "--nnodes=1",
            "--nproc_per_node=2",
            "--max_restarts=1",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0",
            "--rdzv_id=restart-test",
        ],
        extra_env={**RESTART_ENV, "FSDP2_RECIPES_FAULT": "kill@13:1"},
        wrapper="with_faults.py",
    )
    records = read_metrics(tmp_path)
    starts = [r for r in records if r.get("event") == "model_ready"]
    assert [r["start_step"] for r in starts] == [0, 10]  # killed at step 13, restarted from step-10
    assert_bit_identical(weights(tmp_path), weights(ref_dir))
    assert losses(records)[-10:] == losses(ref)[-10:]


def test_a_crash_inside_a_checkpoint_write_leaves_the_previous_one_intact(tmp_path, straight):
    ref_dir, _ = straight
    crashed = run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", *CKPT],
        nproc=2,
        check=False,
        extra_env={"FSDP2_RECIPES_FAULT": "save@10:0"},
        wrapper="with_faults.py",
    )
    assert crashed.returncode != 0
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["step-10.tmp", "step-5"]
    assert find_resume_checkpoint(str(tmp_path), "auto").endswith("step-5")  # the partial one is never picked
    after = read_metrics_after(tmp_path, lambda: pretrain(tmp_path, *CKPT))
    assert event(after, "model_ready")["start_step"] == 5
    assert not (tmp_path / "checkpoints" / "step-10.tmp").exists()  # cleaned up by the next save
    assert_bit_identical(weights(tmp_path), weights(ref_dir))


def test_async_checkpoints_survive_a_kill_during_a_background_write_and_resume_bit_identical(
    tmp_path, straight
):
    """checkpoint.async_save: rank 0 is killed just after its step-10 write started in the background. The
    rerun resumes from step-5 and ends bit-identical to the synchronous run, every checkpoint published."""
    ref_dir, ref = straight
    crashed = run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", *CKPT, "checkpoint.async_save=true"],
        nproc=2,
        check=False,
        extra_env={"FSDP2_RECIPES_FAULT": "save@10:0"},
        wrapper="with_faults.py",
    )
    assert crashed.returncode != 0
    # step-10.tmp, partly written, exists once either rank's background thread has begun its write.
    assert {"step-5"} <= set(os.listdir(tmp_path / "checkpoints")) <= {"step-5", "step-10.tmp"}
    assert find_resume_checkpoint(str(tmp_path), "auto").endswith("step-5")
    after = read_metrics_after(tmp_path, lambda: pretrain(tmp_path, *CKPT, "checkpoint.async_save=true"))
    assert event(after, "model_ready")["start_step"] == 5
    assert losses(after) == losses(ref)[5:]
    assert_bit_identical(weights(tmp_path), weights(ref_dir))
    published = [r for r in after if r.get("event") == "checkpoint"]
    assert [(r["step"], r["async"]) for r in published] == [(10, True), (15, True), (20, True)]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-15", "step-20"]  # the run waited for 20


def test_nan_loss_stops_with_a_message_and_keeps_good_checkpoints(tmp_path):
    proc = run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", *CKPT],
        nproc=2,
        check=False,
        extra_env={"FSDP2_RECIPES_FAULT": "nan@15"},
        wrapper="with_faults.py",
    )
    assert proc.returncode != 0
    assert "loss is nan at step 15; stopping without saving" in proc.stderr
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-10", "step-5"]
    assert not (tmp_path / "export").exists()


def test_a_non_finite_loss_on_one_rank_stops_every_rank(tmp_path):
    """Rank 1 alone sees a NaN loss: both ranks stop at that step with the same line, neither waits in the
    next collective for the timeout (which would end rank 0 with a timeout error instead)."""
    ranks = each_rank(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", *CKPT, "parallelism.timeout_minutes=0.5"],
        extra_env={"FSDP2_RECIPES_FAULT": "nan@15:1"},
        wrapper="with_faults.py",
    )
    for code, stderr in ranks:
        assert code == 1 and stderr.count("at step 15; stopping without saving") == 1, stderr[-3000:]
    assert "loss is not finite on another rank at step 15" in ranks[0][1]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-10", "step-5"]


@pytest.mark.parametrize("fault", ["grad@15", "grad@15:1"])
def test_non_finite_gradients_stop_every_rank_before_the_optimizer_step(tmp_path, fault):
    """The loss stays finite and the gradients are NaN (on every rank, or on rank 1 alone): each rank stops
    at that step, before AdamW spreads the NaN, and the last checkpoint is the good one."""
    ranks = each_rank(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", *CKPT, "parallelism.timeout_minutes=0.5"],
        extra_env={"FSDP2_RECIPES_FAULT": fault},
        wrapper="with_faults.py",
    )
    stop = "gradient norm is nan at step 15; stopping before the optimizer step"
    for code, stderr in ranks:
        assert code == 1 and stderr.count(stop) == 1, stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-10", "step-5"]
    logged = steps(read_metrics(tmp_path))
    assert logged[-1]["step"] == 14 and all(math.isfinite(r["loss"]) for r in logged)


def test_non_finite_gradients_at_step_1_do_not_blame_the_learning_rate(tmp_path):
    """Before any update the learning rate played no part (Gemma3n's unclamped magnitude on a zero hidden
    state, say): the line says so rather than suggesting a lower train.lr."""
    proc = run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", "train.steps=2"],
        nproc=0,
        check=False,
        extra_env={"FSDP2_RECIPES_FAULT": "grad@1"},
        wrapper="with_faults.py",
    )
    line = "gradient norm is nan at step 1; stopping before the optimizer step, without saving: the last "
    line += "checkpoint is intact (at step 1, before any update, so not the learning rate"
    assert proc.returncode == 1 and line in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[
        -2000:
    ]


def test_a_hung_rank_ends_the_job_within_the_collective_timeout(tmp_path):
    start = time.monotonic()
    proc = run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", "train.steps=6", "parallelism.timeout_minutes=0.1"],
        nproc=2,
        check=False,
        timeout=240,
        extra_env={"FSDP2_RECIPES_FAULT": "hang@3:1"},
        wrapper="with_faults.py",
    )
    assert proc.returncode != 0
    assert time.monotonic() - start < 120
    assert "timed out" in proc.stderr.lower() or "timeout" in proc.stderr.lower()


def test_checkpoints_of_another_model_are_refused_with_a_clear_message(tmp_path):
    pretrain(tmp_path, "train.steps=2", "checkpoint.export=false")
    # Each rank as torchrun starts it, not under torchrun (each_rank): every rank must refuse by itself.
    args = ["--config", TINY, f"checkpoint.dir={tmp_path}", "train.steps=4", "model.config.hidden_size=32"]
    for r, (code, stderr) in enumerate(each_rank("pretrain_fsdp.py", args)):
        lines = [line for line in stderr.splitlines() if "config error:" in line]
        assert code == 2 and len(lines) == 1, stderr[-4000:]
        assert lines[0].startswith(f"[rank{r}] ") and "holds a different model" in lines[0]
        assert "checkpoint.resume=none" in lines[0]


def test_checkpoints_hold_tensors_only_so_loading_never_unpickles(straight):
    ref_dir, _ = straight
    metadata = dcp.FileSystemReader(str(ref_dir / "checkpoints" / "step-20")).read_metadata()
    kinds = {type(m).__name__ for m in metadata.state_dict_metadata.values()}
    assert kinds == {"TensorStorageMetadata"}, kinds
    assert any(k.startswith("optim.") for k in metadata.state_dict_metadata)


# Rank 1 lists an empty directory, as a node with a stale view of a network filesystem would.
RESUME_CHOICE = f"""
import os, sys
sys.path.insert(0, {REPO!r})
import torch.distributed as dist
from common.ops import run_dir as run_dir_module
from common.ops.run_dir import find_resume_checkpoint
run_dir_module.check_shared_storage = lambda run_dir: None  # the ranks see different directories on purpose
dist.init_process_group("gloo")
run_dir = sys.argv[1] if dist.get_rank() == 0 else sys.argv[2]
# One write(2) per line: both ranks share the pipe, and print() under PYTHONUNBUFFERED writes the text and its
# newline separately, so two ranks' lines could interleave. A pipe write under PIPE_BUF bytes is atomic.
os.write(1, f"rank {{dist.get_rank()}} resumes from {{find_resume_checkpoint(run_dir, 'auto')}}\\n".encode())
dist.destroy_process_group()
"""


def test_rank_0_chooses_the_resume_checkpoint_for_every_rank(tmp_path):
    seen, empty = tmp_path / "seen", tmp_path / "empty"
    (seen / "checkpoints" / "step-4").mkdir(parents=True)
    (seen / "checkpoints" / "step-4" / "train_state.json").write_text("{}")
    script = tmp_path / "resume_choice.py"
    script.write_text(RESUME_CHOICE)
    proc = run_command([*torchrun(2), str(script), str(seen), str(empty)], timeout=120)
    chosen = os.path.join(seen, "checkpoints", "step-4")
    assert sorted(proc.stdout.split("\n")[:-1]) == [f"rank {r} resumes from {chosen}" for r in (0, 1)]


def test_two_nodes_with_their_own_home_share_only_the_checkpoint_dir(tmp_path):
    """Two torchrun agents (--nnodes 2) whose HOME differ: each node builds the tokenizer and token cache
    under its own ~/.cache (data.cache_dir's default), and the run trains, checkpoints and resumes."""
    shared = tmp_path / "shared_run"
    port = free_port()

    def launch(steps: int) -> None:
        nodes = []
        for node in (0, 1):
            home = tmp_path / f"home{node}"
            home.mkdir(exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
            cmd += [f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}"]
            cmd += [os.path.join(REPO, "scripts", "pretrain_fsdp.py"), "--config", TINY]
            cmd += [f"checkpoint.dir={shared}", f"train.steps={steps}", "checkpoint.interval=2"]
            out = open(tmp_path / f"node{node}.log", "w")
            nodes.append(subprocess.Popen(cmd, cwd=REPO, env=env(HOME=str(home)), stdout=out, stderr=out))
        codes = [node.wait(timeout=300) for node in nodes]
        assert codes == [0, 0], [(tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1)]

    launch(steps=4)
    for node in (0, 1):  # each node's own cache, built by its first rank
        cache = tmp_path / f"home{node}" / ".cache" / "fsdp2-recipes"
        assert any(name.startswith("tokenizer-") for name in os.listdir(cache))
        assert any(name.startswith("tokens-") for name in os.listdir(cache))
    launch(steps=6)
    records = read_metrics(shared)
    resumed = [r for r in records if r.get("event") == "model_ready"][-1]
    assert resumed["start_step"] == 4
    assert [r["step"] for r in steps(records)][-2:] == [5, 6]


# Each rank seeds its own RNG, checkpoints, draws, scrambles, resumes and draws again.
PER_RANK_RNG = f"""
import os, sys
sys.path.insert(0, {REPO!r})
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
from common.checkpoint import load_checkpoint, save_checkpoint
from common.ops.cli import end_process
dist.init_process_group("gloo")
rank = dist.get_rank()
config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
model = fully_shard(LlamaForCausalLM(config))
optimizer = torch.optim.AdamW(model.parameters())
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
torch.manual_seed(100 + rank)
path = save_checkpoint(sys.argv[1], 1, model, optimizer, {{"scheduler": scheduler.state_dict()}}, 1)
expected = torch.rand(4)
torch.manual_seed(12345)
load_checkpoint(path, model, optimizer, scheduler)
restored = torch.equal(torch.rand(4), expected)
os.write(1, f"rank {{rank}} restored its own RNG: {{restored}}\\n".encode())  # one atomic write, as above
dist.destroy_process_group()
end_process(0)  # DTensor's meshes keep gloo threads that can abort interpreter teardown (common/ops/cli.py)
"""


def test_every_rank_gets_its_own_rng_state_back(tmp_path):
    script = tmp_path / "per_rank_rng.py"
    script.write_text(PER_RANK_RNG)
    proc = run_command([*torchrun(2), str(script), str(tmp_path / "run")], timeout=180)
    assert sorted(proc.stdout.split("\n")[:-1]) == [f"rank {r} restored its own RNG: True" for r in (0, 1)]


def test_resuming_an_older_step_starts_a_branch_that_auto_then_follows(tmp_path):
    """A run reached step 8; resumed from step 4 and trained to step 6, the newer steps move aside (kept,
    named in one line), keep_latest cannot prune the new step-6 as older than step-8, and resume=auto
    continues from the new branch's step 6."""
    keep = ["checkpoint.interval=2", "checkpoint.keep_latest=10", "checkpoint.export=false"]
    pretrain(tmp_path, "train.steps=8", *keep)
    root = tmp_path / "checkpoints"
    proc = run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", "train.steps=6", *keep]
        + [f"checkpoint.resume={root / 'step-4'}", "checkpoint.keep_latest=1"],
        nproc=2,
    )
    aside = root / "abandoned-after-step-4"
    assert sorted(os.listdir(aside)) == ["step-6", "step-8"]
    assert f"moved step-6, step-8 to {aside}" in proc.stdout
    assert sorted(os.listdir(root)) == ["abandoned-after-step-4", "step-6"]
    resumed = read_metrics_after(tmp_path, lambda: pretrain(tmp_path, "train.steps=8", *keep))
    assert event(resumed, "model_ready")["resumed_from"] == str(root / "step-6")
    assert [record["step"] for record in steps(resumed)] == [7, 8]


@pytest.mark.parametrize("write", ["sync", "async"])
def test_a_full_disk_during_a_checkpoint_write_stops_cleanly_and_resumes(small_disk, write):
    run_dir = small_disk / "run"
    overrides = ["train.steps=4", "checkpoint.interval=2", "checkpoint.export=false"]
    overrides.append(f"checkpoint.async_save={str(write == 'async').lower()}")
    ranks = each_rank("pretrain_fsdp.py", ["--config", TINY, f"checkpoint.dir={run_dir}", *overrides])
    root = run_dir / "checkpoints"
    line = re.compile(  # and what the next one needs: about what step-2 took (7.7 MB)
        rf"checkpoint step-4 could not be written: the disk is full \(No space left on device; step-2 took "
        rf"7,[\d,]{{7}} bytes, [\d,]+ are free\), under {re.escape(str(root))}; removed the partial "
        rf"step-4.tmp, and step-2 is intact. Free space and rerun the same command to resume\n"
    )
    # One line and a normal exit with code 1 on each rank, not an abort; no tracebacks, the writer threads'
    # included.
    for code, stderr in ranks:
        assert code == 1 and len(line.findall(stderr)) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert sorted(os.listdir(root)) == ["step-2"]
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = read_metrics_after(run_dir, lambda: pretrain(run_dir, *overrides))
    assert event(resumed, "model_ready")["start_step"] == 2
    assert [record["step"] for record in steps(resumed)] == [3, 4]
