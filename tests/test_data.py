"""Data: local files of every supported type, packing, padding, per-rank sharding, streaming."""

import json

import numpy as np
import pytest
import torch
from with_sample_log import sampled

from common.config import DataConfig
from common.data.batches import (
    PAD,
    LocalBatches,
    StreamingBatches,
    load_tokenizer,
    prepare_local_data,
)
from common.data.embedded import ensure_embedded_tokenizer
from launch import event, losses, pretrain, steps

DOCS = [f"def function_{i}(x):\n    return x * {i} + {i * i}\n" * (5 + i % 7) for i in range(60)]


def write_docs(tmp_path, fmt: str) -> str:
    if fmt == "jsonl":
        path = tmp_path / "docs.jsonl"
        path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    elif fmt == "parquet":
        import pandas as pd

        path = tmp_path / "docs.parquet"
        pd.DataFrame({"text": DOCS}).to_parquet(path)
    else:
        path = tmp_path / "docs.txt"  # the text builder yields one sample per line
        path.write_text("\n".join(d.replace("\n", " ") for d in DOCS))
    return str(path)


def data_cfg(tmp_path, seq_len: int = 32, **kwargs) -> DataConfig:
    cfg = DataConfig(
        seq_len=seq_len, embedded_max_bytes=1_000_000, cache_dir=str(tmp_path / "cache"), **kwargs
    )
    ensure_embedded_tokenizer(cfg, is_main=True)
    return cfg


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "txt"])
def test_local_files_are_packed_with_eos_between_documents(tmp_path, fmt):
    cfg = data_cfg(tmp_path, dataset=write_docs(tmp_path, fmt))
    rows = np.load(prepare_local_data(cfg, is_main=True))
    tokenizer = load_tokenizer(cfg)
    texts = DOCS if fmt != "txt" else [d.replace("\n", " ") for d in DOCS]
    stream = [
        t
        for text in texts
        for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ]
    assert rows.shape[1] == 33
    # Rows overlap by one token (a row's last target is the next row's first input) and cover the stream.
    np.testing.assert_array_equal(rows[:, 1:].reshape(-1), stream[1 : 1 + rows.shape[0] * 32])
    np.testing.assert_array_equal(rows[1:, 0], rows[:-1, -1])


def test_unpacked_documents_are_padded_and_padding_is_never_a_target(tmp_path):
    cfg = data_cfg(tmp_path, dataset=write_docs(tmp_path, "jsonl"), pack=False, seq_len=128)
    path = prepare_local_data(cfg, is_main=True)
    rows = np.load(path)
    assert len(rows) == len(DOCS) and (rows == PAD).any() and (rows != PAD).all(axis=1).any()
    batch = LocalBatches(
        path, pad_id=7, seed=0, global_batch=4, micro_batch=4, dp_rank=0, dp_size=1
    ).fixed_batch(len(rows))
    assert (batch.input_ids[torch.from_numpy(rows[:, :-1] == PAD)] == 7).all()
    assert torch.equal(batch.labels == -100, torch.from_numpy(rows[:, 1:] == PAD))


def test_each_step_uses_the_same_global_samples_whatever_the_world_size(tmp_path):
    cfg = data_cfg(tmp_path)
    path = prepare_local_data(cfg, is_main=True)
    reference = {}  # step -> the inputs that one rank sees
    for dp_size in (1, 2, 4):
        for step in (0, 3):
            seen, inputs = [], []
            for rank in range(dp_size):
                batches = LocalBatches(
                    path, 0, 0, global_batch=8, micro_batch=2, dp_rank=rank, dp_size=dp_size
                )
                micro_batches, held = sampled(batches, step * 8)
                seen += held
                inputs += [row.tolist() for b in micro_batches for row in b.input_ids]
            assert seen == list(range(step * 8, step * 8 + 8))
            assert inputs == reference.setdefault(step, inputs)


def test_streaming_gives_each_rank_its_own_part(tmp_path):
    cfg = data_cfg(tmp_path, dataset=write_docs(tmp_path, "jsonl"), streaming=True)
    tokenizer = load_tokenizer(cfg)
    first = [
        StreamingBatches(cfg, tokenizer, 4, 2, rank, 2).micro_batches(0)[0].input_ids[0].tolist()
        for rank in (0, 1)
    ]
    expected = [tokenizer(DOCS[rank], add_special_tokens=False)["input_ids"][:32] for rank in (0, 1)]
    assert first == expected  # rank r starts at document r: the stream is split across ranks


def test_training_on_local_jsonl_and_streamed_jsonl(tmp_path):
    path = write_docs(tmp_path, "jsonl")
    local = pretrain(tmp_path / "local", "train.steps=3", f"data.dataset={path}", "checkpoint.export=false")
    streamed = pretrain(
        tmp_path / "stream",
        "train.steps=3",
        f"data.dataset={path}",
        "data.streaming=true",
        "checkpoint.export=false",
    )
    assert len(losses(local)) == 3 and len(losses(streamed)) == 3
    assert all(np.isfinite(losses(local) + losses(streamed)))


def test_a_streamed_run_with_context_parallelism_resumes_where_it_stopped(tmp_path):
    """cp 2 x dp 2: both ranks of a CP group read one stream, and the checkpoint holds every rank's
    copy of it; the resumed run must take its own data-parallel rank's stream position."""
    path = write_docs(tmp_path, "jsonl")
    run = ["train.steps=4", f"data.dataset={path}", "data.streaming=true", "parallelism.cp_size=2"]
    run += ["checkpoint.export=false"]
    straight = pretrain(tmp_path / "straight", *run, nproc=4)
    stopped = pretrain(tmp_path / "resumed", *run, "train.stop_after=2", nproc=4)
    assert event(stopped, "stopped")["step"] == 2
    both = pretrain(tmp_path / "resumed", *run, nproc=4)
    resumed = both[len(stopped) :]
    assert event(resumed, "model_ready")["start_step"] == 2
    assert [r["step"] for r in steps(resumed)] == [3, 4]
    assert losses(resumed) == losses(straight)[2:]  # the same batches, in the same order
