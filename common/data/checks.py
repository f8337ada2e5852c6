"""Local dataset files, checked before they are tokenized: a broken line or row, or a record without the
fields it needs, is one line naming the file and the line (or row), not the datasets library's traceback."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

from common.config import ConfigError, DataConfig, TrainConfig
from common.data.files import local_files

NEEDS = Callable[[dict], str | None]  # what a record lacks, or None


def text_needs(field: str) -> NEEDS:
    def needs(record: dict) -> str | None:
        if isinstance(record.get(field), str):
            return None
        return f"has no '{field}' text (its keys: {sorted(record)}); set data.text_field to the text's key"

    return needs


def sft_needs(record: dict) -> str | None:
    if isinstance(record.get("messages"), list):
        return None
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return None
    return f"has neither 'prompt' and 'completion' nor 'messages' (its keys: {sorted(record)})"


def check_records(files: list[str], key: str, needs: NEEDS | None) -> None:
    """Every record of every file parses and has what `needs` asks; `key` names the config key in errors."""
    for path in files:
        for where, record in _records(path, key):
            if needs is not None and (lack := needs(record)):
                raise ConfigError(f"{key}: {path}{where}: the record {lack}")


def _records(path: str, key: str) -> Iterator[tuple[str, dict]]:
    """(":line N" or " row N", record) for each record of a JSON, JSONL, Parquet or text file."""
    kind = os.path.splitext(path)[1]
    if kind == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's ArrowInvalid and friends: the file is cut or not Parquet
            raise ConfigError(
                f"{key}: {path} is not a readable Parquet file ({str(e).splitlines()[0]})"
            ) from None
        yield from ((f" row {i}", row) for i, row in enumerate(rows))
        return
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        line = open(path, "rb").read()[: e.start].count(b"\n") + 1
        raise ConfigError(f"{key}: {path}:{line}: not UTF-8 text ({e.reason})") from None
    if kind in (".txt", ".text"):
        return  # every line is a document
    if kind == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key}: {path}:{e.lineno}: not valid JSON ({e.msg})") from None
        yield from ((f" record {i}", r) for i, r in enumerate(records))
        return
    for number, line in enumerate(text.splitlines(), start=1):  # JSON lines
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{key}: {path}:{number}: not valid JSON ({e.msg}); fix or remove that line"
            ) from None
        if not isinstance(record, dict):
            raise ConfigError(f"{key}: {path}:{number}: not a JSON object")
        yield f":{number}", record


def check_batch_sizes(t: TrainConfig, dp_size: int) -> None:
    if t.global_batch_size % (t.micro_batch_size * dp_size):
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) is not a multiple of micro_batch_size "
            f"({t.micro_batch_size}) x data-parallel size ({dp_size}); make it a multiple of "
            f"{t.micro_batch_size * dp_size}"
        )


def check_vocab_size(tokenizer, vocab_size: int) -> None:
    """Token ids past the embedding table would fail deep inside the first forward. The largest id, not the
    count: added tokens can sit past the base vocabulary, leaving gaps."""
    largest = max(max(tokenizer.get_vocab().values()), len(tokenizer) - 1)
    if largest >= vocab_size:
        raise ConfigError(
            f"the tokenizer's ids reach {largest} but the model's vocab_size is {vocab_size}; use the "
            f"model's own tokenizer (data.tokenizer), or for a new model set model.config.vocab_size >= "
            f"{largest + 1}"
        )


def held_out_source(cfg: DataConfig) -> tuple[str, str | list, str]:
    """(its config key, the held-out dataset, its split): data.eval_dataset, or else data.dataset."""
    if cfg.eval_dataset:
        return "data.eval_dataset", cfg.eval_dataset, cfg.eval_split
    return "data.dataset", cfg.dataset, cfg.split


def check_split_keys(cfg: DataConfig) -> None:
    """data.split, eval_split and dataset_config choose among a hub dataset's splits and configs (the
    "arithmetic" task has a train split and a held-out one). The embedded corpus and local files have one of
    each, so there they would be ignored: they are errors, before any work."""

    def chooses(source, configs: bool = False) -> bool:
        fixed = ("embedded", "arithmetic") if configs else ("embedded",)
        return source is not None and source not in fixed and local_files(source) is None

    for key, default, (name, source), noun in (
        ("split", "train", ("dataset", cfg.dataset), "splits"),
        ("eval_split", "test", ("eval_dataset", cfg.eval_dataset), "splits"),
        ("dataset_config", None, ("dataset", cfg.dataset), "configs"),
    ):
        value = getattr(cfg, key)
        if value != default and not chooses(source, configs=noun == "configs"):
            raise ConfigError(
                f"data.{key} is {value!r} but data.{name} {source!r} has no {noun} to choose from (the "
                f"embedded corpus and local files have one, 'arithmetic' a train and a held-out split); "
                f"remove it"
            )
