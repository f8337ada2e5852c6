"""Baseline: the same Llama, data and optimizer as scripts/pretrain_fsdp.py, trained by the Transformers
`Trainer` with Accelerate FSDP2, for throughput and memory comparisons.

    torchrun --nproc_per_node 2 benchmarks/trainer_baseline.py --model-config configs/debug_tiny.json \
        --seq-len 64 --embedded-max-bytes 1000000 --steps 20 --global-batch-size 8 --micro-batch-size 2 \
        --lr 3e-3 --warmup-steps 2 --out /tmp/trainer_default.json [--best]

Same work on both sides. The model is `from_config` of the LlamaConfig given (JSON text, or a run config whose
model.config is used), fp32, sdpa, use_cache off. The rows are our recipe's: common.data.build_batches gives
the cached, packed [seq_len + 1] rows of the embedded corpus, and sample k here is the recipe's sample k. Each
item is {"input_ids": row[:-1], "labels": row[1:], "shift_labels": row[1:]}: `shift_labels` tells HF's
ForCausalLMLoss (transformers/loss/loss_utils.py:63) that the labels are already shifted, and the Trainer
counts the loss's denominator on it (trainer.py:2336), so each step has the same global_batch x seq_len inputs
and targets as the recipe, normalised by the same global target count (average_tokens_across_devices, on by
default). The sampler is sequential, so an optimizer step sees the recipe's samples [s*B, (s+1)*B) (split over
ranks differently). AdamW with the same lr/betas/eps/weight_decay (the Trainer, like the recipe, exempts norm
weights and biases), clipping, and `cosine_with_min_lr` with min_lr_rate: the recipe's cosine exactly, but the
Trainer's warmup starts at lr 0 (step/warmup) where the recipe's starts at lr/warmup ((step+1)/warmup).

FSDP2 on CPU needs a patch. `use_cpu=True, ddp_backend="gloo"` gives a gloo group and
DistributedType.MULTI_CPU (accelerate/state.py:800-808). Without use_cpu, a machine with no accelerator gets
DistributedType.NO even with a gloo group (state.py:769-810) and the Trainer stops: "Using fsdp only works in
distributed training" (trainer.py:477). With use_cpu it runs, but AcceleratorState turns an fsdp_plugin into
DistributedType.FSDP only when the type is MULTI_GPU/XPU/NPU/... (state.py:986-1016); MULTI_CPU is not in that
list, so the Trainer's plugin is silently dropped, `trainer.is_fsdp_enabled` is False (trainer.py:875) and
Accelerator.prepare_model wraps the model in DDP (accelerator.py:2058). Environment variables cannot help:
ACCELERATE_USE_FSDP counts only inside that branch (state.py:1010) or to build a plugin from FSDP_* variables
(accelerator.py:388-397), and the Trainer passes its own plugin, fsdp_version=2 included. So once
TrainingArguments has made the gloo group, force_fsdp_on_cpu relabels the shared PartialState's MULTI_CPU as
MULTI_GPU; the Trainer's Accelerator then takes the FSDP branch and sets the type to FSDP, and the rest runs
on the CPU device and gloo group already made (fully_shard's default mesh is a CPU mesh over the default
group). on_train_begin then checks what is trained: FSDPModule instances, every parameter a DTensor sharded
over all ranks; otherwise the script exits non-zero. `fsdp=True` + fsdp_config is the non-deprecated spelling
of fsdp="full_shard auto_wrap" (same plugin for FSDP2, training_args.py:2888-2938).

--best adds what the Trainer documents for speed: torch_compile=True (inductor) and adamw_torch_fused, which
is already the default optimizer for torch >= 2.8 and works on CPU with DTensor shards. Measured on 2 CPU
ranks (a noisy 2-vCPU VM, +-15% run to run) neither mode wins: debug_tiny 3.8-4.1k tokens/s eager vs 3.2-4.7k
compiled, debug_llama 5.4-6.1k vs 5.3-5.8k; compile costs 10-40 s and ~70 MiB RSS per rank, and dynamo breaks
the graph at every FSDP2 hook (_fsdp_common.py), so much of the step stays eager. Accelerate's regional
compilation (ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1) is no better, optim="adamw_torch" (a for-loop on
CPU, no foreach) is 5-15% slower, and bf16=True runs but is 8x slower on this AVX2 CPU (no bf16 instructions)
and changes the math, so it is left out. Compare against the faster of the two modes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: from_config and the cached tokenizer

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from common.config import DataConfig, TrainConfig
from common.data.train_batches import build_batches
from common.mesh import gather_objects
from common.ops.cli import end_process
from common.ops.metrics import peak_memory_bytes, reset_peak_memory

CPU, GIB, T = torch.device("cpu"), 2**30, TrainConfig()  # defaults are the recipe's
BEST = {"torch_compile": True, "optim": "adamw_torch_fused"}  # --best: measured in the module docstring


class RecipeRows(torch.utils.data.Dataset):
    """Sample k of the recipe (same seed, same shuffled packed rows), as the Trainer's dict of tensors."""

    def __init__(self, batches, length: int):
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        b = self.batches.micro_batches(k)[0]
        return {"input_ids": b.input_ids[0], "labels": b.labels[0], "shift_labels": b.labels[0]}


