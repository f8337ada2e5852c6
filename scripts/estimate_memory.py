"""Will it fit? Each rank's peak GPU memory for a recipe's config, from real training steps on fake tensors.

    python scripts/estimate_memory.py --config configs/llama.json --world-size 8 --gpu-memory-gib 80
    python scripts/estimate_memory.py --config configs/eval_cp_llama.json --world-size 8 --json
    python scripts/estimate_memory.py --config configs/debug_llama.json --world-size 2 --device cpu

The recipe's own code runs: its config checks, mesh, CP setup, apply_fsdp (wrap policy, activation
checkpointing, mixed precision, reshard, offload) and its loss, then forward, backward and AdamW steps at the
config's micro-batch and sequence length. It runs under FakeTensorMode with a fake process group of
--world-size ranks on the CPU: tensors have shapes and no data, so an 8B model needs no memory, GPU,
weights, tokenizer or dataset. This process plays rank 0, whose shards are the largest. torch's
FSDPMemTracker counts every tensor alive at every op; the peak is taken over two steps, the second one
with optimizer state.

Planning for a GPU on a CPU (--device cuda, the default):
- Mixed precision resolves as on CUDA (bf16 parameters and fp32 reduction unless the config says otherwise).
- Tensors stay on the CPU: fake CUDA tensors cannot run autograd in a CPU build of torch. SDPA then runs
  torch's CPU flash kernel, which keeps what CUDA's flash and memory-efficient kernels keep (the output and
  a logsumexp, never a sequence x sequence matrix), so attention costs the same memory.
- Not counted: the CUDA context, NCCL buffers and allocator fragmentation; --reserve-gib (default 3) is added
  to the peak before it is compared with --gpu-memory-gib.
- train.compile is ignored: compiled layers fuse elementwise ops and save less, so eager is an upper bound.
- Gradient clipping and the loss's host reads (.item()) are left out: they hold a few scalars per tensor.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import _disable_current_modes

from common import cp
from common.config import Config, ConfigError
from common.config_sources import apply_override, load_config, run_cli
from common.data import Batch
from common.mesh import build_dp_mesh
from common.metrics import GIB, CommCounter, sharded_state_bytes
from common.model import build_meta_model, init_buffers, load_model_config
from common.optim import build_optimizer
from common.wrap import apply_fsdp

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
# Architecture-only copies of the hub configs the shipped configs name, so planning needs no network.
HUB_CONFIGS = os.path.join(os.path.dirname(SCRIPTS), "configs", "hub")

# FSDPMemTracker's categories, grouped as the report shows them.
CATEGORIES = {
    "parameters": ["Sharded Param"],
    "gradients": ["Sharded Grad", "Unsharded Grad"],
    "optimizer_state": ["OptState"],
    "all_gather_reduce_scatter": ["Unsharded Param", "All Gather", "Reduce Scatter"],
    "activations": ["Activation", "Temp", "Inputs"],
}


def isolate_sharding_propagation() -> None:
    """DTensor computes an op's output shapes by running it on global-shape fake tensors, in the active fake
    mode if there is one. Outside fake mode FSDPMemTracker ignores those (they run in a fresh mode); here
    they ran in ours and were counted, e.g. fused AdamW's full-size parameters, gradients and states as
    ~17x the real optimizer state. Running the propagation in a fresh mode restores what a real run sees.
    (Private torch API, pinned torch; there is no public switch.)"""
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def in_fresh_fake_mode(self, op_schema):
        with unset_fake_temporarily():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = in_fresh_fake_mode


def causal_bias_outside_fake_mode() -> None:
    """torch's CausalBias (common/cp.py's lower-right mask) is a tensor subclass that cannot be created
    under a dispatch mode (fake tensors, the tracker); it holds two sizes and no data, so create it
    outside. On CPU, SDPA then materialises it as a [query block, keys] bool mask (at most 128 MiB at 128k
    tokens) that CUDA's kernels never build."""
    original = cp.causal_lower_right

    def outside(*sizes):
        with _disable_current_modes():
            return original(*sizes)

    cp.causal_lower_right = outside


def label_accumulated_gradients(tracker: FSDPMemTracker, model: torch.nn.Module) -> None:
    """With accumulation and no gradient sync, FSDP2 keeps each parameter's unsharded gradient in the
    reduce dtype until the last micro-batch. FSDPMemTracker only labels `.grad`, so it counted these (the
    whole model in fp32 on every rank, 30 GiB at 8B) as backward temporaries. Relabel them as
    gradients. (Private FSDP and tracker state, pinned torch: there is no public accessor.)"""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    if fsdp_param.unsharded_accumulated_grad is not None:
                        tracker._update_and_maybe_create_winfos(
                            fsdp_param.unsharded_accumulated_grad, _FSDPRefType.UNSHARDED_GRAD
                        )


