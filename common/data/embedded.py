"""The built-in corpus (the Python standard library's sources) and a byte-level BPE tokenizer trained on it
once and cached, so the default run needs no download."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import sys
import sysconfig

import torch.distributed as dist

from common.config import DataConfig

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
EMBEDDED_CORPUS = f"stdlib{sys.version_info[0]}.{sys.version_info[1]}-v2"  # bump when the selection changes


HELD_OUT_CHARACTERS = 2_000_000  # the held-out part: about this much of the files after the training slice


def embedded_files(max_bytes: int, held_out: bool = False) -> list[tuple[str, str]]:
    """(path, text) of the training slice, the stdlib's files in sorted order until max_bytes characters;
    or, `held_out`, of the files after it (data.eval_dataset="embedded"), which training never reads."""
    root = sysconfig.get_paths()["stdlib"]
    training, after, total = [], [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        top = os.path.relpath(path, root).split(os.sep)[0]
        # tests and codec tables: not prose-like code
        if "site-packages" in path or "test" in top or top == "encodings":
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        (training if total < max_bytes else after).append((path, text))
        total += len(text)
        if total >= max_bytes + (HELD_OUT_CHARACTERS if held_out else 0):
            break
    return after if held_out else training


def embedded_documents(max_bytes: int, held_out: bool = False) -> list[str]:
    return [text for _, text in embedded_files(max_bytes, held_out)]


def train_embedded_tokenizer(docs: list[str], vocab_size: int, out_dir: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    ).save_pretrained(out_dir)


def embedded_tokenizer_dir(cfg: DataConfig) -> str:
    name = f"tokenizer-{EMBEDDED_CORPUS}-{cfg.embedded_vocab_size}-{cfg.embedded_max_bytes}"
    return os.path.join(os.path.expanduser(cfg.cache_dir), name)


def builds_caches(is_main: bool) -> bool:
    """The first rank of every node builds data.cache_dir: the default is each node's own ~/.cache, which
    other nodes may not see; on a shared filesystem an atomic rename keeps one of the identical copies."""
    return is_main or (dist.is_initialized() and os.environ.get("LOCAL_RANK", "0") == "0")


def temporary_name(path: str) -> str:
    """A name no other process writes, also across nodes that share a filesystem."""
    return f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"


def ensure_embedded_tokenizer(cfg: DataConfig, is_main: bool) -> None:
    """Each node's first rank trains it once per cache; the others wait."""
    tok_dir = embedded_tokenizer_dir(cfg)
    if cfg.tokenizer is None and builds_caches(is_main) and not os.path.exists(tok_dir):
        os.makedirs(os.path.dirname(tok_dir), exist_ok=True)
        tmp = temporary_name(tok_dir)
        train_embedded_tokenizer(embedded_documents(cfg.embedded_max_bytes), cfg.embedded_vocab_size, tmp)
        try:
            os.replace(tmp, tok_dir)
        except OSError:  # another job sharing the cache finished first; its tokenizer is the same
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
