"""The held-out set: the first eval.max_sequences rows of data.eval_dataset, unshuffled (a checkpoint's
evaluation without one: of data.dataset), and each data-parallel rank's batches of them. Evaluation during
training and of a checkpoint read these same rows, so either can check the other's numbers."""

from __future__ import annotations

import numpy as np

from common.config import ConfigError, DataConfig, EvalConfig
from common.data.batches import Batch, pack_documents, pad_token_id, prepare_local_data, text_column, to_batch
from common.data.checks import check_records, held_out_source, text_needs
from common.data.embedded import embedded_documents
from common.data.files import file_fingerprint, load_local, local_files
from common.data.image_records import has_images, held_out_image_batches
from common.data.sft import is_sft, sft_batch, sft_rows_path


def held_out_rows(cfg: DataConfig, e: EvalConfig, tokenizer, is_main: bool) -> Batch:
    """All held-out rows as one Batch: labels shifted on the full row; SFT rows with answer-only labels and
    position ids restarting per example; text rows with per-document position ids under data.document_mask."""
    key, source, split = held_out_source(cfg)
    if is_sft(source, cfg.text_field, split):
        rows = np.load(sft_rows_path(cfg, tokenizer, source, split, is_main, key), mmap_mode="r")
        return sft_batch(np.asarray(rows[: e.max_sequences]))
    if cfg.eval_dataset:
        files = local_files(source) if source != "embedded" else None
        tag = f"held-out-{source}-{split}-{file_fingerprint(files) if files else ''}"
        build = lambda: pack_documents(_documents(cfg, source, split, files), tokenizer, cfg, key, source)  # noqa: E731
        path = prepare_local_data(cfg, is_main, build, tag=tag)
    else:  # the training cache of data.dataset: what checkpoints were scored on before data.eval_dataset
        path = prepare_local_data(cfg, is_main)
    rows = np.asarray(np.load(path, mmap_mode="r")[: e.max_sequences])
    return to_batch(rows, pad_token_id(tokenizer), tokenizer.eos_token_id if cfg.document_mask else None)


def _documents(cfg: DataConfig, source, split: str, files: list[str] | None) -> list[str]:
    if source == "embedded":
        documents = embedded_documents(cfg.embedded_max_bytes, held_out=True)
        if not documents:
            raise ConfigError(
                f"data.eval_dataset is 'embedded' but data.embedded_max_bytes ({cfg.embedded_max_bytes}) "
                f"leaves no file after the training slice; lower data.embedded_max_bytes"
            )
        return documents
    if files:
        check_records(files, "data.eval_dataset", text_needs(cfg.text_field))
        return text_column(load_local(files, "train"), cfg, source)
    import datasets

    try:
        return text_column(datasets.load_dataset(source, split=split), cfg, source)
    except (OSError, ValueError) as e:  # the hub client's "cannot get this dataset"
        raise ConfigError(
            f"data.eval_dataset {source!r} is neither local files nor a loadable hub dataset (split "
            f"{split!r}: {str(e).splitlines()[0]}); give local files, 'embedded', 'arithmetic' or a "
            f"reachable hub name"
        ) from None


def rank_batches(rows: Batch, batch_size: int, dp_rank: int, dp_size: int) -> list[Batch]:
    """This data-parallel rank's batches: its batch_size rows of each dp_size * batch_size. Each forward is a
    collective, so every rank runs as many; past the last row a rank scores row 0 with no labels."""
    batches = []
    for first in range(0, len(rows.labels), dp_size * batch_size):
        index = [first + dp_rank * batch_size + i for i in range(batch_size)]
        taken = [i if i < len(rows.labels) else 0 for i in index]
        labels = rows.labels[taken].clone()
        labels[[j for j, i in enumerate(index) if i >= len(rows.labels)]] = -100
        pick = lambda t: None if t is None else t[taken]  # noqa: E731
        batches.append(Batch(rows.input_ids[taken], labels, pick(rows.position_ids), pick(rows.token_mask)))
    return batches


def held_out_batches(cfg: DataConfig, e: EvalConfig, tokenizer, dp_rank: int, dp_size: int, is_main: bool):
    """This data-parallel rank's batches of the held-out rows."""
    key, source, split = held_out_source(cfg)
    if has_images(source, split):  # rendered by the release's processor, a micro-batch at a time
        return held_out_image_batches(cfg, e, source, split, key, dp_rank, dp_size, is_main)
    return rank_batches(held_out_rows(cfg, e, tokenizer, is_main), e.batch_size, dp_rank, dp_size)
