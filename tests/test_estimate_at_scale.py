"""scripts/estimate_memory.py at real size on every shipped large config, on fake tensors and a fake process
group: each builds, shards and steps, and the planner's report says what the config needs."""

import os

import pytest

from launch import REPO, estimate


def test_llama_8b_at_world_8_builds_shards_and_steps():
    """configs/llama.json at real size: 8B parameters, seq 8192, bf16, 16 micro-batches per step, 8 GPUs.
    Without its activation checkpointing it does not fit, so the planner's search runs too (its largest
    micro-batch is checked against real runs in test_estimate_memory.py)."""
    config = os.path.join(REPO, "configs", "llama.json")
    report = estimate(config, 8, "fsdp.activation_checkpointing=false", device="cuda")
    assert 8.0e9 < report["params"] < 8.1e9
    assert report["fsdp_units"] == 35  # 32 layers, the embedding, the head, the root
    assert (
        report["state_bytes_per_rank"]
        == [{"param_bytes": 8030261248 // 2, "optimizer_bytes": 8030261248}] * 8
    )
    # 16 micro-batches each all-gather the bf16 model twice (forward, backward), but for the last layer and
    # the output layer (218M + 525M parameters), kept from forward to backward; one fp32 reduce-scatter.
    comm = report["comm_bytes_per_step"]
    assert report["params_kept_after_forward"] == 218112000 + 525336576 + 4096  # + the final norm
    assert comm["all_gather_bytes"] >= 16 * 2 * (2 * 8030261248 - report["params_kept_after_forward"])
    assert comm["reduce_scatter_bytes"] == pytest.approx(4 * 8030261248, rel=1e-4)
    # Accumulating without a gradient sync keeps the whole model's fp32 gradient unsharded on every rank.
    assert report["breakdown_bytes"]["gradients"] >= 8030261248 * 4
    assert not report["fits"]
    peaks = {a["change"]: a for a in report["alternatives"]}
    # As shipped, with activation checkpointing, it fits an 80 GiB GPU; so does it with cpu_offload.
    assert peaks["fsdp.activation_checkpointing=true"]["fits"] and peaks["fsdp.cpu_offload=true"]["fits"]
    # A synced reduce-scatter per micro-batch frees the unsharded fp32 gradient (30 GiB at 8B).
    assert peaks["train.sync_each_batch=true"]["peak_gib"] < report["peak_gib_per_rank"] - 25


def test_long_context_eval_at_cp_8_builds_shards_and_runs():
    """configs/eval_cp_llama.json at real size: Llama 3.1 8B, 131,072 tokens, cp 8."""
    report = estimate(os.path.join(REPO, "configs", "eval_cp_llama.json"), 8, device="cuda")
    assert report["recipe"] == "eval" and report["fits"]


def test_qwen3_moe_at_world_16_builds_shards_and_steps():
    """configs/qwen3_moe.json at real size: Qwen3-30B-A3B, 128 experts, ep 8, 2 nodes x 8 GPUs of 80 GiB
    (slurm/moe_ep.sh). One measurement (--quick): the planner's search is covered on the dense configs."""
    report = estimate(os.path.join(REPO, "configs", "qwen3_moe.json"), 16, device="cuda", quick=True)
    params = 30_532_122_624
    assert report["recipe"] == "moe" and report["params"] == params
    # fp32 parameters and two AdamW states, the experts split 8 ways by EP and everything 16 ways in all.
    assert (
        report["state_bytes_per_rank"] == [{"param_bytes": params // 4, "optimizer_bytes": params // 2}] * 16
    )
    assert report["fits"]


def test_mixtral_at_world_16_builds_shards_and_steps():
    """configs/mixtral.json at real size: Mixtral-8x7B (47B), 2 nodes x 8 GPUs of 80 GiB. One expert per
    rank (ep 8), FSDP over the 2 ranks that hold it: each holds half of each of its expert's weights."""
    report = estimate(os.path.join(REPO, "configs", "mixtral.json"), 16, device="cuda", quick=True)
    params = 46_702_792_704
    assert report["recipe"] == "moe" and report["params"] == params
    # Every rank a sixteenth, up to FSDP's padding (before: 22.9 GB on 8 ranks, 0.4 GB on the other 8).
    held = [state["param_bytes"] for state in report["state_bytes_per_rank"]]
    assert held == pytest.approx([params * 4 / 16] * 16, rel=1e-4), held
    assert report["fits"]
