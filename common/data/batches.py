"""Tokenizer, datasets, packing and per-rank batches. Rank 0 tokenizes local data once into a cached
`[samples, seq_len + 1]` array that every rank memory-maps; step s uses samples [s*B, (s+1)*B), shuffled by
seed alone, so the math does not change with the world size and a run resumes anywhere."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from common.config import ConfigError, DataConfig
from common.data.checks import check_records, text_needs
from common.data.embedded import (
    EMBEDDED_CORPUS,
    builds_caches,
    embedded_documents,
    embedded_tokenizer_dir,
    temporary_name,
)
from common.data.files import file_fingerprint, load_local, local_files, open_stream

PAD = -1  # padding inside the cached array; it becomes pad_token_id in inputs and -100 in labels
# DataConfig fields that do not change the token array, so are not in its cache key.
NOT_CACHED = ("eval_dataset", "eval_split", "streaming", "document_mask", "cache_dir")


def _cache_key(cfg: DataConfig, extra: str) -> str:
    fields = {k: v for k, v in vars(cfg).items() if k not in NOT_CACHED}
    text = json.dumps(fields, sort_keys=True) + EMBEDDED_CORPUS + extra
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_tokenizer(cfg: DataConfig):
    from transformers import AutoTokenizer

    if cfg.tokenizer is None:
        return AutoTokenizer.from_pretrained(embedded_tokenizer_dir(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a damaged file, named before the parser fails
        path = os.path.join(cfg.tokenizer, name)
        try:
            with open(path) as f:
                json.load(f)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"data.tokenizer {cfg.tokenizer!r} is damaged: {path} is unreadable ({e})"
            ) from None
    try:
        return AutoTokenizer.from_pretrained(cfg.tokenizer)
    except Exception as e:  # OSError when missing; the tokenizers library's own errors when damaged
        raise ConfigError(
            f"data.tokenizer {cfg.tokenizer!r} could not be loaded ({str(e).splitlines()[0]}); "
            f"give a local tokenizer directory or a reachable hub id"
        ) from None


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _pack(token_lists: list[list[int]], eos_id: int, seq_len: int, pack: bool) -> np.ndarray:
    """[N, seq_len + 1] rows: documents joined by EOS, or one padded document per row."""
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


def text_column(ds, cfg: DataConfig, source) -> list[str]:
    if cfg.text_field not in ds.column_names:
        raise ConfigError(f"data.text_field is {cfg.text_field!r} but {source} has columns {ds.column_names}")
    return list(ds[cfg.text_field])


def pack_documents(documents: list[str], tokenizer, cfg: DataConfig, key: str, source) -> np.ndarray:
    """Tokenized and packed (or padded) rows; `key` and `source` name the dataset in the error."""
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    rows = _pack(ids, tokenizer.eos_token_id, cfg.seq_len, cfg.pack)
    if len(rows) == 0:
        raise ConfigError(
            f"{key} {source!r} yields no sample of data.seq_len={cfg.seq_len} tokens; "
            f"lower data.seq_len or add data"
        )
    return rows


def _tokenize(cfg: DataConfig, files: list[str] | None) -> np.ndarray:
    if cfg.dataset == "embedded":
        documents = embedded_documents(cfg.embedded_max_bytes)
    else:
        check_records(files, "data.dataset", text_needs(cfg.text_field))
        documents = text_column(load_local(files, cfg.split), cfg, cfg.dataset)
    return pack_documents(documents, load_tokenizer(cfg), cfg, "data.dataset", cfg.dataset)


def prepare_local_data(cfg: DataConfig, is_main: bool, build=None, tag: str = "") -> str:
    """Each node's first rank builds (or finds) the cached token array; returns its path. build(): the
    array (default: pretraining's packed documents); tag tells its cache apart."""
    files = None if cfg.dataset == "embedded" else local_files(cfg.dataset)
    if build is None and cfg.dataset != "embedded" and files is None:
        raise ConfigError(
            f"data.dataset {cfg.dataset!r} matches no local file; for a hub dataset set data.streaming=true"
        )
    key = _cache_key(cfg, (file_fingerprint(files) if files else "") + tag)
    tokens_path = os.path.join(os.path.expanduser(cfg.cache_dir), f"tokens-{key}.npy")
    error = None
    if builds_caches(is_main) and not os.path.exists(tokens_path):
        try:
            rows = build() if build else _tokenize(cfg, files)
            os.makedirs(os.path.dirname(tokens_path), exist_ok=True)
            tmp = f"{temporary_name(tokens_path)}.npy"
            np.save(tmp, rows)
            os.replace(tmp, tokens_path)
        except ConfigError as e:
            error = str(e)
    if dist.is_initialized():
        # Every builder's verdict reaches every rank: a bad dataset stops them all instead of leaving them
        # at a barrier, and no rank reads before its node's builder has written.
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, error)
        error = next((v for v in verdicts if v), None)
    if error:
        raise ConfigError(error)
    return tokens_path


