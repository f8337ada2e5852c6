"""A training checkpoint (`checkpoints/step-N`) or a SHARDED export, as a Transformers directory, without
training: the layout save_pretrained writes, one output file at a time.

    python scripts/convert_to_hf.py runs/debug_llama/checkpoints/step-200 runs/debug_llama/hf
    torchrun --nproc_per_node 4 scripts/convert_to_hf.py SRC OUT --max-shard-size 2GB --dtype bfloat16

The story of main(): the model on `meta` from the checkpoint's config.json -> the output files' keys and
split, as save_pretrained would write them -> for each output file this process owns (file i on rank i mod the
world size; all of them on one process): DCP reads just its tensors, whole (a fused expert weight whole,
split back per expert by Transformers' converter), cast, written -> rank 0 writes
the index, config and tokenizer, the manifest, and renames the directory into place. A process holds one
output file's tensors at a time, in the checkpoint's dtype (fp32), so one CPU box converts a 70B model.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer
from transformers.core_model_loading import revert_weight_conversion

from common import export_check, manifest
from common.architectures import auto_class
from common.config import ConfigError
from common.export import (
    finish_export,
    prepare_for_generation,
    save_model_config,
    save_pretrained_keys,
    save_pretrained_split,
    write_index,
)
from common.ops.cli import run_cli
from common.ops.run_dir import recover_moved

DTYPES = ("float32", "bfloat16", "float16")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="checkpoints/step-N or a SHARDED export (a DCP directory)")
    parser.add_argument("out", help="the Transformers directory to write (replaced once complete)")
    parser.add_argument("--max-shard-size", default="5GB", help="save_pretrained's: bytes or '5GB'")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="the output files' dtype")
    parser.add_argument("--trust-remote-code", action="store_true", help="for a config that ships its code")
    args = parser.parse_args(argv)
    for needed in (".metadata", "config.json"):
        if not os.path.exists(os.path.join(args.src, needed)):
            raise ConfigError(
                f"src is {args.src!r}, which has no {needed}; give a checkpoints/step-N or a SHARDED export"
            )
    return args


def stored_weights(src: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: an empty meta tensor of the checkpoint's shape and dtype} for the model's weights in `src`."""
    stored = dcp.FileSystemReader(src).read_metadata().state_dict_metadata
    weights = {k.removeprefix("model."): v for k, v in stored.items() if k.startswith("model.")}
    ours = model.state_dict()
    unknown = next((name for name in weights if name not in ours), None)
    if unknown is not None:  # a LoRA checkpoint holds PEFT's names; its merged export is the run's
        raise ConfigError(
            f"src holds {unknown!r}, which the model of its config.json has not (LoRA adapters?); "
            "export a LoRA run with lora.merge_on_export"
        )
    missing = next((name for name, _ in model.named_parameters() if name not in weights), None)
    if missing is not None:  # a checkpoint holds what trains: a frozen vision tower stays in the release
        raise ConfigError(
            f"src has no {missing!r}: a run's checkpoint holds only the weights that train, and frozen ones "
            f"(an image-text release's vision tower) stay in model.name_or_path; convert the run's export"
        )
    return {n: torch.empty(m.size, dtype=m.properties.dtype, device="meta") for n, m in weights.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if "RANK" in os.environ:  # under torchrun: the output files are shared out; else one process writes all
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    config = AutoConfig.from_pretrained(args.src, trust_remote_code=args.trust_remote_code)
    with torch.device("meta"):
        model = auto_class(config).from_config(config, trust_remote_code=args.trust_remote_code)
    stored = stored_weights(args.src, model)
    dtype = getattr(torch, args.dtype)
    whole, keys_of = save_pretrained_keys(
        model, {n: torch.empty(t.shape, dtype=dtype, device="meta") for n, t in stored.items()}
    )
    source = {key: name for name, keys in keys_of.items() for key in keys}
    split = save_pretrained_split(whole, args.max_shard_size)
    tmp = f"{args.out}.tmp"
    export_check.check_free_space(tmp, needed := sum(t.numel() * t.element_size() for t in whole.values()))
    if rank == 0:
        for line in recover_moved(args.out):  # what a killed conversion left: one line each
            print(line, flush=True)
        os.makedirs(tmp)
    if dist.is_initialized():
        dist.barrier()
    written = {}
    for i, (file, file_keys) in enumerate(sorted(split.filename_to_tensors.items()), 1):
        if i % world != rank:
            continue
        names = dict.fromkeys(source[k] for k in file_keys)  # a fused expert weight is read whole
        tensors = {n: torch.empty(stored[n].shape, dtype=stored[n].dtype) for n in names}
        dcp.load({"model": tensors}, checkpoint_id=args.src, no_dist=True)  # just these tensors, whole
        saved = {}
        for name in names:  # under save_pretrained's keys; fused experts split back by Transformers
            saved |= revert_weight_conversion(model, {name: tensors.pop(name)})
        cast = {k: saved.pop(k).to(dtype, copy=True) for k in file_keys}  # copies: no shared storage
        with export_check.full_disk_is_one_line(tmp, needed):
            save_file(cast, os.path.join(tmp, file), metadata={"format": "pt"})  # save_pretrained's header
        written.update(manifest.file_entries(tmp, [file]))
    every = [written]
    if dist.is_initialized():
        every = [None] * world
        dist.all_gather_object(every, written)  # each rank checksummed the files it wrote
    if rank == 0:
        if split.is_sharded:
            write_index(model, tmp, split)
        tokenizer = AutoTokenizer.from_pretrained(args.src) if has_tokenizer(args.src) else None
        prepare_for_generation(model, tokenizer, from_scratch=False)
        save_model_config(model, tmp, tokenizer, dtype)
        finish_export(tmp, args.out, {n: e for entries in every for n, e in entries.items()})
        print(f"wrote {args.out}: {len(split.filename_to_tensors)} file(s), {args.dtype}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def has_tokenizer(path: str) -> bool:
    return os.path.exists(os.path.join(path, "tokenizer_config.json"))


if __name__ == "__main__":
    run_cli(main)
