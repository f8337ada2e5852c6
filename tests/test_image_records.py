"""Image-text records (common/data/image_records.py), in one process: the release's processor renders them,
the answer alone is a target, a record too long for a row is left out and counted, and records that do not
match their images are one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from image_releases import add_processor, processor_without_torchvision, write_shape_records
from test_architectures import tiny_image_text_config

from common.config import ConfigError, DataConfig, TrainConfig
from common.data.batches import PAD
from common.data.image_records import build_image_batches, open_images, read_records, render, rows_path


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    add_processor("gemma3", tiny_image_text_config("gemma3"), path)
    return path


def data(release, records, seq_len: int = 64, **keys) -> DataConfig:
    return DataConfig(
        dataset=str(records),
        tokenizer=str(release),
        seq_len=seq_len,
        cache_dir=str(records.parent / "cache"),
        **keys,
    )


def test_the_answer_alone_is_a_target_and_each_batch_is_the_processors_output(release, tmp_path):
    records = write_shape_records(tmp_path, 6)
    cfg = data(release, tmp_path / "train.jsonl")
    processor, batches = build_image_batches(
        cfg, TrainConfig(global_batch_size=4, micro_batch_size=2), 0, 1, True
    )
    [first, second] = batches.micro_batches(0)
    texts = [json.loads(line) for line in open(records)]
    for batch in (first, second):
        # padded to the longer record, less the last token (a target only)
        assert batch.input_ids.shape == batch.labels.shape and batch.position_ids is None
        assert batch.input_ids.shape[0] == 2 and batch.input_ids.shape[1] < 64
        assert (batch.input_ids != processor.tokenizer.pad_token_id).sum(1).max() == batch.input_ids.shape[1]
        assert set(batch.images) == {"pixel_values", "token_type_ids"}
        assert batch.images["pixel_values"].shape == (2, 3, 16, 16)
        for labels in batch.labels:
            answer = processor.tokenizer.decode(labels[labels != -100])
            assert answer in {f"{r['messages'][1]['content'][0]['text']}<|eos|>" for r in texts}, answer
    # The same rows, rendered again by the processor on a batch of one, give the same tokens
    fixed = batches.fixed_batch(1)
    text = processor.apply_chat_template(texts[0]["messages"], tokenize=False)
    from PIL import Image

    image = Image.open(tmp_path / texts[0]["images"][0]).convert("RGB")
    alone = processor(text=[text], images=[[image]], add_special_tokens=False)
    ids = alone["input_ids"][0]
    assert fixed.input_ids[0, : len(ids) - 1].tolist() == ids[:-1]


def test_a_record_longer_than_a_row_is_left_out_and_counted(release, tmp_path, capsys):
    write_shape_records(tmp_path, 3)
    cfg = data(release, tmp_path / "train.jsonl", seq_len=16)  # each renders to more than 17 tokens
    processor, (records, folder) = (
        transformers.AutoProcessor.from_pretrained(release),
        read_records(cfg.dataset, "train", "data.dataset"),
    )
    with pytest.raises(ConfigError, match="no record with an assistant answer within data.seq_len"):
        rows_path(cfg, processor, cfg.dataset, "train", True, "data.dataset", records, folder)
    assert (
        "3 of 3 records render to more than data.seq_len + 1 = 17 tokens and are left out"
        in capsys.readouterr().out
    )
    cfg = data(release, tmp_path / "train.jsonl", seq_len=64)
    path = rows_path(cfg, processor, cfg.dataset, "train", True, "data.dataset", records, folder)
    rows = np.load(path)
    assert rows.shape == (3, 3, 65) and (rows[:, 0, -1] == PAD).all()


def test_qwen_vl_pixel_values_stay_whole_where_a_patch_is_as_long_as_the_row(tmp_path):
    """Qwen-VL's pixel values are every patch's values, [patches, 3 x 2 x 4 x 4 = 96] here: in a row of 96
    tokens they are not cut by the last token as the per-token tensors (its token types) are."""
    add_processor("qwen3_5", tiny_image_text_config("qwen3_5"), tmp_path / "qwen3_5")
    write_shape_records(tmp_path, 1)
    [record] = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    with processor_without_torchvision():
        processor = transformers.AutoProcessor.from_pretrained(tmp_path / "qwen3_5")
        images = open_images(record, str(tmp_path), "data.dataset")
        question = record["messages"][0]["content"][1]
        for words in range(80):  # a question of as many words as make the record 96 tokens long
            question["text"] = "What is this?" + " a" * words
            if len(render(processor, record["messages"], images)) == 96:
                break
        assert len(render(processor, record["messages"], images)) == 96  # else the row proves nothing
        (tmp_path / "long.jsonl").write_text(json.dumps(record) + "\n")
        cfg = data(tmp_path / "qwen3_5", tmp_path / "long.jsonl", seq_len=128)
        _, batches = build_image_batches(
            cfg, TrainConfig(global_batch_size=1, micro_batch_size=1), 0, 1, True
        )
        [batch] = batches.micro_batches(0)
    assert batch.input_ids.shape == batch.images["mm_token_type_ids"].shape == (1, 95)
    assert batch.images["pixel_values"].shape == (16, 96)
    assert batch.images["image_grid_thw"].tolist() == [[1, 4, 4]]


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda r: r["images"].append(r["images"][0]), "1 image parts in its messages but 2 images"),
        (lambda r: r.update(images=["images/missing.png"]), "cannot be opened"),
        (lambda r: r.update(videos=["clip.mp4"]), "a record holds 'videos' inputs, which the recipes do not"),
        (lambda r: r["messages"][0]["content"].append({"type": "audio"}), "a record holds 'audio' inputs"),
    ],
)
def test_records_that_do_not_match_their_images_are_one_line(release, tmp_path, change, says):
    write_shape_records(tmp_path, 2)
    records = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    change(records[1])
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = data(release, tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match=says) as error:
        build_image_batches(cfg, TrainConfig(global_batch_size=2, micro_batch_size=1), 0, 1, True)
    assert str(error.value).startswith("data.dataset: ") and "\n" not in str(error.value)


def test_the_real_image_text_config_passes_the_recipes_checks_on_8_ranks():
    """configs/gemma3_vl_sft.json (Gemma 3 4B on TRL's image-text SFT records from the hub, not downloaded
    here): every key is known and its sizes pass pretrain_fsdp.py's checks on 8 ranks, FSDP over all 8."""
    import os

    from arch_matrix import load_script

    from common.ops.config_sources import load_config
    from launch import REPO

    cfg = load_config(os.path.join(REPO, "configs", "gemma3_vl_sft.json"))
    assert load_script("pretrain_fsdp").check_config(cfg, 8) == (1, 8, 8)


