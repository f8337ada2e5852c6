"""checkpoint.export_writers=one: each file of the FULL export is written by one rank alone, for filesystems
that keep only one writer's copy of a file (object-store mounts such as gcsfuse; docs/checkpoints.md, "Which
filesystems"). File i is rank i % world's. Each round, every rank gathers the whole tensors of its next file
(the other ranks send their shards) and then writes it, all ranks at once, so no rank holds more than one
file (checkpoint.max_shard_size bounds it) beyond its share."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common.safetensors_writer import SafetensorsInPlace


def write_each_file_from_one_rank(writer: SafetensorsInPlace, state: dict, whole: dict, files: dict) -> None:
    """`state`: {key: this rank's part to write} (export.tensors_to_write: a DTensor shard, or a whole
    tensor that this rank alone holds, such as an expert split back); `whole`: {key: a meta tensor of the
    whole weight}; `files`: {file: its keys}. Collective: every rank runs every round."""
    rank, world = dist.get_rank(), dist.get_world_size()
    held = [None] * world  # {key: whether it is a DTensor} of each rank
    dist.all_gather_object(held, {key: isinstance(t, DTensor) for key, t in state.items()})
    names = sorted(files)
    for first in range(0, len(names), world):
        mine = []
        for owner, file in enumerate(names[first : first + world]):
            for key in sorted(files[file]):
                tensor = whole_tensor(state.get(key), whole[key], [h.get(key) for h in held])
                if owner == rank:
                    mine.append((key, tensor.cpu(), None))
                del tensor  # another rank's: dropped at once
        writer.write_regions(mine)


def whole_tensor(part: torch.Tensor | None, meta: torch.Tensor, held: list) -> torch.Tensor:
    """One key's whole tensor on every rank: its DTensor's shards all-gathered, or the tensor broadcast from
    the first rank that holds it whole (`held`: each rank's entry for the key, None where it has none), in
    host memory (gloo), where it may already be."""
    holder = next(r for r, is_dtensor in enumerate(held) if is_dtensor is not None)
    if held[holder]:
        return part.full_tensor()
    if dist.get_rank() == holder:
        tensor = part.cpu().contiguous()
    else:
        tensor = torch.empty(meta.shape, dtype=meta.dtype)
    dist.broadcast(tensor, src=holder)
    return tensor
