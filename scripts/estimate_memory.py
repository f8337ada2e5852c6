"""Will it fit? Each rank's peak GPU memory for a recipe's config, from real training steps on fake tensors.

    python scripts/estimate_memory.py --config configs/llama.json --world-size 8 --gpu-memory-gib 80
    python scripts/estimate_memory.py --config configs/eval_cp_llama.json --world-size 8 --json
    python scripts/estimate_memory.py --config configs/qwen3_moe.json --world-size 16 --quick
    python scripts/estimate_memory.py --config configs/debug_llama.json --world-size 2 --device cpu

The recipe's own code runs: its config checks, mesh, CP setup, Transformers' TP and EP plans, apply_fsdp
(wrap policy, activation checkpointing, mixed precision, reshard, offload) and its loss, then forward,
backward and AdamW steps at the config's micro-batch and sequence length. It runs under FakeTensorMode
with a fake process group of --world-size ranks on the CPU: tensors have shapes and no data, so an 8B
model needs no memory, GPU, weights, tokenizer or dataset. This process plays rank 0, whose shards are the
largest. torch's FSDPMemTracker counts every tensor alive at every op; the peak is taken over two steps,
the second one with optimizer state.

Planning for a GPU on a CPU (--device cuda, the default):
- Mixed precision resolves as on CUDA (bf16 parameters and fp32 reduction unless the config says otherwise).
- Tensors stay on the CPU: fake CUDA tensors cannot run autograd in a CPU build of torch. SDPA then runs
  torch's CPU flash kernel, which keeps what CUDA's flash and memory-efficient kernels keep (the output and
  a logsumexp, never a sequence x sequence matrix), so attention costs the same memory.
- Not counted: the CUDA context, NCCL buffers and allocator fragmentation; --reserve-gib (default 3) is added
  to the peak before it is compared with --gpu-memory-gib.
- train.compile is ignored: compiled layers fuse elementwise ops and save less, so eager is an upper bound.
- fsdp.activation_checkpointing_offload: each checkpointed layer's input leaves device memory until backward
  copies it back (HostCopies below); the host plan counts it.
- Gradient clipping and the loss's host reads (.item()) are left out: they hold a few scalars per tensor.
- Host RAM per rank and per node (--procs-per-node): at load, at a resume, in training, at a checkpoint and
  at export, from each rank's shards and the paths common/export.py and DCP take (host_plan), plus
  --host-reserve-gib a process (docs/memory.md#host-memory).
- Image-text releases: --images-per-row images a row (default 1 for an image-text release on image data)
  at the vision tower's resolution; images only where each has a fixed token count (Gemma 3).
- MoE: tokens are routed evenly (fake tensors have no values to route by); a skewed router sends some ranks
  more. The held-out evaluation before training is not planned.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch
import torch.distributed as dist
from fake_batches import fake_batch  # beside this script
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as ac_wrappers
from torch.testing._internal.distributed.fake_pg import FakeStore

from common import cp, lora, loss
from common.config import Config, ConfigError, TrainConfig
from common.data.batches import Batch
from common.evaluate import score_shard
from common.experts import loads_whole, split_within_experts
from common.mesh import build_dp_mesh, build_meshes
from common.model import build_meta_model, load_model_config, materialise
from common.moe import apply_tp_ep, build_moe_meshes, fsdp_meshes
from common.ops.cli import run_cli
from common.ops.config_sources import apply_override
from common.ops.metrics import GIB, CommCounter, sharded_state_bytes
from common.optim import build_optimizer
from common.tp import apply_tp
from common.wrap import apply_fsdp
from estimate_memory_inputs import images_per_row, offline_model, parse, pick_recipe  # beside this script
from fake_run_patches import (  # beside this script
    forget_module_stats_before,
    grouped_mm_in_float32,
    isolate_sharding_propagation,
    label_accumulated_gradients,
    pass_over_units_no_forward_ran,
    route_tokens_evenly,
    track_the_global_peak_only,
    unpinned_offload,
)
from host_memory_plan import host_plan, host_report, pinned  # beside this script
from memory_report import table  # beside this script

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
SCRIPTS_OF = {"pretrain": "pretrain_fsdp", "eval": "eval_cp", "moe": "finetune_moe_ep_fsdp"}
# FSDPMemTracker's categories, grouped as the report shows them.
CATEGORIES = {
    "parameters": ["Sharded Param"],
    "gradients": ["Sharded Grad", "Unsharded Grad"],
    "optimizer_state": ["OptState"],
    "all_gather_reduce_scatter": ["Unsharded Param", "All Gather", "Reduce Scatter"],
    "activations": ["Activation", "Temp", "Inputs"],
}


class HostCopies(torch.autograd.graph.saved_tensors_hooks):
    """What torch's offload_wrapper (fsdp.activation_checkpointing_offload) does on a GPU, as the tracker
    must see it: save_on_cpu moves each checkpointed layer's input to host memory, which the tracker does not
    count, and backward copies it back into a new device tensor. Here every tensor is on the CPU and the copy
    would be counted, so only the shape is kept (fake tensors hold no data); `held` counts the bytes the
    host holds, now and at most."""

    def __init__(self, held: dict, pin_memory: bool = False, device_type: str = "cuda") -> None:
        def pack(tensor: torch.Tensor) -> tuple:
            held["now"] += tensor.nbytes
            held["peak"] = max(held["peak"], held["now"])
            return tensor.shape, tensor.dtype, tensor.nbytes

        def unpack(kept: tuple) -> torch.Tensor:
            held["now"] -= kept[2]
            return torch.empty(kept[0], dtype=kept[1])

        super().__init__(pack, unpack)


def load_script(name: str):
    """A recipe script as a module, for its config check and loss: the estimate runs the recipe's code."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peak_breakdown(tracker: FSDPMemTracker) -> dict:
    """The peak's bytes per category, with what the categories miss as "rest"."""
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_name = {getattr(key, "value", key): value for key, value in snapshot.items()}
    parts = {group: sum(by_name.get(name, 0) for name in names) for group, names in CATEGORIES.items()}
    parts["rest"] = by_name["Total"] - sum(parts.values())
    return {"peak": by_name["Total"], **parts}


