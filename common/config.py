"""The JSON config schema as dataclasses, plus loading, merging and validation.

Every section of the JSON file is one dataclass below and every key is a field of the same name.
The `fsdp` section takes exactly the keys of a Transformers `fsdp_config`, so a user can paste theirs,
and it can also be filled from `--fsdp-config`, `--accelerate-config` or the environment that
`accelerate launch` exports. This module imports no torch, so a bad config fails in well under a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """Bad user input. Scripts print it as one line and exit with code 2."""


@dataclass
class ModelConfig:
    name_or_path: str | None = None  # local HF directory or hub id; None means "from scratch"
    config: dict = field(default_factory=dict)  # inline LlamaConfig kwargs, used when name_or_path is None
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    # "embedded", local files (json/jsonl/parquet/txt), or a hub dataset name
    dataset: str | list = "embedded"
    # SFT: JSONL of prompt/completion or chat-messages records, or the built-in "arithmetic" task
    eval_dataset: str | list | None = None  # SFT held-out set, evaluated before and after training
    eval_split: str = "test"  # its split, for a hub dataset
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False  # hub datasets only
    pack: bool = True  # concatenate documents with EOS; false: one padded document per sample
    # packed documents attend only within themselves (position ids restart after EOS)
    document_mask: bool = False
    tokenizer: str | None = None  # None: the embedded byte-level BPE tokenizer
    seq_len: int = 256
    embedded_max_bytes: int = 4_000_000
    embedded_vocab_size: int = 4096
    cache_dir: str = "~/.cache/fsdp2-recipes"


@dataclass
class TrainConfig:
    # 0: load (or init), evaluate the fixed batch and export, e.g. to convert SHARDED to FULL
    steps: int = 100
    global_batch_size: int = 16  # sequences per optimizer step, whatever the world size
    micro_batch_size: int = 4  # sequences per rank per forward/backward
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    lr_schedule: str = "cosine"  # cosine | wsd
    wsd_decay_ratio: float = 0.2
    weight_decay: float = 0.1
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 0
    gradient_checkpointing: bool = False  # the HF model's own; use fsdp.activation_checkpointing instead
    compile: bool = False  # torch.compile each transformer layer
    # Accelerate's sync_each_batch: false reduce-scatters gradients once per step, on the last micro-batch
    # (the others accumulate unsharded gradients: fewer collectives, more memory); true, after every
    # micro-batch.
    sync_each_batch: bool = False
    device: str = "auto"  # auto | cpu | cuda
    # stop (with a checkpoint) after this many steps of this run, keeping the train.steps schedule
    stop_after: int = 0
    router_aux_loss_coef: float | None = None  # MoE load-balancing loss weight; None: the model config's own


@dataclass
class FsdpConfig:
    version: int = 2
    reshard_after_forward: bool | int = True
    cpu_offload: bool = False
    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    transformer_layer_cls_to_wrap: list | str | None = None  # empty: the model's _no_split_modules
    min_num_params: int | None = None
    state_dict_type: str = "FULL_STATE_DICT"
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool = False
    mixed_precision: dict | str | None = None  # None: bf16 params + fp32 reduce on CUDA, fp32 on CPU
    # PyTorch/XLA keys of the Transformers fsdp_config; only scripts/tpu_xla_fsdp.py uses them.
    xla: bool = False
    xla_fsdp_settings: dict = field(default_factory=dict)
    xla_fsdp_grad_ckpt: bool = False
    # SPMD FSDPv2; Transformers defaults to FSDPv1, which tpu_xla_fsdp.py does not implement
    xla_fsdp_v2: bool = True


@dataclass
class ParallelismConfig:
    dp_replicate_size: int = 1
    dp_shard_size: int = -1  # -1: the rest of the world
    fsdp_size: int = -1
    ep_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    sp_size: int = 1
    cp_comm_strategy: str = "allgather"
    timeout_minutes: float = 10.0  # collective timeout: a dead rank ends the job instead of hanging it


@dataclass
class CheckpointConfig:
    dir: str = "runs/debug"  # the run directory; everything a run writes goes under it
    interval: int = 0  # resume checkpoints every N steps (0: only at the end of the run)
    keep_latest: int = 2
    resume: str = "auto"  # auto: the newest complete checkpoint in dir, if any | none | a step-N path
    export: bool = True  # write the final export to <dir>/export per fsdp.state_dict_type


@dataclass
class MetricsConfig:
    log_every: int = 1
    comm_stats: bool = False  # count all-gather / reduce-scatter calls and bytes per step
    sample_ids: bool = False  # log which global samples each rank consumed (for data-position tests)
    tensorboard: bool = True  # used only when the package is installed
    peak_flops: float | None = None  # FLOP/s per device for MFU; None: the datasheet table (known GPUs only)


@dataclass
class EvalConfig:
    max_sequences: int = 64  # sequences of data.seq_len + 1 tokens evaluated, from the start of the data
    batch_size: int = 1  # sequences per data-parallel rank per forward
    load_balance: bool = True  # head-tail (zig-zag) sharding: every cp rank gets the same causal work
    # lm_head + cross-entropy this many tokens at a time: no full-vocabulary logits
    loss_chunk_tokens: int = 1024
    attention: str = "auto"  # auto (torch_cp on CUDA, else allgather) | allgather | torch_cp


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # scripts/eval_cp.py only


# FSDP1 options that Transformers/Accelerate configs may carry. FSDP2 has no equivalent, so we name the
# replacement instead of silently ignoring them.
FSDP1_ONLY_KEYS = {
    "sharding_strategy": "use reshard_after_forward (and parallelism.dp_replicate_size for HYBRID_SHARD)",
    "backward_prefetch": "FSDP2 always prefetches the next all-gather in backward; remove it",
    "forward_prefetch": "FSDP2 prefetches by module order; remove it",
    "limit_all_gathers": "FSDP2 needs no rate limiter; remove it",
}
# Accepted and ignored: FSDP2 always keeps original parameters, and module states are synchronised
# by construction (deterministic init, or a rank-0 broadcast with cpu_ram_efficient_loading).
FSDP2_IMPLIED_KEYS = {"use_orig_params", "sync_module_states", "activation_checkpointing_offload"}
# Accelerate spells cpu_offload differently; Transformers silently ignores it, we map it.
FSDP_KEY_ALIASES = {
    "offload_params": "cpu_offload",
    "transformer_cls_to_wrap": "transformer_layer_cls_to_wrap",
}

WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = {
    "FULL_STATE_DICT": "FULL_STATE_DICT",
    "FULL": "FULL_STATE_DICT",
    "SHARDED_STATE_DICT": "SHARDED_STATE_DICT",
    "SHARDED": "SHARDED_STATE_DICT",
}
DTYPE_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "no": "float32",
    "fp16": "float16",
    "float16": "float16",
}


def _close_match(key: str, choices) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _did_you_mean(key: str, choices) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (valid: {', '.join(sorted(choices))})"


def _fill(obj, values: dict, prefix: str) -> None:
    """Set dataclass fields from a dict, recursing into sections; unknown keys are errors."""
    names = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"unknown key '{prefix}{key}'{_did_you_mean(key, names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"'{prefix}{key}' must be an object, got {value!r}")
            _fill(current, value, f"{prefix}{key}.")
        else:
            setattr(obj, key, value)


def normalize_fsdp_keys(values: dict, source: str) -> dict:
    """Map a Transformers/Accelerate fsdp_config dict onto our `fsdp` keys."""
    known = {f.name for f in dataclasses.fields(FsdpConfig)}
    out = {}
    for raw_key, value in values.items():
        key = raw_key[len("fsdp_") :] if raw_key.startswith("fsdp_") else raw_key
        key = FSDP_KEY_ALIASES.get(key, key)
        if key in FSDP1_ONLY_KEYS:
            raise ConfigError(
                f"'{raw_key}' in {source} is an FSDP1 option with no FSDP2 meaning: {FSDP1_ONLY_KEYS[key]}"
            )
        if key in FSDP2_IMPLIED_KEYS:
            continue
        if key not in known:
            raise ConfigError(f"unknown key '{raw_key}' in {source}{_did_you_mean(key, known)}")
        out[key] = value
    return out


def _read_yaml(path: str) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


def _accelerate_yaml(path: str) -> dict:
    doc = _read_yaml(path)
    if str(doc.get("distributed_type", "FSDP")).upper() != "FSDP":
        raise ConfigError(
            f"--accelerate-config {path}: distributed_type is {doc['distributed_type']!r}; set it to FSDP"
        )
    values = dict(doc.get("fsdp_config") or {})
    if "mixed_precision" in doc:
        values["mixed_precision"] = doc["mixed_precision"]
    return values


# Accelerate's `parallelism_config` block (YAML keys `parallelism_config_<name>`, or the
# PARALLELISM_CONFIG_<NAME>
# variables `accelerate launch` exports) onto our `parallelism` keys.
ACCELERATE_PARALLELISM_KEYS = (
    "dp_replicate_size",
    "dp_shard_size",
    "tp_size",
    "cp_size",
    "sp_size",
    "cp_comm_strategy",
)
ACCELERATE_PARALLELISM_IGNORED = {
    "cp_backend": "torch",
    "sp_backend": "deepspeed",
}  # meaningless here at these values


def accelerate_parallelism(values: dict, source: str) -> dict:
    """Our parallelism keys from Accelerate's; a key or value we cannot honour is an error, never ignored."""
    out = {}
    for raw_key, value in values.items():
        key = raw_key.lower().removeprefix("parallelism_config_")
        if key in ACCELERATE_PARALLELISM_IGNORED:
            if str(value) != ACCELERATE_PARALLELISM_IGNORED[key]:
                raise ConfigError(
                    f"{raw_key}={value!r} in {source} is not supported; only "
                    f"{ACCELERATE_PARALLELISM_IGNORED[key]!r} (remove it)"
                )
            continue
        if key not in ACCELERATE_PARALLELISM_KEYS:
            raise ConfigError(
                f"'{raw_key}' in {source} has no equivalent here"
                f"{_did_you_mean(key, ACCELERATE_PARALLELISM_KEYS)}"
            )
        out[key] = value if key == "cp_comm_strategy" else int(value)
    return out


