"""What scripts/estimate_memory.py is asked: its command line, the config it plans (a hub model's
architecture from configs/hub, so planning needs no network), and which recipe's code runs it."""

from __future__ import annotations

import argparse
import json
import os

from common.architectures import is_image_text
from common.config import Config, ConfigError
from common.data.files import local_files
from common.data.image_records import SHAPES, has_images
from common.ops.config_sources import load_config

# Architecture-only copies of the hub configs the shipped configs name, so planning needs no network.
HUB_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "hub")

# A rank's process before it loads any weights (torch, Transformers, the data, CUDA's context and libraries)
# and CUDA's first load: 1.17-1.27 GiB and 0.25 GiB on an H200 (docs/memory.md#host-memory).
HOST_RESERVE_GIB = 1.5


def offline_model(cfg: Config) -> None:
    """Point model.name_or_path at the bundled architecture config when it names a hub model."""
    name = cfg.model.name_or_path
    if name and not os.path.isdir(name):
        bundled = os.path.join(HUB_CONFIGS, name.replace("/", "--"))
        if not os.path.isdir(bundled):
            raise ConfigError(
                f"model.name_or_path {name!r} is neither a local directory nor bundled in configs/hub; "
                f"give a directory holding its config.json"
            )
        cfg.model.name_or_path = bundled


def pick_recipe(requested: str, config_path: str, hf_config) -> str:
    """The recipe whose code plans the config: the one asked for, else MoE for an MoE model, else pretraining
    for a config with a train section, else evaluation."""
    if requested != "auto":
        return requested
    if any(hasattr(hf_config, key) for key in ("num_experts", "num_local_experts")):
        return "moe"
    with open(config_path) as f:
        return "pretrain" if "train" in json.load(f) else "eval"


def parse(argv: list[str] | None, description: str) -> tuple[argparse.Namespace, Config]:
    """--help is `description`, the planner's docstring."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    parser.add_argument("--reserve-gib", type=float, default=3.0, help="CUDA context, NCCL, fragmentation")
    parser.add_argument("--recipe", choices=["auto", "pretrain", "eval", "moe"], default="auto")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="the run to plan for")
    parser.add_argument("--procs-per-node", type=int, default=8, help="ranks a node's host memory serves")
    parser.add_argument(
        "--host-reserve-gib", type=float, default=HOST_RESERVE_GIB, help="a rank's process before it loads"
    )
    parser.add_argument(
        "--images-per-row",
        type=int,
        help="an image-text release's images per row; 0: text rows (images_per_row)",
    )
    parser.add_argument("--json", action="store_true", help="also print one JSON object on stdout")
    parser.add_argument(
        "--quick", action="store_true", help="one measurement: no largest micro-batch, no alternatives"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        raise ConfigError(f"--world-size is {args.world_size}; give the number of GPUs, at least 1")
    if args.procs_per_node < 1:
        raise ConfigError(
            f"--procs-per-node is {args.procs_per_node}; give the ranks a node runs, at least 1"
        )
    if args.images_per_row is not None and args.images_per_row < 0:
        raise ConfigError(f"--images-per-row is {args.images_per_row}; give 0 (text rows) or more")
    return args, load_config(args.config, args.overrides)


def images_per_row(requested: int | None, cfg: Config, hf_config) -> int:
    """--images-per-row, else: 1 for an image-text release, unless its data.dataset is text where that can be
    read here (local files, by path or glob, or a built-in task; a hub dataset is taken to hold images)."""
    if not is_image_text(hf_config):
        if requested:
            raise ConfigError(
                f"--images-per-row is {requested} but model_type {hf_config.model_type!r} is a text model; "
                f"give 0 or leave it out"
            )
        return 0
    if requested is not None:
        return requested
    source = cfg.data.dataset
    readable = source in (SHAPES, "embedded", "arithmetic") or local_files(source)  # paths or globs
    return int(has_images(source, cfg.data.split)) if readable else 1
