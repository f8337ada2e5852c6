"""Where data comes from: local files (paths, globs) of one supported type, read whole or streamed, a hub
dataset streamed, and the files' fingerprint for caches."""

from __future__ import annotations

import glob
import json
import os

from common.config import ConfigError, DataConfig

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


def local_files(dataset: str | list) -> list[str] | None:
    """The files the paths or globs match, or None."""
    patterns = dataset if isinstance(dataset, list) else [dataset]
    files = sorted(f for p in patterns for f in glob.glob(os.path.expanduser(p)))
    if not files:
        return None
    exts = sorted({os.path.splitext(f)[1] for f in files})
    if len(exts) != 1 or exts[0] not in LOCAL_FORMATS:
        raise ConfigError(
            f"data.dataset {dataset!r} matches files of types {exts}; use one of {', '.join(LOCAL_FORMATS)}"
        )
    return files


def load_local(files: list[str], split: str, **kwargs):
    import datasets

    return datasets.load_dataset(
        LOCAL_FORMATS[os.path.splitext(files[0])[1]], data_files=files, split=split, **kwargs
    )


def file_fingerprint(files: list[str]) -> str:
    return json.dumps([(f, os.path.getsize(f), int(os.path.getmtime(f))) for f in files])


def open_stream(cfg: DataConfig, dp_rank: int, dp_size: int):
    """This data-parallel rank's part of data.dataset, streamed (local files or the hub)."""
    import datasets.distributed

    files = local_files(cfg.dataset)
    try:
        if files:
            ds = load_local(files, cfg.split, streaming=True)
        else:
            ds = datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=cfg.split, streaming=True)
    except Exception as e:  # the hub client raises many types; all mean "cannot get this dataset"
        raise ConfigError(
            f"data.dataset {cfg.dataset!r} could not be streamed ({str(e).splitlines()[0]}); "
            f"check the name and network, or use local files"
        ) from None
    return datasets.distributed.split_dataset_by_node(ds, rank=dp_rank, world_size=dp_size)