def test_the_bundled_gemma_3_4b_architecture_builds_the_release_at_its_size():
    """configs/hub's copy of google/gemma-3-4b-it's config.json, which the planner reads for
    configs/gemma3_vl_sft.json: the release's class at 4,300,079,472 parameters (the model card's 4.3B), its
    vision tower a SigLIP of 27 layers at 896 px."""
    import os

    from common.config import ModelConfig
    from common.model import build_meta_model, load_model_config
    from launch import REPO

    cfg = ModelConfig(name_or_path=os.path.join(REPO, "configs", "hub", "google--gemma-3-4b-it"))
    model = build_meta_model(load_model_config(cfg), cfg)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert sum(p.numel() for p in model.parameters()) == 4_300_079_472
    vision = model.config.vision_config
    assert (vision.num_hidden_layers, vision.image_size, model.config.mm_tokens_per_image) == (27, 896, 256)


def test_streamed_records_are_each_ranks_part_in_order_and_resume_at_the_next_record(
    release, tmp_path, capsys
):
    """data.streaming=true: a data-parallel rank's micro-batch is the processor's output for its part of the
    stream (every second record of one file on 2 ranks), in order; a record longer than a row, or with no
    answer, is passed over and said once; the saved position resumes at the next record, and only on as
    many ranks."""
    from PIL import Image

    from common.data.train_batches import build_batches

    write_shape_records(tmp_path, 12)
    lines = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    lines[4]["messages"][0]["content"][1]["text"] += " Look closely." * 20  # rank 0's third: too long
    lines[6]["messages"] = lines[6]["messages"][:1]  # and its fourth: no answer
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = data(release, tmp_path / "train.jsonl", streaming=True)
    t = TrainConfig(global_batch_size=4, micro_batch_size=2)
    ranks = [build_batches(cfg, t, rank, 2, rank == 0) for rank in range(2)]
    processor = ranks[0][0]

    def processed(indices: list[int]) -> dict:
        records = [lines[i] for i in indices]
        return processor(
            text=[processor.apply_chat_template(r["messages"], tokenize=False) for r in records],
            images=[[Image.open(tmp_path / r["images"][0]).convert("RGB")] for r in records],
            padding="longest",
            padding_side="right",
            add_special_tokens=False,
            return_tensors="pt",
        )

    def assert_is(batch, indices: list[int]) -> None:
        out = processed(indices)
        assert torch.equal(batch.input_ids, out["input_ids"][:, :-1]), indices
        assert torch.equal(batch.images["pixel_values"], out["pixel_values"]), indices
        for labels, i in zip(batch.labels, indices):
            answer = processor.tokenizer.decode(labels[labels != -100])
            assert answer == f"{lines[i]['messages'][1]['content'][0]['text']}<|eos|>"

    for (_, batches), first in zip(ranks, ([0, 2], [1, 3])):
        [batch] = batches.micro_batches(0)
        assert_is(batch, first)
    states = [batches.state_dict() for _, batches in ranks]
    [second] = ranks[0][1].micro_batches(4)
    assert_is(second, [8, 10])  # records 4 and 6 passed over
    assert capsys.readouterr().out.count("is passed over (said once)") == 1
    resumed = build_batches(cfg, t, 0, 2, True)[1]
    resumed.load_state_dict(states)
    [again] = resumed.micro_batches(4)
    assert_is(again, [8, 10])
    with pytest.raises(ConfigError, match="checkpointed on 2 data-parallel ranks; a stream resumes only"):
        build_batches(cfg, TrainConfig(global_batch_size=4, micro_batch_size=4), 0, 1, True)[
            1
        ].load_state_dict(states)