def shard_on_meta(cfg: Config, recipe: str, world_size: int, device_type: str) -> dict:
    """What the recipe does before it allocates anything, as this process's fake rank: its config check,
    meshes, TP/EP plans and apply_fsdp, on `meta`."""
    script = load_script(SCRIPTS_OF[recipe])
    t, cp_size = cfg.train, cfg.parallelism.cp_size
    checked = script.check_config(cfg, world_size) if recipe != "moe" else None
    hf_config = load_model_config(cfg.model, cfg.data.seq_len)
    if cp_size > 1:  # as the scripts' main() do; the planner runs the all-gather one
        cfg.model.attn_implementation = cp.use_cp_attention(hf_config)
    model = build_meta_model(hf_config, cfg.model, t.gradient_checkpointing)
    if recipe == "pretrain" and cfg.lora.r:  # as pretrain_fsdp.py's main() does
        lora.add_adapters(model, cfg.lora, device_type)
    loss.compute_loss_in_output_layer(model)
    params = sum(p.numel() for p in model.parameters())  # before TP and EP split them
    experts, expert_mesh, moe = [], None, None
    if recipe == "pretrain":
        dp_replicate, dp_shard, dp_size = checked
        mesh, tp_mesh = build_meshes("cpu", dp_replicate, dp_shard * cp_size, cfg.parallelism.tp_size)
        if tp_mesh is not None:  # as pretrain_fsdp.py's main() does
            apply_tp(model, tp_mesh)
    elif recipe == "eval":
        mesh = build_dp_mesh("cpu", 1, world_size)
    else:
        sizes, num_experts, aux_loss_fn = script.check_config(cfg, world_size, model)
        dense_mesh, expert_mesh = build_moe_meshes("cpu", sizes)
        experts = apply_tp_ep(model, sizes, dense_mesh, expert_mesh)
        mesh, expert_mesh = fsdp_meshes(dense_mesh, expert_mesh)
        dp_size, moe = sizes.dp, (num_experts, aux_loss_fn, sizes.tp)
    training = recipe != "eval"  # a forward-only run reshards every unit after forward
    sharding = apply_fsdp(
        model, mesh, cfg.fsdp, device_type, experts=experts, expert_mesh=expert_mesh, training=training
    )
    micro_batch, accumulation = cfg.eval.batch_size, 1
    if recipe != "eval":
        micro_batch, accumulation = t.micro_batch_size, t.global_batch_size // (t.micro_batch_size * dp_size)
    return dict(
        params=params,
        script=script,
        model=model,
        hf_config=hf_config,
        sharding=sharding,
        moe=moe,
        micro_batch=micro_batch,
        accumulation=accumulation,
    )