def load_script(name: str):
    """A recipe script as a module, for its config check and loss: the estimate runs the recipe's code."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def pick_recipe(requested: str, config_path: str, cfg: Config, hf_config) -> str:
    if requested != "auto":
        return requested
    if any(hasattr(hf_config, key) for key in ("num_experts", "num_local_experts")):
        return "moe"
    with open(config_path) as f:
        return "pretrain" if "train" in json.load(f) else "eval"


def fake_batch(micro_batch: int, seq_len: int, vocab: int) -> Batch:
    input_ids = torch.randint(0, vocab, (micro_batch, seq_len))
    return Batch(input_ids=input_ids, labels=input_ids.clone(), sample_ids=[])


def peak_breakdown(tracker: FSDPMemTracker) -> dict:
    """The peak's bytes per category, with what the categories miss as "rest"."""
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_name = {getattr(key, "value", key): value for key, value in snapshot.items()}
    parts = {group: sum(by_name.get(name, 0) for name in names) for group, names in CATEGORIES.items()}
    parts["rest"] = by_name["Total"] - sum(parts.values())
    return {"peak": by_name["Total"], **parts}


def measure(cfg: Config, recipe: str, world_size: int, device_type: str) -> dict:
    """One fake run of `recipe` on rank 0 of `world_size`: peak bytes by category, state bytes, comm."""
    script = load_script({"pretrain": "pretrain_fsdp", "eval": "eval_cp"}[recipe])
    cfg = copy.deepcopy(cfg)  # the check below may set model.attn_implementation
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    device = torch.device("cpu")
    try:
        t, seq_len, cp_size = cfg.train, cfg.data.seq_len, cfg.parallelism.cp_size
        if recipe == "pretrain":
            dp_replicate, dp_shard, dp_size = script.check_config(cfg, world_size)
            mesh = build_dp_mesh("cpu", dp_replicate, dp_shard * cp_size)
            micro_batch = t.micro_batch_size
            accumulation = t.global_batch_size // (micro_batch * dp_size)
        else:
            script.check_config(cfg, world_size)
            mesh = build_dp_mesh("cpu", 1, world_size)
            micro_batch, accumulation = cfg.eval.batch_size, 1
        positions = None
        if cp_size > 1 or recipe == "eval":  # as each script does
            load_balance = cfg.eval.load_balance if recipe == "eval" else True
            positions, _, _ = cp.setup(seq_len, cp_size, load_balance, device, cfg.data.document_mask)
        # Meshes and CP state hold real tensors; everything from the model on is fake.
        with FakeTensorMode(allow_non_fake_inputs=True):
            hf_config = load_model_config(cfg.model, seq_len)
            model = build_meta_model(hf_config, cfg.model, t.gradient_checkpointing)
            sharding = apply_fsdp(model, mesh, cfg.fsdp, device_type)
            model.to_empty(device=device)
            init_buffers(model, device)
            batch = fake_batch(micro_batch, seq_len, hf_config.vocab_size)
            if recipe == "pretrain":
                optimizer = build_optimizer(model, cfg, torch.device(device_type))
            else:
                optimizer = None
            tracker = FSDPMemTracker(model, optimizer)

            def step():
                if recipe == "eval":
                    return eval_step(script, model, batch, positions, cfg)
                after_backward = lambda: label_accumulated_gradients(tracker, model)  # noqa: E731
                train_step(script, model, optimizer, batch, positions, accumulation, t, after_backward)

            tracker.track_inputs((batch.input_ids, batch.labels))
            with tracker, CommCounter().patch() as comm:
                step()  # the first step creates the optimizer state
                tracker.reset_mod_stats()
                comm.reset()
                step()
            state = sharded_state_bytes(model, optimizer) if optimizer else {}
            result = {
                **peak_breakdown(tracker),
                **sharding,
                "params": sum(p.numel() for p in model.parameters()),
                "micro_batch_size": micro_batch,
                "state": state,
                "comm_bytes_per_step": comm_per_step(comm.counts, accumulation, t.sync_each_batch),
            }
    finally:
        dist.destroy_process_group()
    if cfg.fsdp.cpu_offload:  # sharded parameters, gradients and optimizer state then live in host memory
        result["peak"] -= result["parameters"] + result["gradients"] + result["optimizer_state"]
    return result


