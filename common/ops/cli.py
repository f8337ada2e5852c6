"""The command line every recipe shares: parse it into a Config, run main(), turn bad input into one line
and exit code 2 on every rank, and leave without gloo aborting the exit."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from common.config import Config, ConfigError, DataConfig, ModelConfig
from common.data.checks import check_split_keys
from common.ops.config_sources import load_config
from common.ops.fsdp1 import Translation
from common.ops.integrity import check_model_files


def parse_args(argv: list[str] | None = None, description: str = "") -> Config:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="JSON run config (see configs/)")
    parser.add_argument("--fsdp-config", help="a Transformers fsdp_config JSON; fills the fsdp section")
    parser.add_argument("--accelerate-config", help="an Accelerate YAML with an fsdp_config block")
    parser.add_argument("overrides", nargs="*", help="key.path=value, value parsed as JSON")
    args = parser.parse_args(argv)
    changes: list[str] = []
    translation = Translation()
    sources = (args.config, args.overrides, args.fsdp_config, args.accelerate_config)
    cfg = load_config(*sources, os.environ, changes, translation)
    # before any work, on every rank: a damaged file is one line (checksums: verify_model_checksums)
    check_model_files(cfg.model)
    check_split_keys(cfg.data)
    given, cfg.data.tokenizer = cfg.data.tokenizer, checkpoint_tokenizer(cfg.data, cfg.model)
    if os.environ.get("RANK", "0") == "0":
        if given != cfg.data.tokenizer:
            print(f"config: data.tokenizer is model.name_or_path's own ({cfg.data.tokenizer})", flush=True)
        if changes:
            print(
                f"config: {len(changes)} value(s) changed by a more specific source: {'; '.join(changes)}",
                flush=True,
            )
        if translation.line():
            print(translation.line(), flush=True)
    return cfg


def checkpoint_tokenizer(data: DataConfig, model: ModelConfig) -> str | None:
    """data.tokenizer, or else model.name_or_path's own (the one it was trained with, as the Trainer, TRL and
    axolotl take it); None (the embedded tokenizer) only for a model made from model.config."""
    path = model.name_or_path
    if data.tokenizer is not None or not path:
        return data.tokenizer
    if not os.path.isdir(path):  # a hub id: AutoTokenizer finds the tokenizer beside the weights
        return path
    if any(os.path.exists(os.path.join(path, name)) for name in ("tokenizer_config.json", "tokenizer.json")):
        return path
    raise ConfigError(
        f"model.name_or_path {path!r} holds no tokenizer (no tokenizer_config.json or tokenizer.json) and "
        f"data.tokenizer is unset; set data.tokenizer to the tokenizer the checkpoint was trained with"
    )


def refuse_set_keys(cfg: Config, reasons: dict[str, str]) -> None:
    """One line for the first "section.key" of `reasons` set away from its default: a key a script has no
    use for errors rather than being ignored."""
    defaults = Config()
    for key, reason in reasons.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value != getattr(getattr(defaults, section), name):
            raise ConfigError(f"{key} is {value!r} but {reason}; leave it unset (docs/config.md)")


def run_cli(main, argv: list[str] | None = None) -> None:
    """Run a script's main(argv): bad input is one line and exit 2 on every rank, with no traceback; a stop
    that every rank takes together (a non-finite loss, say) is its one line and exit 1."""
    import torch.distributed as dist  # here: --help and config errors need no torch before main() runs
    from torch.distributed.checkpoint.api import CheckpointException

    # The process group and threads of a program that calls main() itself (a notebook, say) are its own.
    had_group, had_threads = dist.is_initialized(), len(collective_threads())
    exit_code = 0
    try:
        main(argv)
    except ConfigError as error:
        rank = os.environ.get("RANK")
        prefix = f"[rank{rank}] " if rank is not None else ""
        print_line(f"{prefix}config error: {error}")
        exit_code = 2
    except SystemExit as stop:
        exit_code = stop.code or 0
        if isinstance(exit_code, str):
            print_line(exit_code)
            exit_code = 1
    except (OSError, CheckpointException, RuntimeError) as error:  # DCP gives every rank each one's failure
        if (line := disk_full(error) or peer_gone(error)) is None:
            raise
        print_line(line)
        exit_code = 1
    if not had_group and dist.is_initialized():  # main() left early: a config error, a NaN stop
        dist.destroy_process_group()
    end_process(exit_code, had_threads)


def disk_full(error: BaseException) -> str | None:
    """The one line for a full disk in the middle of a write (an OSError, or DCP's CheckpointException
    carrying one from any rank), or None for any other error."""
    from common.export_check import no_space_error  # here, as torch above: not before main() runs

    if (full := no_space_error(error)) is None:
        return None
    where = getattr(full, "filename", None) or "the output directory"
    return (
        f"no space left on the device writing {where}: free space or write elsewhere (checkpoint.dir); what "
        f"was being written stays under its .tmp name, and the previous export and checkpoints are untouched"
    )


def peer_gone(error: BaseException) -> str | None:
    """The one line for a collective that failed because another rank died (killed, or its node lost), as
    gloo sees it at once: its socket closed. None for any other error (NCCL waits out the process group's
    timeout, parallelism.timeout_minutes, and its watchdog ends the process)."""
    gone = ("Connection reset by peer", "Connection closed by peer")
    if not any(text in str(error) for text in gone):
        return None
    return (
        f"rank {os.environ.get('RANK', 0)}: another rank died in the middle of a collective, so this one "
        f"stops too; the launcher's log names the rank that failed first. What was being written stays under "
        f"its .tmp name, and the previous export and checkpoints are untouched"
    )


def print_line(text: str) -> None:
    """One line to stderr in one write(2): under PYTHONUNBUFFERED, print() writes the text and its newline in
    two, so the ranks' lines on a shared pipe could interleave as 'rank0 ...rank1 ...' + ''."""
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), f"{text}\n".encode())
    except (AttributeError, OSError, ValueError):  # a stream with no descriptor (a notebook's)
        sys.stderr.write(f"{text}\n")


def collective_threads() -> list[str]:
    """gloo and NCCL threads, which live exactly as long as their process groups."""
    names = []
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return [n for n in names if n.startswith(("pt_gloo", "gloo_", "pt_nccl"))]


def end_process(exit_code: int, threads_before: int = 0) -> None:
    """Leave the process. DTensor's caches keep every mesh's groups until interpreter finalization, where a
    gloo worker still freeing tensors aborts ("terminate called without an active exception",
    pytorch/pytorch#179291), so while threads this run started live, skip that teardown."""
    if len(collective_threads()) > threads_before:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    if exit_code:
        sys.exit(exit_code)
