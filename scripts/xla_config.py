"""What tpu_xla_fsdp.py checks in its config before it touches XLA: fsdp.xla_fsdp_settings as SPMD FSDPv2's
arguments, and every key that has no meaning there as one line naming it. Beside the script, so the recipe
reads as the training, and these run in the main environment without torch_xla."""

from __future__ import annotations

import torch

from common.config import Config, ConfigError, EvalConfig, FsdpConfig
from common.ops.cli import refuse_set_keys

# What SpmdFullyShardedDataParallel takes besides the mesh, shard_output and wrap policy, which are ours.
FSDPV2_SETTINGS = {"extra_data_axis"}
DTYPE_SETTINGS = {"compute_dtype", "buffer_dtype"}


def xla_settings(fsdp: FsdpConfig) -> tuple[dict, torch.dtype]:
    """(kwargs for the FSDPv2 wrapper, compute dtype) from fsdp.xla_fsdp_settings.

    Dtype strings are read as Transformers reads them (`getattr(torch, "bfloat16")`). FSDPv2 has no dtype
    arguments, so compute_dtype becomes autocast around the forward (master weights stay fp32, as FSDPv1's
    compute_dtype does); FSDPv1-only settings are errors rather than silently dropped.
    """
    if not fsdp.xla:
        raise ConfigError(
            "fsdp.xla is false but scripts/tpu_xla_fsdp.py is the PyTorch/XLA recipe; set "
            "fsdp.xla=true (on GPUs, use scripts/pretrain_fsdp.py)"
        )
    settings = dict(fsdp.xla_fsdp_settings)
    for key in DTYPE_SETTINGS & settings.keys():
        dtype = getattr(torch, str(settings[key]), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(
                f"fsdp.xla_fsdp_settings.{key} is {settings[key]!r}; use a torch dtype name such as "
                f"bfloat16 or float32"
            )
        settings[key] = dtype
    compute = settings.pop("compute_dtype", torch.float32)
    if compute not in (torch.float32, torch.bfloat16):
        raise ConfigError(
            f"fsdp.xla_fsdp_settings.compute_dtype is {compute}; XLA autocast computes in bfloat16 "
            f"(or leave float32)"
        )
    buffer = settings.pop("buffer_dtype", torch.float32)
    if buffer != torch.float32:
        raise ConfigError(
            f"fsdp.xla_fsdp_settings.buffer_dtype is {buffer}; buffers (RoPE frequencies) stay float32 "
            f"here, compute_dtype sets the compute precision; remove it"
        )
    unknown = settings.keys() - FSDPV2_SETTINGS
    if unknown:
        raise ConfigError(
            f"fsdp.xla_fsdp_settings has {sorted(unknown)}, which SPMD FSDPv2 does not take (FSDPv1-only "
            f"options); use compute_dtype or {sorted(FSDPV2_SETTINGS)}"
        )
    return settings, compute


NO_EVALUATION = "the XLA recipe does not evaluate during training (scripts/eval_cp.py scores its checkpoints)"
ONE_AXIS = "the XLA recipe shards over one fsdp axis of every device"
UNUSED_KEYS = {
    "data.eval_dataset": NO_EVALUATION,
    # check_xla_config refuses eval.interval and early_stopping_patience with their own lines
    **{
        f"eval.{key}": NO_EVALUATION
        for key in vars(EvalConfig())
        if key not in ("interval", "early_stopping_patience")
    },
    "train.loss_chunk_tokens": "the XLA recipe's loss takes the full logits",
    "train.verify_loss_at_start": "the XLA recipe's loss is full logits through the model's own forward",
    "train.device": "PJRT_DEVICE picks the device",
    "train.router_aux_loss_coef": "the XLA recipe trains dense models, which have no router",
    "model.freeze_vision_tower": "the XLA recipe trains text models",
    "model.freeze_multi_modal_projector": "the XLA recipe trains text models",
    "fsdp.cpu_ram_efficient_loading": "each XLA host loads the whole checkpoint",
    "checkpoint.export_writers": "the XLA recipe's FULL export is written by process 0 alone",
    "parallelism.dp_shard_size": ONE_AXIS,
    "parallelism.fsdp_size": ONE_AXIS,
    "parallelism.timeout_minutes": "XLA's collectives have their own timeouts",
    "metrics.comm_stats": "the XLA compiler issues the collectives",
    **{
        f"lora.{key}": "the XLA recipe does not train adapters"
        for key in ("alpha", "dropout", "target_modules", "base_dtype", "merge_on_export")
    },
}


def check_xla_config(cfg: Config, num_devices: int) -> None:
    """FSDP keys with no XLA FSDPv2 meaning are errors, never silently dropped."""
    f, t, p = cfg.fsdp, cfg.train, cfg.parallelism
    if not f.xla_fsdp_v2:
        raise ConfigError(
            "fsdp.xla_fsdp_v2 is false (FSDPv1, XlaFullyShardedDataParallel), which this script does "
            "not implement; set it to true for SPMD FSDPv2"
        )
    unsupported = {
        "fsdp.cpu_offload": f.cpu_offload,
        "fsdp.reshard_after_forward": f.reshard_after_forward is not True,
        "fsdp.activation_checkpointing": f.activation_checkpointing,
        "fsdp.mixed_precision": f.mixed_precision,
        "train.gradient_checkpointing": t.gradient_checkpointing,
        "train.compile": t.compile,
        "train.sync_each_batch": t.sync_each_batch,
    }
    for key, value in unsupported.items():
        if value:
            raise ConfigError(
                f"{key} is set, which has no meaning in the XLA FSDPv2 recipe (the XLA compiler shards, "
                f"schedules and compiles; use fsdp.xla_fsdp_grad_ckpt for checkpointing and "
                f"fsdp.xla_fsdp_settings.compute_dtype for precision); remove it"
            )
    torch_only = {
        "metrics.profile_steps": cfg.metrics.profile_steps,
        "metrics.memory_snapshot": cfg.metrics.memory_snapshot,
        "checkpoint.async_save": cfg.checkpoint.async_save,
    }
    for key, value in torch_only.items():
        if value:
            raise ConfigError(
                f"{key} is set, which the XLA recipe does not implement (its checkpoints are written "
                f"synchronously; torch_xla.debug.profiler traces the XLA device); remove it"
            )
    if cfg.lora.r:
        raise ConfigError(
            f"lora.r is {cfg.lora.r}, but the XLA recipe does not train adapters; use "
            f"scripts/pretrain_fsdp.py, or set lora.r=0"
        )
    if cfg.eval.interval:
        raise ConfigError(
            f"eval.interval is {cfg.eval.interval}, but the XLA recipe does not evaluate during training; "
            f"score its checkpoints with scripts/eval_cp.py, or set eval.interval=0"
        )
    refuse_set_keys(cfg, UNUSED_KEYS)
    if cfg.data.document_mask:
        raise ConfigError(
            "data.document_mask is true, which the XLA recipe does not implement (its attention is "
            "plain causal over the packed row); set it to false"
        )
    for key in ("dp_replicate_size", "cp_size", "sp_size", "tp_size", "ep_size"):
        if getattr(p, key) != 1:
            raise ConfigError(
                f"parallelism.{key} is {getattr(p, key)}; the XLA recipe has one fsdp axis over all "
                f"devices, set it to 1"
            )
    if t.micro_batch_size % num_devices:
        raise ConfigError(
            f"train.micro_batch_size ({t.micro_batch_size}) is not a multiple of the {num_devices} XLA "
            f"devices the batch is sharded over; make it a multiple of {num_devices}"
        )
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) is not a multiple of micro_batch_size "
            f"({t.micro_batch_size})"
        )