def comm_per_step(counts: dict, accumulation: int, sync_each_batch: bool) -> dict:
    """The measured step ran min(accumulation, 2) micro-batches: scale to the config's whole step. Every
    micro-batch all-gathers; gradients are reduce-scattered per micro-batch, or once (sync_each_batch)."""
    measured = min(accumulation, 2)
    all_gather = counts["all_gather_bytes"] // measured * accumulation
    reduce_scatter = counts["reduce_scatter_bytes"]
    if sync_each_batch:
        reduce_scatter = reduce_scatter // measured * accumulation
    return {"all_gather_bytes": all_gather, "reduce_scatter_bytes": reduce_scatter}


def train_step(script, model, optimizer, batch, positions, accumulation: int, t, after_backward) -> None:
    """The recipe's forward and loss, backward with its gradient-sync rule, and the AdamW step. Two
    micro-batches stand for any accumulation: unsharded gradients accumulate in place after the first."""
    micro_batches = min(accumulation, 2)
    for i in range(micro_batches):
        model.set_requires_gradient_sync(t.sync_each_batch or i == micro_batches - 1)
        script.token_loss_sum(model, batch, torch.device("cpu"), positions).backward()
        after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def eval_step(script, model, batch, positions, cfg: Config) -> None:
    """eval_cp.py's forward on this rank's positions and its chunked head loss. Always the all-gather
    attention: torch's ring attention (eval.attention=torch_cp) needs CUDA kernels, and holds less."""
    hidden = {}
    handle = model.get_decoder().register_forward_hook(
        lambda module, args, out: hidden.update(last=out.last_hidden_state)
    )
    labels = script.forward_shard(model, batch.input_ids, batch.labels, None, "allgather", None, positions)
    script.head_loss(model, hidden["last"], labels, cfg.eval.loss_chunk_tokens)
    handle.remove()


