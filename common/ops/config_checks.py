"""The checks that span several keys: everything about a config that can be checked before a model or a GPU
is touched, each a ConfigError naming the keys and the fix (or a warning, where the Trainer accepts it)."""

from __future__ import annotations

import os
import warnings

from huggingface_hub.serialization import split_torch_state_dict_into_shards

from common.config import Config, ConfigError, resolve_mixed_precision


def validate(cfg: Config) -> None:
    """Everything that can be checked before touching a model or a GPU."""
    t, f, p = cfg.train, cfg.fsdp, cfg.parallelism
    if f.version != 2:
        raise ConfigError(f"fsdp.version is {f.version}; FSDP1 is not supported, set it to 2 (fully_shard)")
    if f.auto_wrap_policy == "SIZE_BASED_WRAP" and f.min_num_params is None:
        f.min_num_params = 100_000_000  # Accelerate's default
    if len(t.betas) != 2:
        raise ConfigError(f"train.betas is {t.betas!r}; give two numbers, e.g. [0.9, 0.95]")
    if not isinstance(f.reshard_after_forward, bool) and f.reshard_after_forward < 1:
        raise ConfigError(f"fsdp.reshard_after_forward is {f.reshard_after_forward}; an int must be >= 1")
    if f.auto_wrap_policy == "SIZE_BASED_WRAP" and f.min_num_params <= 0:
        raise ConfigError(
            f"fsdp.min_num_params is {f.min_num_params}; SIZE_BASED_WRAP needs a positive "
            f"threshold (e.g. 1000000), or use NO_WRAP for a single unit"
        )
    if f.auto_wrap_policy != "SIZE_BASED_WRAP" and f.min_num_params is not None:
        warnings.warn(
            f"fsdp.min_num_params is ignored with auto_wrap_policy={f.auto_wrap_policy}", stacklevel=2
        )
    resolve_mixed_precision(f, "cuda")
    if isinstance(f.ac_policy, int) and f.ac_policy < 1:
        raise ConfigError(f"fsdp.ac_policy is {f.ac_policy}; every Nth layer needs N >= 1")
    if f.ac_policy != "full" and not f.activation_checkpointing:
        raise ConfigError(
            f"fsdp.ac_policy is {f.ac_policy!r} but fsdp.activation_checkpointing is false; set "
            f"fsdp.activation_checkpointing=true to checkpoint with that policy"
        )
    if f.activation_checkpointing and t.gradient_checkpointing:
        raise ConfigError(
            "fsdp.activation_checkpointing and train.gradient_checkpointing are both true; "
            "keep fsdp.activation_checkpointing and set train.gradient_checkpointing=false"
        )
    if cfg.model.name_or_path and cfg.model.config:
        raise ConfigError(
            f"model.name_or_path ({cfg.model.name_or_path}) and model.config are both set; the "
            f"checkpoint's config.json defines the model, so set model.config={{}}"
        )
    if f.cpu_ram_efficient_loading and not cfg.model.name_or_path:
        # Accepted so the Transformers docs' fsdp_config works as is: from scratch, no rank ever
        # materialises the full model anyway.
        warnings.warn("fsdp.cpu_ram_efficient_loading has no effect without model.name_or_path", stacklevel=2)
    for key, value in vars(p).items():
        if key.endswith("_size") and (value == 0 or value < -1):
            raise ConfigError(f"parallelism.{key} is {value}; use a positive integer (or -1 for the rest)")
    steps = cfg.metrics.profile_steps
    if steps and (len(steps) != 2 or any(type(s) is not int for s in steps) or not 1 <= steps[0] <= steps[1]):
        raise ConfigError(
            f"metrics.profile_steps is {steps}; give [first, last] with 1 <= first <= last, e.g. [3, 4]"
        )
    if p.cp_size > 1 and p.sp_size > 1:
        raise ConfigError(f"parallelism.cp_size={p.cp_size} and sp_size={p.sp_size} are both > 1; pick one")
    _check_evaluation(cfg)
    _check_export(cfg)
    for key, path in (("checkpoint.dir", cfg.checkpoint.dir), ("data.cache_dir", cfg.data.cache_dir)):
        if (parent := existing_ancestor(path)) and not os.path.isdir(parent):  # else made when first written
            raise ConfigError(f"{key} is {path!r}, but {parent} is a file; give a directory path")
    check_companions(cfg)
    if cfg.lora.r and not cfg.model.name_or_path and os.environ.get("RANK", "0") == "0":  # once per run
        warnings.warn(
            "lora.r is set but model.name_or_path is not: the adapters train on a randomly initialised, "
            "frozen base, which is almost never what you want; set model.name_or_path to a pretrained model",
            stacklevel=2,
        )


