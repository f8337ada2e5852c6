"""Supervised fine-tuning data: prompt/completion or chat JSONL -> rows where only the answers are trained on.

An example is token ids plus a flag per token saying "this is answer" (completion, assistant turn). A row
of `data.seq_len` holds one padded example, or with `data.pack` several whole examples; position ids
restart at 0 for each example, and Transformers turns restarting position ids (with no attention mask)
into a block-diagonal causal mask, so packed examples never see each other. Rows are cached as one
`[N, 4, seq_len]` array (input ids, labels, position ids, real-token flags) and batched by the same
world-size-independent
sampler as pretraining.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from common.config import ConfigError, DataConfig, EvalConfig
from common.data import LOCAL_FORMATS, Batch, LocalBatches, file_fingerprint, local_files, prepare_local_data

ARITHMETIC = "arithmetic"  # the built-in task: "17+25=" -> "42", generated, with a disjoint held-out split


def arithmetic_examples(split: str) -> list[dict]:
    """Every a+b and a-b with a, b < 100. One problem in ten (by a fixed shuffle) is held out, and any split
    other than "train" returns those."""
    problems = [(a, op, b) for a in range(100) for b in range(100) for op in "+-"]
    random.Random(0).shuffle(problems)
    held_out = len(problems) // 10
    chosen = problems[held_out:] if split == "train" else problems[:held_out]
    return [
        {"prompt": f"{a}{op}{b}=", "completion": str(a + b if op == "+" else a - b)} for a, op, b in chosen
    ]


def _read_examples(source: str | list, split: str) -> list[dict]:
    if source == ARITHMETIC:
        return arithmetic_examples(split)
    import datasets

    files = local_files(source)
    if files:
        return list(
            datasets.load_dataset(
                LOCAL_FORMATS[os.path.splitext(files[0])[1]], data_files=files, split="train"
            )
        )
    try:
        return list(datasets.load_dataset(source, split=split))
    except Exception as e:  # the hub client raises many types; all mean "cannot get this dataset"
        raise ConfigError(
            f"SFT dataset {source!r} is neither local files nor a loadable hub dataset (split "
            f"{split!r}: {str(e).splitlines()[0]}); give JSONL files, '{ARITHMETIC}', or a reachable "
            f"hub name"
        ) from None


def _chat_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The whole conversation through the chat template; answer flags on each assistant turn's tokens.

    A turn's tokens are those the template adds between "conversation so far + generation prompt" and
    "conversation including this turn", so any template works without {% generation %} markers.
    """
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)[
        "input_ids"
    ]
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
    """(token ids, answer flags) for one record."""
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
        return _chat_tokens(
            tokenizer,
            [
                {"role": "user", "content": example["prompt"]},
                {"role": "assistant", "content": example["completion"]},
            ],
        )
    prompt = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
    completion = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def build_rows(
    examples: list[tuple[list[int], list[int]]], seq_len: int, pack: bool, pad_id: int
) -> np.ndarray:
    """[N, 4, seq_len]: input ids, labels (next token where it is an answer token, else -100), position ids,
    and 1 for real tokens / 0 for padding."""
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


def _tokenize_sft(cfg: DataConfig, tokenizer, source, split: str) -> np.ndarray:
    examples = [tokenize_example(tokenizer, e) for e in _read_examples(source, split)]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = build_rows(examples, cfg.seq_len, cfg.pack, pad_id)
    if len(rows) == 0:
        raise ConfigError(
            f"data.dataset {source!r} has no example with an answer token within data.seq_len="
            f"{cfg.seq_len}; raise data.seq_len or check the records"
        )
    return rows


def _to_batch(rows: np.ndarray, positions: list[int]) -> Batch:
    rows = torch.from_numpy(np.asarray(rows).astype(np.int64))
    return Batch(rows[:, 0], rows[:, 1], positions, position_ids=rows[:, 2], token_mask=rows[:, 3].bool())


class SftBatches(LocalBatches):
    """Pretraining's sampler over SFT rows; batches carry position ids so packed examples stay apart."""

    def _batch(self, rows: np.ndarray, positions: list[int]) -> Batch:
        return _to_batch(rows, positions)


def _cache_tag(source: str | list, split: str, tokenizer) -> str:
    files = local_files(source) if source != ARITHMETIC else None
    return f"sft-{source}-{split}-{tokenizer.name_or_path}-{file_fingerprint(files) if files else ''}"


def build_sft_batches(
    cfg: DataConfig,
    tokenizer,
    seed: int,
    global_batch: int,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
    is_main: bool,
) -> SftBatches:
    build = lambda: _tokenize_sft(cfg, tokenizer, cfg.dataset, cfg.split)
    path = prepare_local_data(cfg, is_main, build, tag=_cache_tag(cfg.dataset, cfg.split, tokenizer))
    return SftBatches(path, 0, seed, global_batch, micro_batch, dp_rank, dp_size)


def eval_batches(
    cfg: DataConfig, e: EvalConfig, tokenizer, dp_rank: int, dp_size: int, is_main: bool
) -> list[Batch]:
    """This rank's share of the held-out rows (none without data.eval_dataset). Every rank gets the same
    number of batches (short ones are filled with rows that carry no labels), because each forward is a
    collective under FSDP and EP."""
    if not cfg.eval_dataset:
        return []
    max_rows, batch_size = e.max_sequences, e.batch_size
    build = lambda: _tokenize_sft(cfg, tokenizer, cfg.eval_dataset, cfg.eval_split)
    path = prepare_local_data(
        cfg, is_main, build, tag=_cache_tag(cfg.eval_dataset, cfg.eval_split, tokenizer)
    )
    rows = np.load(path)[:max_rows]
    per_rank = -(-len(rows) // (dp_size * batch_size)) * batch_size
    filler = rows[:1].copy()
    filler[:, 1] = -100
    mine = [
        rows[i] if i < len(rows) else filler[0] for i in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    ]
    return [_to_batch(np.stack(mine[i : i + batch_size]), []) for i in range(0, per_rank, batch_size)]