def force_fsdp_on_cpu(args: TrainingArguments) -> None:
    """Make Accelerate keep the FSDP plugin on a CPU/gloo group (see the module docstring)."""
    state = args.distributed_state  # PartialState: its attributes are shared with the Accelerator made later
    if state.distributed_type == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.MULTI_GPU  # only read by AcceleratorState, which sets FSDP


def cpu_fsdp2_arguments(name: str, layer_classes: list[str], **kwargs) -> TrainingArguments:
    """The Trainer's arguments for FSDP2 over a gloo group on CPU (`layer_classes` its units), with
    force_fsdp_on_cpu applied; `kwargs`, the run's own."""
    args = TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), name),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        fsdp=True,
        fsdp_config={
            "version": 2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": layer_classes,
            "reshard_after_forward": True,
            "state_dict_type": "FULL_STATE_DICT",
        },
        logging_steps=1,
        disable_tqdm=True,
        **kwargs,
    )
    force_fsdp_on_cpu(args)  # sets up the gloo group (args.distributed_state) first
    return args


def check_fsdp2(model: torch.nn.Module, world: int) -> dict:
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    params = list(model.parameters())
    sharded = [
        p
        for p in params
        if isinstance(p, DTensor)
        and p.device_mesh.size() == world
        and all(pl.is_shard() for pl in p.placements)
    ]
    if units == 0 or len(sharded) != len(params):
        raise SystemExit(
            f"FSDP2 is NOT in use (Accelerate: {PartialState().distributed_type}): the Trainer trains a "
            f"{type(model).__name__} with {units} FSDPModule(s) and {len(sharded)}/{len(params)} "
            f"parameters sharded over {world} ranks"
        )
    local = sum(p.to_local().numel() for p in sharded) / sum(p.numel() for p in sharded)
    return {
        "fsdp_modules": units,
        "sharded_params": len(sharded),
        "local_param_fraction": round(local, 4),
        "mesh": str(sharded[0].device_mesh),
    }