def accelerate_launch_env(environ: dict) -> dict:
    """The fsdp keys that `accelerate launch` exports as environment variables.

    accelerate exports every FSDP1 knob with a default too; only the ones that mean something for
    FSDP2 are read, with the same mapping as --accelerate-config.
    """
    if environ.get("ACCELERATE_USE_FSDP", "").lower() != "true":
        return {}
    env_to_key = {
        "FSDP_VERSION": "version",
        "FSDP_RESHARD_AFTER_FORWARD": "reshard_after_forward",
        "FSDP_OFFLOAD_PARAMS": "cpu_offload",
        "FSDP_AUTO_WRAP_POLICY": "auto_wrap_policy",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "transformer_layer_cls_to_wrap",
        "FSDP_STATE_DICT_TYPE": "state_dict_type",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "cpu_ram_efficient_loading",
        "FSDP_ACTIVATION_CHECKPOINTING": "activation_checkpointing",
        "ACCELERATE_MIXED_PRECISION": "mixed_precision",
    }
    out = {}
    for env, key in env_to_key.items():
        if env in environ:
            out[key] = _parse_scalar(environ[env])
    # accelerate always exports FSDP_MIN_NUM_PARAMS (default 1e8); it only means something for
    # SIZE_BASED_WRAP.
    if out.get("auto_wrap_policy") == "SIZE_BASED_WRAP" and "FSDP_MIN_NUM_PARAMS" in environ:
        out["min_num_params"] = int(environ["FSDP_MIN_NUM_PARAMS"])
    return out


