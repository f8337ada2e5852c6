"""The FULL export, three ways: written twice (the recipes' path until 2026-12-05), in place, or gathered.

    python benchmarks/export_write_once.py [--repeats 3] [--tiny]

weights_io.py's 531M-parameter Llama, sharded by fully_shard over 1, 2 and 4 CPU ranks (random fp32 weights),
exported in fp32, split at 1GB, three ways, one after another, `--repeats` times:

- "DCP + consolidation": the recipes' path before this one, kept here to compare. Every rank writes its
  shards as part files (DCP's Hugging Face writer), then assembles its output files from them (torch's
  consolidation): each byte is written twice.
- "in place": common/export.export_full, as the recipes export now. Rank 0 creates the output files with
  their headers; DCP's save has every rank write its shards straight at their offsets there.
- "gather, write once": each weight of output file i is gathered to rank i mod world (dist.gather of the
  padded shards), which writes the file with safetensors' save_file, as save_pretrained does, and checksums
  it for the manifest; rank 0 writes the index. On 1 rank this is save_pretrained's own write.

Before each export, the dirty pages of the last are written back (os.sync), so none of them slows the next.
The first repeat checks that all three wrote the same files, index and tensors. Prints the median seconds,
their range, and the ratio to "gather, write once" on 1 rank: one process writing the whole model once, the
time the issue's goal compares against.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files_on_every_rank,
)
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.weights_io import SIZE
from common import export, manifest
from common.config import Config
from tests.launch import assert_same_weights, run_command, tiny, torchrun

PATHS = ("DCP + consolidation", "in place", "gather, write once")


def export_consolidated(model, out_dir: str, cfg: Config) -> None:
    """The FULL export as the recipes wrote it until 2026-12-05 (dense, fp32, no LoRA): DCP's Hugging Face
    writer puts each rank's shards in part files, then rank r assembles output files r, r + world, ... from
    them with torch's consolidation (private in torch 2.13), and checksums them for the manifest."""
    whole, state = export.tensors_to_write(model, model.state_dict(), torch.float32)
    split = export.save_pretrained_split(whole, cfg.checkpoint.max_shard_size)
    order = sorted(split.filename_to_tensors)
    file_of = {key: order.index(file) + 1 for key, file in split.tensor_to_filename.items()}
    tmp, parts = f"{out_dir}.tmp", f"{out_dir}.tmp/parts"
    writer = HuggingFaceStorageWriter(parts, file_of, thread_count=1, save_distributed=True)
    writer.sync_files = False
    dcp.save(state, storage_writer=writer)
    consolidate_safetensors_files_on_every_rank(parts, tmp, file_of, num_threads=4)
    own = [file for i, file in enumerate(order, 1) if i % dist.get_world_size() == dist.get_rank()]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, manifest.file_entries(tmp, own))
    if dist.get_rank() == 0:
        shutil.rmtree(parts)
        os.remove(f"{tmp}/model.safetensors.index.json")  # torch's, in place of save_pretrained's
        export.write_index(model, tmp, split)
    dist.barrier()


