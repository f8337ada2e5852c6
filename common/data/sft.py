"""Supervised fine-tuning data: prompt/completion or chat records -> rows trained only on the answers,
batched by pretraining's sampler. Position ids restart at 0 for each packed example, which Transformers (with
no attention mask) turns into a block-diagonal causal mask."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from common.config import ConfigError, DataConfig, TrainConfig
from common.data.batches import Batch, LocalBatches, load_tokenizer, pad_token_id, prepare_local_data
from common.data.checks import check_records, check_vocab_size, sft_needs
from common.data.embedded import ensure_embedded_tokenizer
from common.data.files import LOCAL_FORMATS, file_fingerprint, load_local, local_files

ARITHMETIC = "arithmetic"  # the built-in task: "17+25=" -> "42"


def arithmetic_examples(split: str) -> list[dict]:
    """Every a+b and a-b with a, b < 100; any split but "train" is the held-out tenth."""
    problems = [(a, op, b) for a in range(100) for b in range(100) for op in "+-"]
    random.Random(0).shuffle(problems)
    held_out = len(problems) // 10
    chosen = problems[held_out:] if split == "train" else problems[:held_out]
    return [
        {"prompt": f"{a}{op}{b}=", "completion": str(a + b if op == "+" else a - b)} for a, op, b in chosen
    ]


def is_sft(source: str | list, text_field: str, split: str = "train") -> bool:
    """Whether `source` holds SFT records (prompt and completion, or chat messages) rather than text: the
    built-in task, or local files or a hub dataset (its `split`) whose first record has those keys and no
    text_field."""
    if source == ARITHMETIC:
        return True
    if source == "embedded":
        return False
    first = first_record(source, split)
    return text_field not in first and ("messages" in first or {"prompt", "completion"} <= set(first))


def first_record(source: str | list, split: str) -> dict:
    """The first record of local files or a hub dataset's `split`; {} for text files or what cannot be read
    here (the text path then reports it, with its own message)."""
    files = local_files(source)
    if files and LOCAL_FORMATS[os.path.splitext(files[0])[1]] == "text":
        return {}
    try:
        if files:
            return next(iter(load_local(files, "train", streaming=True)), {})
        import datasets

        whole = split.split("[")[0]  # a stream has no slices ("train[:1000]"); its first record is the same
        return next(iter(datasets.load_dataset(source, split=whole, streaming=True)), {})
    except Exception:  # the hub client and the file readers raise many types
        return {}


def _read_examples(source: str | list, split: str, key: str) -> list[dict]:
    if source == ARITHMETIC:
        return arithmetic_examples(split)
    files = local_files(source)
    if files:
        check_records(files, key, sft_needs)
        return list(load_local(files, "train"))
    import datasets

    try:
        return list(datasets.load_dataset(source, split=split))
    except Exception as e:  # the hub client raises many types; all mean "cannot get this dataset"
        raise ConfigError(
            f"SFT dataset {source!r} is neither local files nor a loadable hub dataset (split "
            f"{split!r}: {str(e).splitlines()[0]}); give JSONL files, '{ARITHMETIC}', or a reachable "
            f"hub name"
        ) from None


def _chat_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Answer flags on the tokens each assistant turn adds to the rendered conversation, so any chat template
    works without {% generation %} markers."""

    def render(msgs, prompt):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=prompt, tokenize=True)["input_ids"]

    ids = render(messages, False)
    answer = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, through = len(render(messages[:i], True)), render(messages[: i + 1], False)
        if ids[: len(through)] != through:
            raise ConfigError(
                "the tokenizer's chat template renders a conversation differently from its prefixes, "
                "so assistant tokens cannot be located; use prompt/completion records instead"
            )
        answer[start : len(through)] = [1] * (len(through) - start)
    return ids, answer