@dataclass
class Batch:
    input_ids: torch.Tensor  # [micro_batch, seq_len]
    labels: torch.Tensor  # [micro_batch, seq_len], -100 where no loss is taken
    position_ids: torch.Tensor | None = None  # restart at 0 per packed example (SFT) or document
    token_mask: torch.Tensor | None = None  # SFT: True for real tokens, False for padding
    images: dict[str, torch.Tensor] | None = None  # image-text rows: the processor's pixel values and grids

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor | None]:
        """The forward's inputs on `device`: token and position ids, and an image-text row's image inputs."""
        position_ids = None if self.position_ids is None else self.position_ids.to(device)
        images = {name: value.to(device) for name, value in (self.images or {}).items()}
        return {"input_ids": self.input_ids.to(device), "position_ids": position_ids, **images}


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids that restart after every EOS: Transformers (and common/cp.py under CP) then keeps each
    packed document's attention inside it."""
    index = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def to_batch(rows: np.ndarray, pad_id: int, document_eos: int | None) -> Batch:
    """[N, seq_len + 1] rows as a Batch: inputs and labels shifted by one, PAD out of both."""
    rows = torch.from_numpy(rows.astype(np.int64))
    inputs, labels = rows[:, :-1].clone(), rows[:, 1:].clone()
    inputs[inputs == PAD] = pad_id
    labels[labels == PAD] = -100
    documents = None if document_eos is None else document_positions(inputs, document_eos)
    return Batch(inputs, labels, position_ids=documents)


@dataclass(eq=False)
class LocalBatches:
    """Deterministic, world-size-independent micro-batches for one data-parallel rank."""

    tokens_path: str
    pad_id: int
    seed: int
    global_batch: int
    micro_batch: int
    dp_rank: int
    dp_size: int
    document_eos: int | None = None

    def __post_init__(self):
        self.rows = np.load(self.tokens_path, mmap_mode="r")
        self._epoch, self._perm = -1, None

    def _row(self, position: int) -> np.ndarray:
        epoch, index = divmod(position, len(self.rows))
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng(self.seed + epoch).permutation(len(self.rows))
        return self.rows[self._perm[index]]

    def micro_batches(self, first_sample: int) -> list[Batch]:
        per_rank = self.global_batch // self.dp_size
        start = first_sample + self.dp_rank * per_rank
        out = []
        for m in range(start, start + per_rank, self.micro_batch):
            out.append(self._batch(np.stack([self._row(p) for p in range(m, m + self.micro_batch)])))
        return out

    def state_dict(self) -> dict:
        return {}  # the position is the global sample count, which the training loop saves

    def load_state_dict(self, states: list[dict]) -> None:
        pass

    def fixed_batch(self, size: int) -> Batch:
        """The first rows, unshuffled: a batch anyone can rebuild to check a model."""
        return self._batch(np.asarray(self.rows[:size]))

    def _batch(self, rows: np.ndarray) -> Batch:
        return to_batch(rows, self.pad_id, self.document_eos)


def own_stream_state(states: list[dict], dp_rank: int, dp_size: int) -> dict:
    """This data-parallel rank's saved stream, of every rank's state_dict(). The ranks of a context-parallel
    group read one stream and save the same state, so the states are keyed by data-parallel rank."""
    streams = {state.get("dp_rank", rank): state for rank, state in enumerate(states)}
    if len(streams) != dp_size:
        raise ConfigError(
            f"this streaming run was checkpointed on {len(streams)} data-parallel ranks; a stream "
            f"resumes only on the same number (use local files to resume on another world size)"
        )
    return streams[dp_rank]


class StreamingBatches:
    """Streamed and packed on the fly; each rank reads its own part, so batches depend on the world size."""

    def __init__(
        self, cfg: DataConfig, tokenizer, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int
    ):
        self.dataset = open_stream(cfg, dp_rank, dp_size)
        self.stream = iter(self.dataset)
        self.tokenizer, self.cfg = tokenizer, cfg
        self.accum = global_batch // (micro_batch * dp_size)
        self.micro_batch, self.dp_rank, self.dp_size = micro_batch, dp_rank, dp_size
        self.document_eos = tokenizer.eos_token_id if cfg.document_mask else None
        self.buffer: list[int] = []

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
        dataset = self.dataset.state_dict()
        return {"dataset": dataset, "buffer": self.buffer, "dp_rank": self.dp_rank}

    def load_state_dict(self, states: list[dict]) -> None:
        mine = own_stream_state(states, self.dp_rank, self.dp_size)
        self.dataset.load_state_dict(mine["dataset"])
        self.stream = iter(self.dataset)
        self.buffer = mine["buffer"]

    def micro_batches(self, first_sample: int) -> list[Batch]:
        out = []
        for _ in range(self.accum):
            rows = np.array([self._next_row() for _ in range(self.micro_batch)])
            out.append(to_batch(rows, PAD, self.document_eos))  # streamed rows hold no PAD
        return out
