"""N-rank FSDP/HSDP training equals the one-process run: the heart of the recipe's correctness."""

import pytest

from launch import event, losses, pretrain, steps, write_short_documents

STEPS = 10


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    return pretrain(
        tmp_path_factory.mktemp("single"), f"train.steps={STEPS}", "checkpoint.export=false", nproc=0
    )


@pytest.mark.parametrize(
    "nproc,overrides",
    [
        pytest.param(2, [], marks=pytest.mark.compat),
        (4, []),
        pytest.param(  # 2x2 HSDP
            4, ["parallelism.dp_replicate_size=2", "parallelism.dp_shard_size=2"], marks=pytest.mark.compat
        ),
        # context parallel training: each rank trains on half of every sequence
        (
            2,
            ["parallelism.cp_size=2"],
        ),
        # HSDP replicas 2 x cp 2: FSDP shards over the cp ranks of a replica, which all-reduce with the other.
        (4, ["parallelism.dp_replicate_size=2", "parallelism.cp_size=2"]),
        # selective AC recomputes cp's K/V all-gathers in backward
        (2, ["parallelism.cp_size=2", "fsdp.activation_checkpointing=true", "fsdp.ac_policy=op"]),
    ],
    ids=["fsdp2", "fsdp4", "hsdp2x2", "cp2", "hsdp2xcp2", "cp2-selective-ac"],
)
def test_losses_match_single_process(tmp_path, single_process, nproc, overrides):
    records = pretrain(tmp_path, f"train.steps={STEPS}", "checkpoint.export=false", *overrides, nproc=nproc)
    assert event(records, "model_ready")["world_size"] == nproc
    reference = losses(single_process)
    assert len(reference) == STEPS
    assert losses(records) == pytest.approx(reference, abs=1e-5)
    # Training actually moved the weights, so the comparison is not between two untouched models.
    assert reference[-1] < reference[0] - 0.3


def test_document_mask_under_cp_trains_like_one_process(tmp_path):
    """Packed documents kept apart: one process uses Transformers' packed-sequence mask, cp 2
    common/cp.py's."""
    corpus = write_short_documents(tmp_path / "short.jsonl")
    common = ["train.steps=4", "checkpoint.export=false", f"data.dataset={corpus}"]
    plain = pretrain(tmp_path / "plain", *common, nproc=0)
    one = pretrain(tmp_path / "one", *common, "data.document_mask=true", nproc=0)
    sharded = pretrain(tmp_path / "cp", *common, "data.document_mask=true", "parallelism.cp_size=2", nproc=2)
    assert losses(sharded) == pytest.approx(losses(one), abs=1e-5)
    assert max(abs(a - b) for a, b in zip(losses(one), losses(plain))) > 1e-3  # the mask changed training


def test_gradient_accumulation_with_padding_matches_one_big_batch(tmp_path):
    """2 ranks x 4 micro-batches of 1 == 1 process x 1 micro-batch of 8, on padded (unpacked) documents,
    where micro-batches hold different numbers of target tokens: only a global token count gets this right."""
    common = ["train.steps=6", "train.global_batch_size=8", "data.pack=false", "checkpoint.export=false"]
    big = pretrain(tmp_path / "big", *common, "train.micro_batch_size=8", nproc=0)
    accumulated = pretrain(tmp_path / "acc", *common, "train.micro_batch_size=1", nproc=2)
    assert losses(accumulated) == pytest.approx(losses(big), abs=1e-5)
    big_norms = [r["grad_norm"] for r in steps(big)]
    acc_norms = [r["grad_norm"] for r in steps(accumulated)]
    assert acc_norms == pytest.approx(big_norms, rel=1e-4)
    tokens = [r["tokens"] for r in steps(big)]
    assert len(set(tokens)) > 1, "padding should make the token count vary per step"