class Probe(TrainerCallback):
    """Checks FSDP2 once training starts, times step ends, keeps the per-step losses."""

    def __init__(self, world: int):
        self.world, self.times, self.losses, self.fsdp, self.load_peak = world, [], [], {}, 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.fsdp = check_fsdp2(model, self.world)  # the prepared model, after fully_shard (and compile)
        self.load_peak = peak_memory_bytes(CPU) / GIB
        reset_peak_memory(CPU)  # like the recipe: the training peak, not the full-model build's

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", required=True, help="LlamaConfig JSON, or a run config JSON file")
    D = DataConfig
    for name, kind, default in [
        ("seq-len", int, D.seq_len),
        ("embedded-max-bytes", int, D.embedded_max_bytes),
        ("steps", int, T.steps),
        ("global-batch-size", int, T.global_batch_size),
        ("micro-batch-size", int, T.micro_batch_size),
        ("lr", float, T.lr),
        ("min-lr-ratio", float, T.min_lr_ratio),
        ("warmup-steps", int, T.warmup_steps),
        ("weight-decay", float, T.weight_decay),
        ("eps", float, T.eps),
        ("max-grad-norm", float, T.max_grad_norm),
        ("seed", int, T.seed),
    ]:
        p.add_argument(f"--{name}", type=kind, default=default)  # defaults: the recipe's (common/config.py)
    p.add_argument("--betas", type=float, nargs=2, default=T.betas)
    p.add_argument("--timing-warmup", type=int, default=5, help="first steps left out of tokens_per_s")
    p.add_argument("--best", action="store_true", help="the Trainer's best settings instead of its defaults")
    p.add_argument(
        "--trainer-args",
        type=json.loads,
        default={},
        help="extra TrainingArguments as JSON, e.g. "
        '\'{"optim": "adamw_torch"}\', applied last: to measure one setting at a time',
    )
    p.add_argument(
        "--lora-r", type=int, default=0, help="> 0: PEFT's LoRA on every linear layer (get_peft_model)"
    )
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--out", required=True, help="JSON results, written by rank 0")
    a = p.parse_args()
    if not 1 <= a.timing_warmup < a.steps:
        raise SystemExit(
            f"--timing-warmup ({a.timing_warmup}) must be at least 1 and below --steps ({a.steps})"
        )
    world = int(os.environ.get("WORLD_SIZE", 1))
    if a.global_batch_size % (a.micro_batch_size * world):
        raise SystemExit(f"--global-batch-size must be a multiple of micro-batch-size x {world} ranks")

    extra = {**(BEST if a.best else {}), **a.trainer_args}
    args = cpu_fsdp2_arguments(
        "trainer_baseline",
        ["LlamaDecoderLayer"],
        max_steps=a.steps,
        per_device_train_batch_size=a.micro_batch_size,
        gradient_accumulation_steps=a.global_batch_size // (a.micro_batch_size * world),
        learning_rate=a.lr,
        adam_beta1=a.betas[0],
        adam_beta2=a.betas[1],
        adam_epsilon=a.eps,
        weight_decay=a.weight_decay,
        max_grad_norm=a.max_grad_norm,
        warmup_steps=a.warmup_steps,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": a.min_lr_ratio},
        train_sampling_strategy="sequential",  # the recipe's sample order; the rows are already shuffled
        remove_unused_columns=False,  # keep shift_labels, which forward() takes only through **kwargs
        seed=a.seed,
        **extra,
    )

    data_cfg = DataConfig(seq_len=a.seq_len, embedded_max_bytes=a.embedded_max_bytes)
    # One sample per "step" on one "rank": batches.micro_batches(k) is then exactly the recipe's sample k.
    one = TrainConfig(seed=a.seed, global_batch_size=1, micro_batch_size=1)
    tokenizer, batches = build_batches(data_cfg, one, dp_rank=0, dp_size=1, is_main=args.process_index == 0)
    if os.path.isfile(a.model_config):
        with open(a.model_config) as f:
            values = json.load(f)
        values = values.get("model", {}).get("config", values)
    else:
        values = json.loads(a.model_config)
    config = LlamaConfig(**values, use_cache=False)
    if len(tokenizer) > config.vocab_size:
        raise SystemExit(f"the tokenizer has {len(tokenizer)} tokens but vocab_size is {config.vocab_size}")
    set_seed(a.seed)  # same init on every rank: each builds the full model before the Trainer shards it
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if a.lora_r:  # the PEFT way the Trainer documents: wrap, then hand the PeftModel to the Trainer
        lora = LoraConfig(
            r=a.lora_r, lora_alpha=a.lora_alpha, target_modules="all-linear", task_type="CAUSAL_LM"
        )
        model = get_peft_model(model, lora)

    probe = Probe(world)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RecipeRows(batches, a.steps * a.global_batch_size),
        callbacks=[probe],
    )
    if trainer.accelerator.distributed_type != DistributedType.FSDP or not trainer.is_fsdp_enabled:
        raise SystemExit(f"Accelerate chose {trainer.accelerator.distributed_type}, not FSDP")
    trainer.train()

    # from the end of the last warmup step to the end of the last step
    timed = len(probe.times) - a.timing_warmup
    elapsed = probe.times[-1] - probe.times[a.timing_warmup - 1]
    tokens_per_step = a.global_batch_size * a.seq_len  # packed rows: every target counts
    peaks, load_peaks = (
        gather_objects(round(peak_memory_bytes(CPU) / GIB, 4)),
        gather_objects(round(probe.load_peak, 4)),
    )
    if args.process_index == 0:
        result = {
            "mode": "best" if a.best else "default",
            "lora_r": a.lora_r,
            "trainer_args": extra,
            "optim": str(args.optim),
            "torch_compile": args.torch_compile,
            "world_size": world,
            "tokens_per_s": tokens_per_step * timed / elapsed,
            "step_time_s": elapsed / timed,
            "timed_steps": timed,
            "timing_warmup_steps": a.timing_warmup,
            "optimizer_steps": trainer.state.global_step,
            "tokens_per_step": tokens_per_step,
            "global_batch": a.global_batch_size,
            "micro_batch": a.micro_batch_size,
            "grad_accum": args.gradient_accumulation_steps,
            "seq_len": a.seq_len,
            "step_times_s": [round(t1 - t0, 4) for t0, t1 in zip(probe.times, probe.times[1:])],
            "final_loss": probe.losses[-1],
            "loss_per_step": probe.losses,
            "peak_rss_gib_per_rank": peaks,
            "peak_rss_before_training_gib_per_rank": load_peaks,
            "fsdp2_verified": True,
            **probe.fsdp,
            "distributed_type": str(trainer.accelerator.distributed_type),
        }
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps({k: v for k, v in result.items() if k not in ("loss_per_step", "step_times_s")}))


if __name__ == "__main__":
    main()
    # The Trainer's gloo groups carry the recipes' exit hazard (common/ops/cli.py): leave the same way.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    end_process(0)