def measure(cfg: Config, recipe: str, world_size: int, device_type: str, images: int = 0) -> dict:
    """One fake run of `recipe` on rank 0 of `world_size`: peak bytes by category, state bytes, comm.
    `images`: each row's images (an image-text release); 0 plans text rows."""
    cfg = copy.deepcopy(cfg)  # the check below may set model.attn_implementation
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    device, offloaded = torch.device("cpu"), {"now": 0, "peak": 0}
    ac_wrappers.save_on_cpu = partial(HostCopies, offloaded)  # what offload_wrapper's forward enters
    try:
        built = shard_on_meta(cfg, recipe, world_size, device_type)
        script, model, micro_batch = built["script"], built["model"], built["micro_batch"]
        accumulation, seq_len, cp_size = built["accumulation"], cfg.data.seq_len, cfg.parallelism.cp_size
        cp_state = None
        if cp_size > 1 or recipe == "eval":  # as each script does
            load_balance = cfg.eval.load_balance if recipe == "eval" else True
            cp_state = cp.build_cp_state(seq_len, cp_size, load_balance, device)
        # Meshes, CP state and the sharding plan are real or on `meta`; from the weights on, all is fake.
        with FakeTensorMode(allow_non_fake_inputs=True):
            materialise(model, device)  # and an image-text release's vision units gathered once
            documents = recipe == "moe" or cfg.data.document_mask
            batch = fake_batch(micro_batch, seq_len, built["hf_config"], documents, images)
            optimizer = None if recipe == "eval" else build_optimizer(model, cfg, torch.device(device_type))
            tracker = FSDPMemTracker(model, optimizer)
            track_the_global_peak_only(tracker)
            pass_over_units_no_forward_ran(tracker)
            if recipe == "pretrain":
                chunk = cfg.train.loss_chunk_tokens
                loss_of = lambda: script.token_loss_sum(model, batch, device, cp_state, chunk)  # noqa: E731
            elif recipe == "moe":
                loss_of = moe_loss(script, model, batch, built["moe"], cfg.train)
            if recipe != "eval":
                loss_of = forget_module_stats_before(tracker, loss_of)

            def step():
                if recipe == "eval":
                    return eval_step(model, batch, cp_state, cfg)
                train_step(model, optimizer, loss_of, accumulation, cfg.train.sync_each_batch)

            tracker.track_inputs((batch.input_ids, batch.labels))
            with tracker, label_accumulated_gradients(tracker), CommCounter().patch() as comm:
                step()  # the first step creates the optimizer state
                tracker.reset_mod_stats()
                comm.reset()
                step()
            state = sharded_state_bytes(model, optimizer) if optimizer else {}
            # Parameters with AdamW state: those with a gradient in the steps (an unused module has none)
            adam = optimizer.state if optimizer else {}
            stepped = {n for n, p in model.named_parameters() if adam.get(p)} if optimizer else None
            result = {
                **peak_breakdown(tracker),
                **built["sharding"],
                "params": built["params"],
                "micro_batch_size": micro_batch,
                "accumulation": accumulation,
                "state": state,
                "comm_bytes_per_step": comm_per_step(comm.counts, accumulation, cfg.train.sync_each_batch),
                "host_copies_bytes": offloaded["peak"],
                "stepped": stepped,
            }
    finally:
        dist.destroy_process_group()
    if cfg.fsdp.cpu_offload:  # sharded parameters, gradients and optimizer state then live in host memory
        result["peak"] -= result["parameters"] + result["gradients"] + result["optimizer_state"]
    return result


def moe_loss(script, model, batch: Batch, moe: tuple, t: TrainConfig):
    """finetune_moe_ep_fsdp.py's loss: cross-entropy on answer tokens plus the weighted router loss. Its
    per-expert token counts (host-side statistics) are skipped: bincount's size depends on values."""
    script.router_load = lambda logits, top_k, valid: torch.zeros(len(logits), logits[0].shape[-1])
    loss_fn = script.MoeLoss(model, moe[1], moe[0], t, moe[2])

    def loss() -> torch.Tensor:
        ce, aux, _ = loss_fn(model, batch, torch.device("cpu"))
        return ce + loss_fn.coef * aux

    return loss


