"""Where a run's config comes from, and in which order: defaults < the --config JSON < the external FSDP
config (a Transformers fsdp_config JSON, an Accelerate YAML, or the environment `accelerate launch`
exports) < key=value overrides. Then the command line of every script: parse_args and run_cli."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from common.config import (
    STATE_DICT_TYPES,
    Config,
    ConfigError,
    FsdpConfig,
    class_names,
    did_you_mean,
    fill,
    mixed_precision_dtypes,
    validate,
)

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


def parse_scalar(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


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
                _note_change(changes, path, obj.get(name), parse_scalar(text))
                obj[name] = parse_scalar(text)
                return
            obj = obj.setdefault(name, {})
            continue
        valid = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
        if name not in valid:
            where = ".".join(path.split(".")[: depth + 1])
            raise ConfigError(f"unknown key '{where}' in override '{item}'{did_you_mean(name, valid)}")
        if is_leaf:
            if dataclasses.is_dataclass(getattr(obj, name)):
                raise ConfigError(f"override '{item}' names a section; name one of its keys instead")
            _note_change(changes, path, getattr(obj, name), parse_scalar(text))
            setattr(obj, name, parse_scalar(text))
            return
        obj = getattr(obj, name)


def _note_change(changes: list | None, path: str, old: Any, new: Any) -> None:
    if changes is not None and old != new:
        changes.append(f"{path} {old!r} -> {new!r} (key=value)")


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
            raise ConfigError(f"unknown key '{raw_key}' in {source}{did_you_mean(key, known)}")
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
                f"{did_you_mean(key, ACCELERATE_PARALLELISM_KEYS)}"
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
            out[key] = parse_scalar(environ[env])
    # accelerate always exports FSDP_MIN_NUM_PARAMS (default 1e8); it only means something for
    # SIZE_BASED_WRAP.
    if out.get("auto_wrap_policy") == "SIZE_BASED_WRAP" and "FSDP_MIN_NUM_PARAMS" in environ:
        out["min_num_params"] = int(environ["FSDP_MIN_NUM_PARAMS"])
    return out


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
        return json.dumps(mixed_precision_dtypes(value, "cuda"), sort_keys=True)
    if key == "transformer_layer_cls_to_wrap":
        return class_names(value)
    if key == "state_dict_type" and isinstance(value, str):
        return STATE_DICT_TYPES.get(value.upper(), value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


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
    fill(cfg, values, "")
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
    fill(cfg.fsdp, _layer_sources(run_fsdp, sources, "fsdp", changes), "fsdp.")
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
    fill(
        cfg.parallelism, _layer_sources(run_parallelism, parallelism, "parallelism", changes), "parallelism."
    )
    for item in overrides:
        apply_override(cfg, item, changes)
    validate(cfg)
    return cfg


def run_cli(main, argv: list[str] | None = None) -> None:
    """Run a script's main(argv); bad input becomes one line and exit 2, with no traceback, on every rank.
    Then leave through common/mesh.end_process, which keeps gloo from aborting the exit."""
    from common.mesh import end_process  # here: the rest of this module imports no torch

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