def per_rank_state_bytes(cfg: Config, recipe: str, world_size: int, device_type: str) -> list[dict]:
    """Every rank's parameter and optimizer bytes: the model sharded on `meta` as each rank would hold
    it. AdamW keeps two states the shape of each parameter (checked on rank 0 against the real state)."""
    out = []
    for rank in range(world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            if recipe == "pretrain":
                dp_replicate, dp_shard, _ = load_script("pretrain_fsdp").check_config(
                    copy.deepcopy(cfg), world_size
                )
                mesh = build_dp_mesh("cpu", dp_replicate, dp_shard * cfg.parallelism.cp_size)
            else:
                mesh = build_dp_mesh("cpu", 1, world_size)
            model = build_meta_model(load_model_config(cfg.model), cfg.model)
            apply_fsdp(model, mesh, cfg.fsdp, device_type)
            params = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
            out.append({"param_bytes": params, "optimizer_bytes": 2 * params if recipe == "pretrain" else 0})
        finally:
            dist.destroy_process_group()
    return out


def estimate(cfg: Config, recipe: str, world_size: int, device_type: str, budget_gib: float) -> dict:
    """One config's measurement, and the largest micro-batch that fits: the peak is measured again at twice
    the micro-batch (same accumulation), and grows linearly in between (activations are per sequence)."""
    base = measure(cfg, recipe, world_size, device_type)
    doubled = copy.deepcopy(cfg)
    if recipe == "pretrain":
        doubled.train.micro_batch_size *= 2
        doubled.train.global_batch_size *= 2
    else:
        doubled.eval.batch_size *= 2
    micro_batch = base["micro_batch_size"]
    per_sequence = (measure(doubled, recipe, world_size, device_type)["peak"] - base["peak"]) / micro_batch
    fixed = base["peak"] - per_sequence * micro_batch
    largest = math.floor((budget_gib * GIB - fixed) / per_sequence)
    return {**base, "per_sequence_bytes": per_sequence, "max_micro_batch_size": max(largest, 0)}


def advice(cfg: Config, recipe: str, world_size: int, device_type: str, budget_gib: float) -> list[dict]:
    """For a config that does not fit: the peak with each single change that lowers memory."""
    t, fsdp = cfg.train, cfg.fsdp
    dp_size = world_size // cfg.parallelism.cp_size
    accumulates = recipe == "pretrain" and t.global_batch_size > t.micro_batch_size * dp_size
    changes = [
        ("fsdp.activation_checkpointing=true", recipe == "pretrain" and not fsdp.activation_checkpointing),
        ("train.sync_each_batch=true", accumulates and not t.sync_each_batch),
        ("fsdp.reshard_after_forward=true", fsdp.reshard_after_forward is not True),
        ("fsdp.cpu_offload=true", not fsdp.cpu_offload),
        ("train.micro_batch_size=1", recipe == "pretrain" and t.micro_batch_size > 1),
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
            peak = measure(changed, recipe, world, device_type)["peak"] / GIB
        except ConfigError as error:  # e.g. a global batch that twice the ranks cannot split
            out.append({"change": name, "error": str(error)})
            continue
        out.append({"change": name, "peak_gib": peak, "fits": peak <= budget_gib})
    return out


def table(report: dict) -> str:
    gib = lambda n: f"{n / GIB:.2f}"  # noqa: E731
    state = report["state_bytes_per_rank"][0]
    rows = [
        ("recipe", report["recipe"]),
        ("world size / FSDP units", f"{report['world_size']} / {report['fsdp_units']}"),
        ("parameters (model)", f"{report['params'] / 1e9:.2f} B"),
        ("peak per rank, GiB", f"{report['peak_gib_per_rank']:.2f} + {report['reserve_gib']} reserve"),
        *((f"  {name}, GiB", gib(report["breakdown_bytes"][name])) for name in report["breakdown_bytes"]),
        ("GPU memory, GiB", f"{report['gpu_memory_gib']}"),
        ("fits / headroom, GiB", f"{'yes' if report['fits'] else 'NO'} / {report['headroom_gib']:.2f}"),
        ("largest micro-batch that fits", report["max_micro_batch_size"]),
        (
            "param / grad / optimizer bytes per rank",
            "{:,} / {:,} / {:,}".format(
                state["param_bytes"],
                state["param_bytes"] if report["recipe"] != "eval" else 0,
                state["optimizer_bytes"],
            ),
        ),
        (
            "all-gather / reduce-scatter bytes per step",
            "{:,} / {:,}".format(
                report["comm_bytes_per_step"]["all_gather_bytes"],
                report["comm_bytes_per_step"]["reduce_scatter_bytes"],
            ),
        ),
    ]
    for alternative in report.get("alternatives", []):
        if "error" in alternative:
            rows.append((f"with {alternative['change']}", alternative["error"]))
            continue
        verdict = "fits" if alternative["fits"] else "does not fit"
        rows.append((f"with {alternative['change']}", f"{alternative['peak_gib']:.2f} GiB, {verdict}"))
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'':{width}} | estimate |", f"|{'-' * (width + 2)}|----------|"]
    return "\n".join(lines + [f"| {name:{width}} | {value} |" for name, value in rows])


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    parser.add_argument("--reserve-gib", type=float, default=3.0, help="CUDA context, NCCL, fragmentation")
    parser.add_argument("--recipe", choices=["auto", "pretrain", "eval", "moe"], default="auto")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="the run to plan for")
    parser.add_argument("--json", action="store_true", help="also print one JSON object on stdout")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        raise ConfigError(f"--world-size is {args.world_size}; give the number of GPUs, at least 1")
    return args, load_config(args.config, args.overrides)


def main(argv: list[str] | None = None) -> None:
    args, cfg = parse(argv)
    offline_model(cfg)
    recipe = pick_recipe(args.recipe, args.config, cfg, load_model_config(cfg.model))
    if recipe == "moe":
        raise SystemExit(
            "estimate_memory: MoE configs are not planned yet (EP routes tokens by data-dependent sizes, "
            "which fake tensors do not have)"
        )
    cfg.train.compile = False
    isolate_sharding_propagation()
    causal_bias_outside_fake_mode()
    budget = args.gpu_memory_gib - args.reserve_gib
    result = estimate(cfg, recipe, args.world_size, args.device, budget)
    states = per_rank_state_bytes(cfg, recipe, args.world_size, args.device)
    if result["state"] and result["state"] != states[0]:
        raise SystemExit(f"estimate_memory: rank 0's state {result['state']} != {states[0]} (a bug here)")
    peak = result["peak"] / GIB
    report = {
        "recipe": recipe,
        "world_size": args.world_size,
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
        "params": result["params"],
        "comm_bytes_per_step": result["comm_bytes_per_step"],
    }
    if not report["fits"]:
        report["alternatives"] = advice(cfg, recipe, args.world_size, args.device, budget)
    print(table(report))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    run_cli(main)