def comm_per_step(counts: dict, accumulation: int, sync_each_batch: bool) -> dict:
    """The measured step ran min(accumulation, 2) micro-batches: scale to the config's whole step. Every
    micro-batch all-gathers; gradients are reduce-scattered per micro-batch, or once (sync_each_batch)."""
    measured = min(accumulation, 2)
    all_gather = counts["all_gather_bytes"] // measured * accumulation
    reduce_scatter = counts["reduce_scatter_bytes"]
    if sync_each_batch:
        reduce_scatter = reduce_scatter // measured * accumulation
    return {"all_gather_bytes": all_gather, "reduce_scatter_bytes": reduce_scatter}


def train_step(model, optimizer, loss, accumulation: int, sync_each_batch: bool) -> None:
    """The recipe's forward and loss, backward with its gradient-sync rule, and the AdamW step. Two
    micro-batches stand for any accumulation: unsharded gradients accumulate in place after the first."""
    micro_batches = min(accumulation, 2)
    for i in range(micro_batches):
        model.set_requires_gradient_sync(sync_each_batch or i == micro_batches - 1)
        loss().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def eval_step(model, batch, cp_state, cfg: Config) -> None:
    """The evaluation's forward and loss on this rank's positions (common/evaluate.py). Always the
    all-gather attention: torch's ring attention (eval.attention=torch_cp) needs CUDA kernels, and holds
    less."""
    score_shard(model, batch, torch.device("cpu"), cp_state, "allgather", cfg.eval.loss_chunk_tokens)