def _parse_scalar(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _layer_sources(run_config: dict, externals: list[tuple[str, dict]], section: str, changes: list) -> dict:
    """The run config's keys, with the external FSDP/Accelerate sources on top (the more specific wins).
    External sources must agree with each other: neither is more specific than the other."""
    external: dict = {}
    origin: dict = {}
    for name, values in externals:
        for key, value in values.items():
            if key in external and _canonical(key, external[key]) != _canonical(key, value):
                raise ConfigError(
                    f"{section}.{key} is {external[key]!r} in {origin[key]} but {value!r} in {name}; "
                    f"give it in one of them only"
                )
            external[key], origin[key] = value, name
    merged = dict(run_config)
    for key, value in external.items():
        if key in merged and _canonical(key, merged[key]) != _canonical(key, value):
            changes.append(f"{section}.{key} {merged[key]!r} -> {value!r} ({origin[key]})")
        merged[key] = value
    return merged


def _canonical(key: str, value: Any) -> Any:
    if key == "mixed_precision":
        return json.dumps(_mixed_precision_dtypes(value, "cuda"), sort_keys=True)
    if key == "transformer_layer_cls_to_wrap":
        return _class_names(value)
    if key == "state_dict_type" and isinstance(value, str):
        return STATE_DICT_TYPES.get(value.upper(), value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def _class_names(value: list | str | None) -> list[str]:
    if not value:
        return []
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return list(value)


def _mixed_precision_dtypes(value: dict | str | None, device_type: str) -> dict:
    if value is None:
        if device_type == "cuda":
            return {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
        return {"param_dtype": "float32", "reduce_dtype": "float32"}
    if isinstance(value, str):
        value = {"param_dtype": value, "reduce_dtype": "float32"}
    if not isinstance(value, dict) or set(value) - {"param_dtype", "reduce_dtype"}:
        raise ConfigError(
            f"fsdp.mixed_precision is {value!r}; use 'bf16', 'no', or "
            f'{{"param_dtype": "bfloat16", "reduce_dtype": "float32"}}'
        )
    out = {}
    for key in ("param_dtype", "reduce_dtype"):
        name = str(value.get(key, "float32")).lower().replace("torch.", "")
        if name not in DTYPE_NAMES:
            raise ConfigError(f"fsdp.mixed_precision.{key} is {value.get(key)!r}; use bfloat16 or float32")
        if DTYPE_NAMES[name] == "float16":
            raise ConfigError(
                f"fsdp.mixed_precision.{key} is float16, which needs loss scaling that FSDP2 "
                f"does not do; use bfloat16"
            )
        out[key] = DTYPE_NAMES[name]
    return out


def resolve_mixed_precision(fsdp: FsdpConfig, device_type: str) -> dict:
    """{'param_dtype': name, 'reduce_dtype': name} for this device; the default follows the device."""
    return _mixed_precision_dtypes(fsdp.mixed_precision, device_type)


def layer_class_names(fsdp: FsdpConfig) -> list[str]:
    return _class_names(fsdp.transformer_layer_cls_to_wrap)


def apply_override(cfg: Config, item: str, changes: list | None = None) -> None:
    """`section.key=value`; dict-valued keys such as `model.config` take deeper paths. A value that
    differs from the one it replaces is noted in `changes`."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not key.path=value (e.g. train.steps=20)")
    path, text = item.split("=", 1)
    *parents, leaf = path.split(".")
    if parents == ["fsdp"] and leaf in FSDP1_ONLY_KEYS:
        raise ConfigError(
            f"override '{item}' is an FSDP1 option with no FSDP2 meaning: {FSDP1_ONLY_KEYS[leaf]}"
        )
    obj: Any = cfg
    for depth, name in enumerate(parents + [leaf]):
        is_leaf = depth == len(parents)
        if isinstance(obj, dict):
            if is_leaf:
                _note_change(changes, path, obj.get(name), _parse_scalar(text))
                obj[name] = _parse_scalar(text)
                return
            obj = obj.setdefault(name, {})
            continue
        valid = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
        if name not in valid:
            where = ".".join(path.split(".")[: depth + 1])
            raise ConfigError(f"unknown key '{where}' in override '{item}'{_did_you_mean(name, valid)}")
        if is_leaf:
            if dataclasses.is_dataclass(getattr(obj, name)):
                raise ConfigError(f"override '{item}' names a section; name one of its keys instead")
            _note_change(changes, path, getattr(obj, name), _parse_scalar(text))
            setattr(obj, name, _parse_scalar(text))
            return
        obj = getattr(obj, name)


def _note_change(changes: list | None, path: str, old: Any, new: Any) -> None:
    if changes is not None and old != new:
        changes.append(f"{path} {old!r} -> {new!r} (key=value)")


def _check_type(section: str, key: str, value: Any, kinds: tuple, fix: str) -> None:
    # bool is an int in Python, but a size given as `true` is a typo: accept bools only where listed.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ConfigError(f"{section}.{key} is {value!r}; {fix}")


def validate(cfg: Config) -> None:
    """Everything that can be checked before touching a model or a GPU; identical on every rank."""
    t, f, p, d, c = cfg.train, cfg.fsdp, cfg.parallelism, cfg.data, cfg.checkpoint
    _check_type(
        "train", "steps", t.steps, (int,), "it must be an integer >= 0 (0: load, evaluate and export)"
    )
    if t.steps < 0:
        raise ConfigError(f"train.steps is {t.steps}; it must be >= 0 (0: load, evaluate and export)")
    for key in ("global_batch_size", "micro_batch_size"):
        _check_type("train", key, getattr(t, key), (int,), "it must be a positive integer")
        if getattr(t, key) <= 0:
            raise ConfigError(f"train.{key} is {getattr(t, key)}; it must be a positive integer")
    _check_type("train", "lr", t.lr, (int, float), "it must be a number such as 3e-4")
    if t.lr <= 0:
        raise ConfigError(f"train.lr is {t.lr}; it must be > 0")
    if t.lr_schedule not in ("cosine", "wsd"):
        raise ConfigError(f"train.lr_schedule is {t.lr_schedule!r}; use 'cosine' or 'wsd'")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps is {t.warmup_steps}; it must be >= 0")
    if t.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device is {t.device!r}; use auto, cpu or cuda")
    if not isinstance(t.betas, list) or len(t.betas) != 2:
        raise ConfigError(f"train.betas is {t.betas!r}; give two numbers, e.g. [0.9, 0.95]")
    _check_type("data", "seq_len", d.seq_len, (int,), "it must be a positive integer")
    if d.seq_len < 2:
        raise ConfigError(f"data.seq_len is {d.seq_len}; it must be at least 2")

    _check_type("fsdp", "version", f.version, (int,), "set it to 2")
    if f.version != 2:
        raise ConfigError(f"fsdp.version is {f.version}; FSDP1 is not supported, set it to 2 (fully_shard)")
    _check_type(
        "fsdp",
        "reshard_after_forward",
        f.reshard_after_forward,
        (bool, int),
        "use true, false, or an int (reshard to that many ranks)",
    )
    if not isinstance(f.reshard_after_forward, bool) and f.reshard_after_forward < 1:
        raise ConfigError(f"fsdp.reshard_after_forward is {f.reshard_after_forward}; an int must be >= 1")
    for key in (
        "cpu_offload",
        "cpu_ram_efficient_loading",
        "activation_checkpointing",
        "xla",
        "xla_fsdp_grad_ckpt",
        "xla_fsdp_v2",
    ):
        _check_type("fsdp", key, getattr(f, key), (bool,), "use true or false")
    _check_type(
        "fsdp",
        "xla_fsdp_settings",
        f.xla_fsdp_settings,
        (dict,),
        'give an object, e.g. {"compute_dtype": "bfloat16"}',
    )
    if not f.xla and (f.xla_fsdp_settings or f.xla_fsdp_grad_ckpt):
        raise ConfigError(
            "fsdp.xla_fsdp_settings / xla_fsdp_grad_ckpt are set but fsdp.xla is false; they apply "
            "only to scripts/tpu_xla_fsdp.py with fsdp.xla=true"
        )
    if f.auto_wrap_policy not in WRAP_POLICIES:
        raise ConfigError(
            f"fsdp.auto_wrap_policy is {f.auto_wrap_policy!r}; use one of {', '.join(WRAP_POLICIES)}"
            f"{_close_match(str(f.auto_wrap_policy), WRAP_POLICIES)}"
        )
    if f.auto_wrap_policy == "SIZE_BASED_WRAP":
        if f.min_num_params is None:
            f.min_num_params = 100_000_000  # Accelerate's default
        _check_type("fsdp", "min_num_params", f.min_num_params, (int,), "it must be a positive integer")
        if f.min_num_params <= 0:
            raise ConfigError(
                f"fsdp.min_num_params is {f.min_num_params}; SIZE_BASED_WRAP needs a positive "
                f"threshold (e.g. 1000000), or use NO_WRAP for a single unit"
            )
    elif f.min_num_params is not None:
        warnings.warn(
            f"fsdp.min_num_params={f.min_num_params} is ignored with auto_wrap_policy={f.auto_wrap_policy}",
            stacklevel=2,
        )
    if not isinstance(f.state_dict_type, str) or f.state_dict_type.upper() not in STATE_DICT_TYPES:
        raise ConfigError(
            f"fsdp.state_dict_type is {f.state_dict_type!r}; use FULL_STATE_DICT or SHARDED_STATE_DICT"
        )
    f.state_dict_type = STATE_DICT_TYPES[f.state_dict_type.upper()]
    resolve_mixed_precision(f, "cuda")
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
        # Accepted so the Transformers docs' fsdp_config works as is: from scratch nothing is read from disk
        # and no rank ever materialises the full model anyway.
        warnings.warn("fsdp.cpu_ram_efficient_loading has no effect without model.name_or_path", stacklevel=2)

    for key in (
        "dp_replicate_size",
        "dp_shard_size",
        "fsdp_size",
        "ep_size",
        "tp_size",
        "cp_size",
        "sp_size",
    ):
        value = getattr(p, key)
        _check_type("parallelism", key, value, (int,), "it must be a positive integer (or -1 for the rest)")
        if value == 0 or value < -1:
            raise ConfigError(
                f"parallelism.{key} is {value}; it must be a positive integer (or -1 for the rest)"
            )
    if p.cp_size > 1 and p.sp_size > 1:
        raise ConfigError(f"parallelism.cp_size={p.cp_size} and sp_size={p.sp_size} are both > 1; pick one")
    if p.cp_comm_strategy not in ("allgather", "alltoall"):
        raise ConfigError(
            f"parallelism.cp_comm_strategy is {p.cp_comm_strategy!r}; use allgather or alltoall"
        )
    if p.timeout_minutes <= 0:
        raise ConfigError(f"parallelism.timeout_minutes is {p.timeout_minutes}; it must be > 0")

    if not isinstance(c.interval, int) or c.interval < 0:
        raise ConfigError(
            f"checkpoint.interval is {c.interval!r}; use a step count, or 0 for only the end of the run"
        )
    if not isinstance(t.stop_after, int) or t.stop_after < 0:
        raise ConfigError(
            f"train.stop_after is {t.stop_after!r}; use a step count, or 0 to run to train.steps"
        )
    if c.keep_latest < 1:
        raise ConfigError(f"checkpoint.keep_latest is {c.keep_latest}; keep at least 1")
    if cfg.metrics.log_every < 1:
        raise ConfigError(f"metrics.log_every is {cfg.metrics.log_every}; it must be >= 1")


def parse_args(argv: list[str] | None = None, description: str = "", xla: bool = False) -> Config:
    """`--config FILE [--fsdp-config F] [--accelerate-config F] [key.path=value ...]` -> a validated Config.

    `xla`: whether the calling script is the PyTorch/XLA one; fsdp.xla must agree, so it is never ignored.
    """
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="JSON run config (see configs/)")
    parser.add_argument("--fsdp-config", help="a Transformers fsdp_config JSON; fills the fsdp section")
    parser.add_argument("--accelerate-config", help="an Accelerate YAML with an fsdp_config block")
    parser.add_argument("overrides", nargs="*", help="key.path=value, value parsed as JSON")
    args = parser.parse_args(argv)
    changes: list[str] = []
    cfg = load_config(
        args.config, args.overrides, args.fsdp_config, args.accelerate_config, os.environ, changes
    )
    if changes and os.environ.get("RANK", "0") == "0":
        print(
            f"config: {len(changes)} value(s) changed by a more specific source: {'; '.join(changes)}",
            flush=True,
        )
    if cfg.fsdp.xla and not xla:
        raise ConfigError(
            "fsdp.xla is true, which is the PyTorch/XLA recipe: run scripts/tpu_xla_fsdp.py, or set "
            "fsdp.xla=false"
        )
    if xla and not cfg.fsdp.xla:
        raise ConfigError(
            "fsdp.xla is false but scripts/tpu_xla_fsdp.py is the PyTorch/XLA recipe; set "
            "fsdp.xla=true (on GPUs, use scripts/pretrain_fsdp.py)"
        )
    return cfg


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            values = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist; pass an existing JSON file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} {path} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{what} {path} must hold a JSON object")
    return values


def load_config(
    path: str,
    overrides: list[str] = (),
    fsdp_config: str | None = None,
    accelerate_config: str | None = None,
    environ: dict | None = None,
    changes: list | None = None,
) -> Config:
    """Sources from lowest to highest: defaults, the --config file, the external FSDP config
    (--fsdp-config, --accelerate-config or the accelerate launch environment), key=value overrides.
    Each value a higher source changed is appended to `changes` as one short text."""
    changes = [] if changes is None else changes
    values = _read_json(path, "--config")
    cfg = Config()
    fsdp_section = values.pop("fsdp", {}) or {}
    _fill(cfg, values, "")
    run_fsdp = normalize_fsdp_keys(fsdp_section, f"{path} (fsdp)")
    sources = []
    if fsdp_config:
        sources.append(
            (fsdp_config, normalize_fsdp_keys(_read_json(fsdp_config, "--fsdp-config"), fsdp_config))
        )
    if accelerate_config:
        if not os.path.exists(accelerate_config):
            raise ConfigError(
                f"--accelerate-config {accelerate_config} does not exist; pass an existing YAML file"
            )
        sources.append(
            (accelerate_config, normalize_fsdp_keys(_accelerate_yaml(accelerate_config), accelerate_config))
        )
    launch_env = accelerate_launch_env(environ or {})
    if launch_env:
        sources.append(("the accelerate launch environment", launch_env))
    _fill(cfg.fsdp, _layer_sources(run_fsdp, sources, "fsdp", changes), "fsdp.")
    parallelism = []
    if accelerate_config:
        block = _read_yaml(accelerate_config).get("parallelism_config") or {}
        parallelism.append((accelerate_config, accelerate_parallelism(block, accelerate_config)))
    if (environ or {}).get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
        exported = {k: v for k, v in environ.items() if k.startswith("PARALLELISM_CONFIG_")}
        parallelism.append(
            (
                "the accelerate launch environment",
                accelerate_parallelism(exported, "the accelerate launch environment"),
            )
        )
    run_parallelism = values.get("parallelism", {})
    _fill(
        cfg.parallelism, _layer_sources(run_parallelism, parallelism, "parallelism", changes), "parallelism."
    )
    for item in overrides:
        apply_override(cfg, item, changes)
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def run_cli(main, argv: list[str] | None = None) -> None:
    """Run a script's main(argv); bad input becomes one line and exit 2, with no traceback, on every rank.
    Then leave through common/mesh.end_process, which keeps gloo from aborting the exit."""
    from common.mesh import end_process  # mesh imports this module

    exit_code = 0
    try:
        main(argv)
    except ConfigError as error:
        rank = os.environ.get("RANK")
        prefix = f"[rank{rank}] " if rank is not None else ""
        print(f"{prefix}config error: {error}", file=sys.stderr, flush=True)
        exit_code = 2
    except SystemExit as stop:  # a stop that every rank takes together, such as a non-finite loss
        exit_code = stop.code or 0
        if isinstance(exit_code, str):
            print(exit_code, file=sys.stderr, flush=True)
            exit_code = 1
    end_process(exit_code)