def tokenize_example(tokenizer, example: dict) -> tuple[list[int], list[int]]:
    if "messages" in example:
        if tokenizer.chat_template is None:
            raise ConfigError(
                "data.dataset has chat 'messages' but the tokenizer has no chat template; set "
                "data.tokenizer to one that has, or use prompt/completion records"
            )
        return _chat_tokens(tokenizer, example["messages"])
    if "prompt" not in example or "completion" not in example:
        raise ConfigError(
            f"an SFT record has keys {sorted(example)}; give 'prompt' and 'completion', or 'messages'"
        )
    if tokenizer.chat_template is not None:
        user = {"role": "user", "content": example["prompt"]}
        return _chat_tokens(tokenizer, [user, {"role": "assistant", "content": example["completion"]}])
    prompt = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
    completion = tokenizer(example["completion"], add_special_tokens=False)["input_ids"]
    completion.append(tokenizer.eos_token_id)
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def build_rows(
    examples: list[tuple[list[int], list[int]]], seq_len: int, pack: bool, pad_id: int
) -> np.ndarray:
    """[N, 4, seq_len]: input ids, labels (-100 but on answers), position ids, 1 for real tokens."""
    rows, current = [], []

    def flush():
        row = np.zeros((4, seq_len), dtype=np.int32)
        row[0], row[1] = pad_id, -100
        used = 0
        for ids, answer in current:
            n = len(ids) - 1  # an example of n+1 tokens gives n (input, next token) pairs
            row[0, used : used + n] = ids[:-1]
            row[1, used : used + n] = np.where(np.asarray(answer[1:]) == 1, ids[1:], -100)
            row[2, used : used + n] = np.arange(n)
            used += n
        row[2, used:] = np.arange(seq_len - used)  # padding is its own segment
        row[3, :used] = 1
        rows.append(row)
        current.clear()

    for ids, answer in examples:
        ids, answer = ids[: seq_len + 1], answer[: seq_len + 1]  # too long: keep the first seq_len targets
        if len(ids) < 2 or not any(answer[1:]):
            continue
        if current and (not pack or sum(len(i) - 1 for i, _ in current) + len(ids) - 1 > seq_len):
            flush()
        current.append((ids, answer))
    if current:
        flush()
    return np.stack(rows) if rows else np.zeros((0, 4, seq_len), dtype=np.int32)


def sft_rows_path(
    cfg: DataConfig, tokenizer, source: str | list, split: str, is_main: bool, key: str = "data.dataset"
) -> str:
    """The cached [N, 4, seq_len] rows of build_rows for `source`; `key` names it in errors."""

    def build() -> np.ndarray:
        examples = [tokenize_example(tokenizer, e) for e in _read_examples(source, split, key)]
        rows = build_rows(examples, cfg.seq_len, cfg.pack, pad_token_id(tokenizer))
        if len(rows) == 0:
            raise ConfigError(
                f"{key} {source!r} has no example with an answer token within data.seq_len="
                f"{cfg.seq_len}; raise data.seq_len or check the records"
            )
        return rows

    files = local_files(source) if source != ARITHMETIC else None
    tag = f"sft-{source}-{split}-{tokenizer.name_or_path}-{file_fingerprint(files) if files else ''}"
    return prepare_local_data(cfg, is_main, build, tag=tag)


def sft_batch(rows: np.ndarray) -> Batch:
    """Rows of build_rows as a Batch: input ids, labels, restarting position ids, the real-token mask."""
    rows = torch.from_numpy(np.asarray(rows).astype(np.int64))
    return Batch(rows[:, 0], rows[:, 1], position_ids=rows[:, 2], token_mask=rows[:, 3].bool())


class SftBatches(LocalBatches):
    """Pretraining's sampler over SFT rows."""

    def _batch(self, rows: np.ndarray) -> Batch:
        return sft_batch(rows)


def build_sft_batches(
    cfg: DataConfig, t: TrainConfig, dp_rank: int, dp_size: int, is_main: bool, vocab_size: int | None = None
) -> tuple:
    """(tokenizer, this rank's batches), as build_batches returns them, from SFT records only."""
    ensure_embedded_tokenizer(cfg, is_main)
    tokenizer = load_tokenizer(cfg)
    if vocab_size is not None:
        check_vocab_size(tokenizer, vocab_size)
    path = sft_rows_path(cfg, tokenizer, cfg.dataset, cfg.split, is_main)
    batches = SftBatches(path, 0, t.seed, t.global_batch_size, t.micro_batch_size, dp_rank, dp_size)
    return tokenizer, batches
