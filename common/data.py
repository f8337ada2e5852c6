"""Tokenizer, dataset loading, packing and per-rank batches.

Local data (the embedded corpus or json/jsonl/parquet/txt files) is tokenized once by rank 0 into a
cached `[num_samples, seq_len + 1]` int32 array that every rank memory-maps. Sample k of the run is a
pure function of (seed, k), and step s uses samples [s*B, (s+1)*B) whatever the world size, so the
math does not change with the number of ranks and the position can be resumed anywhere.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from common.config import ConfigError, DataConfig
from common.embedded import (
    EMBEDDED_CORPUS,
    embedded_documents,
    embedded_tokenizer_dir,
    ensure_embedded_tokenizer,
)

PAD = -1  # marks padding inside the cached array; it becomes pad_token_id in inputs and -100 in labels
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


def _cache_key(cfg: DataConfig, extra: str) -> str:
    fields = {
        k: getattr(cfg, k)
        for k in (
            "dataset",
            "dataset_config",
            "split",
            "text_field",
            "tokenizer",
            "seq_len",
            "embedded_max_bytes",
            "embedded_vocab_size",
            "pack",
        )
    }
    return hashlib.sha256(
        (json.dumps(fields, sort_keys=True) + EMBEDDED_CORPUS + extra).encode()
    ).hexdigest()[:16]


def local_files(dataset: str | list) -> list[str] | None:
    """The local files a `data.dataset` value names (paths or globs), or None if it names none."""
    patterns = dataset if isinstance(dataset, list) else [dataset]
    files = sorted(f for p in patterns for f in glob.glob(os.path.expanduser(p)))
    if not files:
        return None
    exts = {os.path.splitext(f)[1] for f in files}
    if len(exts) != 1 or exts.pop() not in LOCAL_FORMATS:
        raise ConfigError(
            f"data.dataset {dataset!r} matches files of types "
            f"{sorted({os.path.splitext(f)[1] for f in files})}; "
            f"use one of {', '.join(LOCAL_FORMATS)}"
        )
    return files


def file_fingerprint(files: list[str]) -> str:
    return json.dumps([(f, os.path.getsize(f), int(os.path.getmtime(f))) for f in files])


def load_tokenizer(cfg: DataConfig):
    from transformers import AutoTokenizer

    if cfg.tokenizer is None:
        return AutoTokenizer.from_pretrained(embedded_tokenizer_dir(cfg))
    try:
        return AutoTokenizer.from_pretrained(cfg.tokenizer)
    except OSError as e:
        raise ConfigError(
            f"data.tokenizer {cfg.tokenizer!r} could not be loaded ({str(e).splitlines()[0]}); "
            f"give a local tokenizer directory or a reachable hub id"
        ) from None


def _documents(cfg: DataConfig, files: list[str] | None) -> list[str]:
    if cfg.dataset == "embedded":
        return embedded_documents(cfg.embedded_max_bytes)
    import datasets

    ds = datasets.load_dataset(
        LOCAL_FORMATS[os.path.splitext(files[0])[1]], data_files=files, split=cfg.split
    )
    if cfg.text_field not in ds.column_names:
        raise ConfigError(
            f"data.text_field is {cfg.text_field!r} but {cfg.dataset} has columns {ds.column_names}"
        )
    return list(ds[cfg.text_field])


def _pack(token_lists: list[list[int]], eos_id: int, seq_len: int, pack: bool) -> np.ndarray:
    """[N, seq_len + 1] rows: concatenated documents with EOS between them, or one padded document per row."""
    if pack:
        stream = np.fromiter((t for ids in token_lists for t in (*ids, eos_id)), dtype=np.int32)
        n = (len(stream) - 1) // seq_len
        # Rows overlap by one token so every token is a target exactly once.
        return np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)[::seq_len][:n].copy()
    rows = np.full((len(token_lists), seq_len + 1), PAD, dtype=np.int32)
    for i, ids in enumerate(token_lists):
        ids = (ids + [eos_id])[: seq_len + 1]
        rows[i, : len(ids)] = ids
    return rows


def prepare_local_data(cfg: DataConfig, is_main: bool, build=None, tag: str = "") -> str:
    """Rank 0 builds (or finds) the token array in the cache; returns the array's path.

    build() returns the array (default: pretraining's packed documents); tag tells its cache apart.
    """
    files = None if cfg.dataset == "embedded" else local_files(cfg.dataset)
    if build is None and cfg.dataset != "embedded" and files is None:
        raise ConfigError(
            f"data.dataset {cfg.dataset!r} matches no local file; for a hub dataset set data.streaming=true"
        )
    key = _cache_key(cfg, (file_fingerprint(files) if files else "") + tag)
    tokens_path = os.path.join(os.path.expanduser(cfg.cache_dir), f"tokens-{key}.npy")
    error = None
    if is_main and not os.path.exists(tokens_path):
        try:
            rows = build() if build else _tokenize(cfg, files)
            os.makedirs(os.path.dirname(tokens_path), exist_ok=True)
            tmp = f"{tokens_path}.tmp{os.getpid()}.npy"
            np.save(tmp, rows)
            os.replace(tmp, tokens_path)
        except ConfigError as e:
            error = str(e)
    if dist.is_initialized():
        # Rank 0 shares its verdict, so a bad dataset stops every rank instead of leaving them at a barrier.
        verdict = [error]
        dist.broadcast_object_list(verdict, src=0)
        error = verdict[0]
    if error:
        raise ConfigError(error)
    return tokens_path


def _tokenize(cfg: DataConfig, files: list[str] | None) -> np.ndarray:
    tokenizer = load_tokenizer(cfg)
    ids = tokenizer(_documents(cfg, files), add_special_tokens=False)["input_ids"]
    rows = _pack(ids, tokenizer.eos_token_id, cfg.seq_len, cfg.pack)
    if len(rows) == 0:
        raise ConfigError(
            f"data.dataset {cfg.dataset!r} yields no sample of data.seq_len={cfg.seq_len} tokens; "
            f"lower data.seq_len or add data"
        )
    return rows


@dataclass
class Batch:
    input_ids: torch.Tensor  # [micro_batch, seq_len]
    labels: torch.Tensor  # [micro_batch, seq_len], -100 where no loss is taken
    sample_ids: list[int]  # global sample positions, for tests and resumption
    # restart at 0 per packed example (SFT) or document (document_mask)
    position_ids: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None  # SFT: True for real tokens, False for padding


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids that restart after every EOS. Given these, each packed document attends only to itself:
    Transformers builds that mask from them in one process, and common/cp.py's attention does under CP."""
    index = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    return index - torch.where(starts, index, 0).cummax(dim=1).values


class LocalBatches:
    """Deterministic, world-size-independent micro-batches for one data-parallel rank."""

    def __init__(
        self,
        tokens_path: str,
        pad_id: int,
        seed: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        document_eos: int | None = None,
    ):
        self.tokens_path = tokens_path
        self.rows = np.load(tokens_path, mmap_mode="r")
        self.pad_id, self.seed, self.document_eos = pad_id, seed, document_eos
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._epoch, self._perm = -1, None

    def _row(self, position: int) -> np.ndarray:
        epoch, index = divmod(position, len(self.rows))
        if epoch != self._epoch:  # reshuffle every pass over the data
            self._epoch, self._perm = (
                epoch,
                np.random.default_rng(self.seed + epoch).permutation(len(self.rows)),
            )
        return self.rows[self._perm[index]]

    def micro_batches(self, first_sample: int) -> list[Batch]:
        """This rank's share of the step whose global samples are [first_sample, first_sample + B)."""
        per_rank = self.global_batch // self.dp_size
        start = first_sample + self.dp_rank * per_rank
        out = []
        for m in range(0, per_rank, self.micro_batch):
            positions = list(range(start + m, start + m + self.micro_batch))
            out.append(self._batch(np.stack([self._row(p) for p in positions]), positions))
        return out

    def state_dict(self) -> dict:
        return {}  # the position is the global sample count, which the training loop saves

    def load_state_dict(self, states: list[dict], rank: int) -> None:
        pass

    def fixed_batch(self, size: int) -> Batch:
        """The first `size` rows of the data, unshuffled: a batch anyone can rebuild to check a model."""
        return self._batch(np.asarray(self.rows[:size]), [])

    def _batch(self, rows: np.ndarray, positions: list[int]) -> Batch:
        rows = torch.from_numpy(rows.astype(np.int64))
        inputs = rows[:, :-1].clone()
        inputs[inputs == PAD] = self.pad_id
        labels = rows[:, 1:].clone()
        labels[labels == PAD] = -100
        if self.document_eos is None:
            return Batch(inputs, labels, positions)
        return Batch(inputs, labels, positions, position_ids=document_positions(inputs, self.document_eos))


class StreamingBatches:
    """A dataset streamed and packed on the fly (a hub name, or local files); each rank reads its own part.

    Positions here are per rank, so unlike LocalBatches the batches depend on the world size.
    """

    def __init__(
        self, cfg: DataConfig, tokenizer, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int
    ):
        import datasets
        from datasets.distributed import split_dataset_by_node

        files = local_files(cfg.dataset)
        try:
            if files:
                ds = datasets.load_dataset(
                    LOCAL_FORMATS[os.path.splitext(files[0])[1]],
                    data_files=files,
                    split=cfg.split,
                    streaming=True,
                )
            else:
                ds = datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=cfg.split, streaming=True)
        except Exception as e:  # the hub client raises many types; all mean "cannot get this dataset"
            raise ConfigError(
                f"data.dataset {cfg.dataset!r} could not be streamed ({str(e).splitlines()[0]}); "
                f"check the name and network, or use local files"
            ) from None
        self.dataset = split_dataset_by_node(ds, rank=dp_rank, world_size=dp_size)
        self.stream = iter(self.dataset)
        self.tokenizer, self.cfg = tokenizer, cfg
        self.accum = global_batch // (micro_batch * dp_size)
        self.micro_batch, self.dp_size = micro_batch, dp_size
        self.buffer: list[int] = []
        self.consumed = 0

    def _next_text(self) -> str:
        try:
            return next(self.stream)[self.cfg.text_field]
        except StopIteration:  # a finite dataset: start another pass
            self.stream = iter(self.dataset)
            return next(self.stream)[self.cfg.text_field]

    def _next_row(self) -> list[int]:
        need = self.cfg.seq_len + 1
        while len(self.buffer) < need:
            ids = self.tokenizer(self._next_text(), add_special_tokens=False)["input_ids"]
            self.buffer.extend(ids + [self.tokenizer.eos_token_id])
        row, self.buffer = self.buffer[:need], self.buffer[need - 1 :]
        return row

    def state_dict(self) -> dict:
        return {"dataset": self.dataset.state_dict(), "buffer": self.buffer, "consumed": self.consumed}

    def load_state_dict(self, states: list[dict], rank: int) -> None:
        if len(states) != self.dp_size:
            raise ConfigError(
                f"this streaming run was checkpointed on {len(states)} data-parallel ranks; a stream "
                f"resumes only on the same number (use local files to resume on another world size)"
            )
        self.dataset.load_state_dict(states[rank]["dataset"])
        self.stream = iter(self.dataset)
        self.buffer, self.consumed = states[rank]["buffer"], states[rank]["consumed"]

    def micro_batches(self, first_sample: int) -> list[Batch]:
        out = []
        for _ in range(self.accum):
            rows = torch.tensor([self._next_row() for _ in range(self.micro_batch)])
            positions = list(range(self.consumed, self.consumed + self.micro_batch))
            self.consumed += self.micro_batch
            inputs = rows[:, :-1].clone()
            documents = (
                document_positions(inputs, self.tokenizer.eos_token_id) if self.cfg.document_mask else None
            )
            out.append(Batch(inputs, rows[:, 1:].clone(), positions, position_ids=documents))
        return out


def build_batches(
    cfg: DataConfig, seed: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, is_main: bool
):
    """(tokenizer, batches) for a run; batches.micro_batches(step) gives this rank's micro-batches."""
    ensure_embedded_tokenizer(cfg, is_main)
    if cfg.streaming:
        tokenizer = load_tokenizer(cfg)
        return tokenizer, StreamingBatches(cfg, tokenizer, global_batch, micro_batch, dp_rank, dp_size)
    tokens_path = prepare_local_data(cfg, is_main)
    tokenizer = load_tokenizer(cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    document_eos = tokenizer.eos_token_id if cfg.document_mask else None
    return tokenizer, LocalBatches(
        tokens_path, pad_id, seed, global_batch, micro_batch, dp_rank, dp_size, document_eos
    )