def write_once(model, out_dir: str, max_shard_size: str) -> float:
    """Each output file's weights gathered whole to its writer, which writes them once; no rank holds more
    than its shards plus the file it writes (and one weight's parts). Returns the seconds spent gathering."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = model.state_dict()
    meta = {name: torch.empty(p.shape, device="meta") for name, p in state.items()}
    split = export.save_pretrained_split(export.save_pretrained_keys(model, meta)[0], max_shard_size)
    tmp = f"{out_dir}.tmp"
    os.makedirs(tmp, exist_ok=True)
    files, own, gathering = sorted(split.filename_to_tensors), [], 0.0
    for first in range(0, len(files), world):  # a round: file first + r gathered to rank r, then written
        tensors = {}
        for writer, file in enumerate(files[first : first + world]):
            for key in split.filename_to_tensors[file]:
                start = time.perf_counter()
                whole = gather_to(state[key], writer)
                gathering += time.perf_counter() - start
                if rank == writer:
                    tensors[key] = whole
        if tensors:
            file = files[first + rank]
            save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
            own.append(file)
    every = [None] * world
    dist.all_gather_object(every, manifest.file_entries(tmp, own))
    if rank == 0 and split.is_sharded:
        export.write_index(model, tmp, split)
    dist.barrier()
    return gathering


def gather_to(weight, writer: int):
    """The whole of a dim-0-sharded DTensor on rank `writer` (dist.gather: equal sizes, so padded)."""
    shard, world = weight.to_local(), dist.get_world_size()
    if world == 1:  # the whole tensor: written straight from the model, as save_pretrained does
        return shard
    rows = [len(c) for c in torch.empty(weight.shape[0], device="meta").chunk(world)]
    rows += [0] * (world - len(rows))
    if len(shard) < max(rows):
        shard = torch.cat([shard, shard.new_zeros((max(rows) - len(shard), *shard.shape[1:]))])
    parts = [torch.empty_like(shard) for _ in range(world)] if dist.get_rank() == writer else None
    dist.gather(shard, parts, dst=writer)
    return torch.cat([part[:n] for part, n in zip(parts, rows)]) if parts else None


def sharded_llama() -> LlamaForCausalLM:
    """weights_io.py's Llama, sharded by fully_shard over the process group, random fp32 weights."""
    config = LlamaConfig(vocab_size=4096, num_key_value_heads=SIZE["num_attention_heads"], **SIZE)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    return model


def as_rank(work: str, repeats: int) -> None:
    """Inside torchrun: shard the model, then time each path `repeats` times; rank 0 writes the times to
    work/times.json."""
    dist.init_process_group("gloo")
    model = sharded_llama()
    cfg = Config()
    cfg.checkpoint.max_shard_size = "1MB" if tiny() else "1GB"  # several files either way
    times = {path: [] for path in (*PATHS, "gathering")}
    written = (f"{work}/dcp.tmp", f"{work}/in-place", f"{work}/once.tmp")
    for repeat in range(repeats):
        for path, out_dir in zip(PATHS, (f"{work}/dcp", f"{work}/in-place", f"{work}/once")):
            if dist.get_rank() == 0:
                os.sync()  # each export starts with no dirty pages of the last one to write back
            dist.barrier()
            start = time.perf_counter()
            if path == PATHS[0]:
                export_consolidated(model, out_dir, cfg)
            elif path == PATHS[1]:
                export.export_full(model, out_dir, None, torch.float32, cfg)
            else:
                times["gathering"].append(write_once(model, out_dir, cfg.checkpoint.max_shard_size))
            times[path].append(time.perf_counter() - start)
            dist.barrier()
        if dist.get_rank() == 0:
            if repeat == 0:  # all three wrote the same tensors, to the same files
                for other in written[1:]:
                    assert assert_same_weights(Path(written[0]), Path(other))
            for name in written:
                shutil.rmtree(name)
    if dist.get_rank() == 0:
        with open(f"{work}/times.json", "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1 if tiny() else 3)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--as-rank", metavar="WORK")
    args = parser.parse_args()
    if args.as_rank:
        return as_rank(args.as_rank, args.repeats)
    print(
        "| ranks | export | median s | range s | / one process writing once | of which gathering, median s |"
    )
    print("|---|---|---|---|---|---|")
    baseline = None
    for world in (1, 2) if args.tiny else (1, 2, 4):
        with tempfile.TemporaryDirectory() as work:
            launch = [
                *torchrun(world),
                os.path.abspath(__file__),
                "--as-rank",
                work,
                f"--repeats={args.repeats}",
            ]
            run_command(launch + (["--tiny"] if args.tiny else []), timeout=1800)
            with open(f"{work}/times.json") as f:
                times = json.load(f)
        baseline = baseline or statistics.median(times[PATHS[2]])
        for path in PATHS:
            median = statistics.median(times[path])
            spread = f"{min(times[path]):.2f} to {max(times[path]):.2f}"
            gathering = f"{statistics.median(times['gathering']):.2f}" if path == PATHS[2] else "-"
            print(f"| {world} | {path} | {median:.2f} | {spread} | {median / baseline:.2f} | {gathering} |")


if __name__ == "__main__":
    main()
