"""This rank's training batches of data.dataset, by what it holds: packed text, SFT rows trained on the
answers only, or image-text rows; read whole or streamed."""

from __future__ import annotations

from common.config import DataConfig, TrainConfig
from common.data import image_records, image_stream, sft
from common.data.batches import (
    LocalBatches,
    StreamingBatches,
    load_tokenizer,
    pad_token_id,
    prepare_local_data,
)
from common.data.checks import check_vocab_size
from common.data.embedded import ensure_embedded_tokenizer


def build_batches(
    cfg: DataConfig, t: TrainConfig, dp_rank: int, dp_size: int, is_main: bool, vocab_size: int | None = None
):
    """(tokenizer, this rank's batches of train.global_batch_size and train.micro_batch_size): packed text,
    SFT rows trained on the answers only, or image-text rows (then the release's processor, not its
    tokenizer). The tokenizer must fit the model's `vocab_size`, if given."""
    if image_records.has_images(cfg.dataset, cfg.split):
        build = (
            image_stream.build_streaming_image_batches if cfg.streaming else image_records.build_image_batches
        )
        tokenizer, batches = build(cfg, t, dp_rank, dp_size, is_main)
    elif not cfg.streaming and sft.is_sft(cfg.dataset, cfg.text_field, cfg.split):
        return sft.build_sft_batches(cfg, t, dp_rank, dp_size, is_main, vocab_size)
    else:
        tokenizer, batches = _text_batches(cfg, t, dp_rank, dp_size, is_main)
    if vocab_size is not None:
        check_vocab_size(getattr(tokenizer, "tokenizer", tokenizer), vocab_size)  # a processor's tokenizer
    return tokenizer, batches


def _text_batches(cfg: DataConfig, t: TrainConfig, dp_rank: int, dp_size: int, is_main: bool):
    seed, global_batch, micro_batch = t.seed, t.global_batch_size, t.micro_batch_size
    ensure_embedded_tokenizer(cfg, is_main)
    if cfg.streaming:
        tokenizer = load_tokenizer(cfg)
        return tokenizer, StreamingBatches(cfg, tokenizer, global_batch, micro_batch, dp_rank, dp_size)
    tokens_path = prepare_local_data(cfg, is_main)
    tokenizer = load_tokenizer(cfg)
    document_eos = tokenizer.eos_token_id if cfg.document_mask else None
    return tokenizer, LocalBatches(
        tokens_path, pad_token_id(tokenizer), seed, global_batch, micro_batch, dp_rank, dp_size, document_eos
    )