def per_rank_shards(
    cfg: Config, recipe: str, world_size: int, device_type: str, stepped: set | None
) -> list[dict]:
    """Every rank's parameter, trained-parameter (= gradient) and optimizer bytes, and its parameters'
    elements: the model sharded on `meta` as each rank would hold it. AdamW keeps two states the shape of
    each parameter the fake steps gave a gradient, `stepped` (None: evaluation), checked on rank 0 against
    the real state: a frozen LoRA base has none, nor a vision tower that text rows never run, nor a module
    never called. What cpu_offload pins on a GPU: each parameter's padded chunk and each gradient, a power
    of two apiece. Rank 0's also has the whole model's bytes, and whether Transformers converts its weights
    as it saves them."""
    out, chunks = [], []
    for rank in range(world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            model = shard_on_meta(copy.deepcopy(cfg), recipe, world_size, device_type)["model"]
            local = [
                (p.to_local(), n in stepped if stepped else p.requires_grad)
                for n, p in model.named_parameters()
            ]
            grads = [t.numel() * t.element_size() for t, trains in local if trains]
            trained = sum(grads)
            if rank == 0:  # FSDP pads every rank's chunk to rank 0's, the largest (torch.chunk)
                chunks = [t.numel() * t.element_size() for t, _ in local]
            out.append(
                {
                    "param_bytes": sum(t.numel() * t.element_size() for t, _ in local),
                    "optimizer_bytes": 2 * trained if recipe != "eval" else 0,
                    "trained_bytes": trained,
                    "numel": sum(t.numel() for t, _ in local),
                    "pinned_param_bytes": sum(map(pinned, chunks)),
                    "pinned_grad_bytes": sum(map(pinned, grads)) if recipe != "eval" else 0,
                    # fused expert weights (3-D) that FSDP splits within experts: copied to the host at export
                    "split_expert_numel": sum(
                        p.to_local().numel()
                        for p in model.parameters()
                        if p.ndim == 3 and split_within_experts(p)
                    ),
                }
            )
            if rank == 0:
                out[0]["model_numel"] = sum(p.numel() for p in model.parameters())
                out[0]["loads_whole"] = loads_whole(model)
        finally:
            dist.destroy_process_group()
    return out


def estimate(
    cfg: Config,
    recipe: str,
    world_size: int,
    device_type: str,
    budget_gib: float,
    quick: bool,
    images: int = 0,
):
    """One config's measurement, and the largest micro-batch that fits: the peak is measured again at twice
    the micro-batch (same accumulation), and grows linearly in between (activations are per sequence)."""
    base = measure(cfg, recipe, world_size, device_type, images)
    if quick:
        return {**base, "max_micro_batch_size": None}
    if base["peak"] > budget_gib * GIB and base["micro_batch_size"] == 1:
        return {**base, "max_micro_batch_size": 0}  # no smaller micro-batch to measure
    doubled = copy.deepcopy(cfg)
    if recipe != "eval":
        doubled.train.micro_batch_size *= 2
        doubled.train.global_batch_size *= 2
    else:
        doubled.eval.batch_size *= 2
    micro_batch = base["micro_batch_size"]
    per_sequence = (
        measure(doubled, recipe, world_size, device_type, images)["peak"] - base["peak"]
    ) / micro_batch
    fixed = base["peak"] - per_sequence * micro_batch
    largest = math.floor((budget_gib * GIB - fixed) / per_sequence)
    return {**base, "per_sequence_bytes": per_sequence, "max_micro_batch_size": max(largest, 0)}


def advice(
    cfg: Config,
    recipe: str,
    world_size: int,
    device_type: str,
    budget_gib: float,
    base: dict,
    images: int = 0,
):
    """For a config that does not fit: the peak with each single change that lowers memory."""
    t, fsdp, trains = cfg.train, cfg.fsdp, recipe != "eval"
    changes = [
        ("fsdp.activation_checkpointing=true", trains and not fsdp.activation_checkpointing),
        ("train.sync_each_batch=true", base["accumulation"] > 1 and not t.sync_each_batch),
        ("fsdp.reshard_after_forward=true", fsdp.reshard_after_forward is not True),
        ("fsdp.cpu_offload=true", not fsdp.cpu_offload),
        ("train.micro_batch_size=1", trains and t.micro_batch_size > 1),
    ]
    trials = [([change], world_size) for change, useful in changes if useful]
    trials.append(([], 2 * world_size))
    out = []
    for overrides, world in trials:
        changed = copy.deepcopy(cfg)
        for override in overrides:
            apply_override(changed, override)
        name = overrides[0] if overrides else f"--world-size {world}"
        try:
            peak = measure(changed, recipe, world, device_type, images)["peak"] / GIB
        except ConfigError as error:  # e.g. a global batch that twice the ranks cannot split
            out.append({"change": name, "error": str(error)})
            continue
        out.append({"change": name, "peak_gib": peak, "fits": peak <= budget_gib})
    return out


def main(argv: list[str] | None = None) -> None:
    args, cfg = parse(argv, __doc__)
    # Transformers checks an image's placeholder tokens against its features by value; fake tensors have
    # none. Its own switch for production runs turns these checks off.
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"
    offline_model(cfg)
    recipe = pick_recipe(args.recipe, args.config, load_model_config(cfg.model))
    cfg.train.compile = False
    isolate_sharding_propagation()
    route_tokens_evenly()
    grouped_mm_in_float32()
    unpinned_offload()
    budget = args.gpu_memory_gib - args.reserve_gib
    images = images_per_row(args.images_per_row, cfg, load_model_config(cfg.model))
    result = estimate(cfg, recipe, args.world_size, args.device, budget, args.quick, images)
    shards = per_rank_shards(cfg, recipe, args.world_size, args.device, result["stepped"])
    states = [{"param_bytes": s["param_bytes"], "optimizer_bytes": s["optimizer_bytes"]} for s in shards]
    if result["state"] and result["state"] != states[0]:
        raise SystemExit(f"estimate_memory: rank 0's state {result['state']} != {states[0]} (a bug here)")
    peak = result["peak"] / GIB
    report = {
        "recipe": recipe,
        "world_size": args.world_size,
        "images_per_row": images,
        "device": args.device,
        "gpu_memory_gib": args.gpu_memory_gib,
        "reserve_gib": args.reserve_gib,
        "peak_gib_per_rank": peak,
        "fits": peak <= budget,
        "headroom_gib": budget - peak,
        "breakdown_bytes": {k: result[k] for k in (*CATEGORIES, "rest")},
        "state_bytes_per_rank": states,
        "max_micro_batch_size": result["max_micro_batch_size"],
        "fsdp_units": result["fsdp_units"],
        "params_kept_after_forward": result["params_kept_after_forward"],
        "params": result["params"],
        "comm_bytes_per_step": result["comm_bytes_per_step"],
        "host": host_report(host_plan(cfg, recipe, args.device, shards, result), args),
    }
    if not report["fits"] and not args.quick:
        report["alternatives"] = advice(cfg, recipe, args.world_size, args.device, budget, result, images)
    print(table(report))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    run_cli(main)
