"""The host-memory half of scripts/estimate_memory.py: each rank's and each node's host RAM at load, at a
resume, in training, at a checkpoint and at export, from the rank's shards (measured on fake tensors there)
and the paths common/export.py, DCP and FSDP's offload take (docs/memory.md#host-memory)."""

from __future__ import annotations

import argparse
import math

from huggingface_hub.serialization._base import parse_size_to_int  # save_pretrained's parser (no public one)

from common import manifest
from common.config import Config
from common.export import export_dtype
from common.ops.metrics import GIB


def host_plan(cfg: Config, recipe: str, device_type: str, shards: list[dict], training: dict) -> dict:
    """Each rank's host memory above what its process holds before it loads the weights, in bytes, at load,
    at a resume, in training, at a checkpoint and at export: what common/export.py, DCP and FSDP's offload
    put on the host (docs/memory.md#host-memory). `training`: rank 0's measured peak and host copies. Pages
    of the files read and written are the page cache, the kernel's to drop, and not counted."""
    fsdp, c, trains = cfg.fsdp, cfg.checkpoint, recipe != "eval"
    on_host = device_type == "cpu" or fsdp.cpu_offload  # where the sharded parameters and their state live
    # On a GPU, cpu_offload pins parameters and gradients (common/wrap.py): CUDA's pinned allocator rounds
    # each block up to a power of two, and keeps the gradients' blocks cached after the step.
    pins = fsdp.cpu_offload and device_type == "cuda"
    params = [s["pinned_param_bytes"] if pins else s["param_bytes"] for s in shards]
    # Between steps: the parameters, AdamW's state, and the gradients' pinned blocks; in a step, the gradients
    between_steps = [p + s["optimizer_bytes"] + pins * s["pinned_grad_bytes"] for p, s in zip(params, shards)]
    state = [n + (not pins) * s["trained_bytes"] for n, s in zip(between_steps, shards)]
    # Every tensor of a CPU run: rank 0's measured peak, less its state, plus each rank's (cpu_offload: the
    # peak counts no state). On a GPU, the activations' host copies (activation_checkpointing_offload).
    device_part = training["peak"] - (0 if fsdp.cpu_offload else state[0]) if device_type == "cpu" else 0
    plan = {"load": [], "resume": [], "training": [], "checkpoint": [], "export": []}
    for rank, s in enumerate(shards):
        kept = between_steps[rank] if on_host else 0
        # DCP's HF reader copies each slice from the mapped file straight into the rank's own tensors, and
        # experts are fused a layer at a time from the rank's own; from_pretrained, for weights Transformers
        # converts otherwise as it loads, holds the whole model in fp32.
        whole = shards[0]["loads_whole"] and (rank == 0 or not fsdp.cpu_ram_efficient_loading)
        read = 4 * shards[0]["model_numel"] if cfg.model.name_or_path and whole else 0
        plan["load"].append((params[rank] if on_host else 0) + read)
        # DCP reads the checkpoint one saved tensor at a time into the rank's own tensors. AdamW's state to
        # read into is made first, by a step on zero gradients (torch's get_optimizer_state_dict): the
        # parameters, their gradients (not pinned) and the state, at once.
        state_read = params[rank] + s["trained_bytes"] + s["optimizer_bytes"]
        plan["resume"].append(state_read if on_host and trains else 0)
        plan["training"].append(device_part + (state[rank] if on_host else 0) + training["host_copies_bytes"])
        # DCP copies each tensor of a file to the host and holds it until the file is written (async_save:
        # all of them, into its staging buffers); a LoRA checkpoint holds the adapters.
        copies = s["trained_bytes"] + s["optimizer_bytes"] if c.async_save or not on_host else 0
        plan["checkpoint"].append(kept + copies if trains else 0)
        exported = export_bytes(cfg, s, on_host, export_dtype(cfg, device_type).itemsize)
        if c.export_writers == "one":  # the file it writes, gathered: at most max_shard_size (or the model)
            model_bytes = shards[0]["model_numel"] * export_dtype(cfg, device_type).itemsize
            limit = (
                c.max_shard_size if isinstance(c.max_shard_size, int) else parse_size_to_int(c.max_shard_size)
            )
            file = min(limit, model_bytes)
            exported += file if rank < math.ceil(model_bytes / file) else 0  # file i is rank i's
        plan["export"].append(kept + exported if trains and c.export else 0)
    return plan


def pinned(nbytes: int) -> int:
    """What CUDA's pinned-memory allocator takes for `nbytes`: a power of two (torch's CachingHostAllocator,
    with PYTORCH_CUDA_ALLOC_CONF's pinned_max_round_threshold unset)."""
    return 1 << (nbytes - 1).bit_length() if nbytes else 0


def export_bytes(cfg: Config, s: dict, on_host: bool, out_bytes: int) -> int:
    """What common/export.py's export holds on a rank's host besides the trained state."""
    if cfg.lora.r and not cfg.lora.merge_on_export:
        return 0  # the adapters, gathered: small
    if cfg.lora.r or cfg.fsdp.state_dict_type == "FULL_STATE_DICT":  # with LoRA: the merged model
        # The rank's shards, merged (LoRA) and cast to export_dtype where the state lives, then written into
        # the files one tensor at a time (not counted); where FSDP splits experts, the rank's own experts,
        # gathered and copied to the host; the buffer the files' checksums read through.
        merged = s["param_bytes"] if cfg.lora.r else 0
        cast = s["numel"] * out_bytes if s["numel"] * out_bytes != s["param_bytes"] else 0
        return (merged + cast if on_host else 0) + s["split_expert_numel"] * out_bytes + manifest.CHUNK
    return 0 if on_host else s["param_bytes"]  # SHARDED: DCP's host copies of the rank's shards


def host_report(plan: dict, args: argparse.Namespace) -> dict:
    """The plan's peak per rank and per node (the node whose ranks together hold the most), the reserve of
    each process added, and the phases' figures."""
    reserve, per_node = args.host_reserve_gib * GIB, args.procs_per_node
    nodes = range(0, args.world_size, per_node)
    node = {phase: max(sum(ranks[n : n + per_node]) for n in nodes) for phase, ranks in plan.items()}
    procs = min(per_node, args.world_size)
    return {
        "reserve_gib": args.host_reserve_gib,
        "procs_per_node": procs,  # --procs-per-node, or the world if it is smaller
        "peak_gib_per_rank": (max(max(ranks) for ranks in plan.values()) + reserve) / GIB,
        "peak_gib_per_node": (max(node.values()) + procs * reserve) / GIB,
        "rank0_bytes": {phase: ranks[0] for phase, ranks in plan.items()},
        "bytes_per_rank": plan,
        "node_bytes": node,
    }