def _check_export(cfg: Config) -> None:
    """checkpoint.max_shard_size, export_dtype and export_writers shape a FULL export (or a merged LoRA
    one), nothing else."""
    c, adapters = cfg.checkpoint, bool(cfg.lora.r)
    if not is_shard_size(c.max_shard_size):
        raise ConfigError(
            f"checkpoint.max_shard_size is {c.max_shard_size!r}; give a number of bytes, or a size in TB, "
            f'GB, MB or KB such as "5GB" (save_pretrained\'s units: not GiB)'
        )
    full = cfg.lora.merge_on_export if adapters else cfg.fsdp.state_dict_type == "FULL_STATE_DICT"
    changed = c.max_shard_size != "5GB" and "max_shard_size" or c.export_dtype and "export_dtype"
    changed = changed or c.export_writers != "all" and "export_writers"
    if changed and not full:
        export = "PEFT's adapters" if adapters else "SHARDED (DCP files)"
        raise ConfigError(
            f"checkpoint.{changed} is set but the export is {export}, which it does not shape; remove it, "
            f"or export FULL_STATE_DICT (with LoRA: lora.merge_on_export=true)"
        )


def existing_ancestor(path: str) -> str:
    """The path itself, or the nearest of its parents that exists."""
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def is_shard_size(size) -> bool:
    """What save_pretrained takes as max_shard_size, asked of its own parser (huggingface_hub's), which the
    export calls only after training: a positive int, or a string in TB, GB, MB or KB."""
    if isinstance(size, bool) or not isinstance(size, (int, str)) or (isinstance(size, int) and size <= 0):
        return False
    try:
        split_torch_state_dict_into_shards({}, max_shard_size=size)
    except ValueError:
        return False
    return True


def _check_evaluation(cfg: Config) -> None:
    """Evaluation during training, the best model and early stopping (the Trainer's rules)."""
    e, c = cfg.eval, cfg.checkpoint
    if e.interval and not cfg.data.eval_dataset:
        raise ConfigError(
            f"eval.interval is {e.interval} but data.eval_dataset is not set; name a held-out set (files, a "
            f"hub dataset, 'arithmetic' or 'embedded'), or set eval.interval=0"
        )
    if e.early_stopping_patience and not e.interval:
        raise ConfigError(
            f"eval.early_stopping_patience is {e.early_stopping_patience} but eval.interval is 0, so "
            f"nothing is evaluated; set eval.interval (e.g. 10), or eval.early_stopping_patience=0"
        )
    if c.load_best_model_at_end and not e.interval:
        raise ConfigError(
            "checkpoint.load_best_model_at_end is true but eval.interval is 0, so there is no best model; "
            "set eval.interval (e.g. 10), or checkpoint.load_best_model_at_end=false"
        )
    # The Trainer's rule: save_steps a round multiple of eval_steps, so every checkpoint has an evaluation to
    # rank it by; common/ops/stopping.py picks among the checkpointed steps as the Trainer does. A divisor
    # works as well: every evaluation then has a checkpoint.
    if c.load_best_model_at_end and (not c.interval or (c.interval % e.interval and e.interval % c.interval)):
        raise ConfigError(
            f"checkpoint.load_best_model_at_end picks among the checkpoints by their evaluations, but "
            f"checkpoint.interval is {c.interval} and eval.interval is {e.interval}; set checkpoint.interval "
            f"to a multiple of {e.interval} (the Trainer's rule for save_steps and eval_steps) or a divisor"
        )


def check_companions(cfg: Config) -> None:  # keys that act only with another, in every script
    if cfg.fsdp.activation_checkpointing_offload and not cfg.fsdp.activation_checkpointing:  # as Accelerate
        raise ConfigError(
            "fsdp.activation_checkpointing_offload is true but nothing is checkpointed to offload; set "
            "fsdp.activation_checkpointing=true"
        )
    if cfg.parallelism.cp_comm_strategy != "allgather" and cfg.parallelism.cp_size == 1:  # torch_cp's ring
        raise ConfigError(
            f"parallelism.cp_comm_strategy is {cfg.parallelism.cp_comm_strategy!r} but parallelism.cp_size "
            f"is 1, so no K/V shards travel; remove it"
        )
