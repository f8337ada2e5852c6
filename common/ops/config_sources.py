"""Where a run's config comes from, lowest to highest: defaults < the --config JSON < the external FSDP config
(--fsdp-config, --accelerate-config or the `accelerate launch` environment) < key=value overrides."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from common.config import Config, ConfigError, FsdpConfig, class_names, mixed_precision_dtypes
from common.ops.config_checks import validate
from common.ops.fsdp1 import FSDP1_KEYS, FSDP1_LAUNCH_KEYS, RESHARD, Translation, fsdp1_launch_values

# Accelerate's names (Transformers silently ignores offload_params).
FSDP_KEY_ALIASES = {
    "offload_params": "cpu_offload",
    "transformer_cls_to_wrap": "transformer_layer_cls_to_wrap",
}
# The FSDP_<KEY> variables of `accelerate launch` that mean something for FSDP2 (ignored_modules: an error).
LAUNCH_ENV_KEYS = """version reshard_after_forward offload_params auto_wrap_policy transformer_cls_to_wrap
    state_dict_type cpu_ram_efficient_loading activation_checkpointing activation_checkpointing_offload
    ignored_modules""".split()
LAUNCH_ENV = "the accelerate launch environment"
# Accelerate's parallelism_config keys; the ignored ones are meaningless here at these values only.
PARALLELISM_KEYS = "dp_replicate_size dp_shard_size tp_size cp_size sp_size cp_comm_strategy".split()
PARALLELISM_IGNORED = {"cp_backend": "torch", "sp_backend": "deepspeed"}
STATE_DICT_TYPES = {"FULL": "FULL_STATE_DICT", "SHARDED": "SHARDED_STATE_DICT"}  # Accelerate's short names


def did_you_mean(key: str, choices, list_valid: bool = True) -> str:
    if close := difflib.get_close_matches(key, list(choices), n=1):
        return f" (did you mean '{close[0]}'?)"
    return f" (valid: {', '.join(sorted(choices))})" if list_valid else ""


def _fits(value: Any, hint: Any) -> bool:
    """A bool fits only bool (a size given as `true` is a typo); an int fits a float."""
    if get_origin(hint) is Literal:
        return value in get_args(hint)
    if get_origin(hint) in (Union, types.UnionType):
        return any(_fits(value, arg) for arg in get_args(hint))
    if hint is type(None):
        return value is None
    if hint in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if hint is float else get_origin(hint) or hint)


TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
TYPE_NAMES.update({list: "a list", dict: "an object", type(None): "null"})


def _describe(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, get_args(hint)))
    if get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in get_args(hint))
    return TYPE_NAMES.get(get_origin(hint) or hint, str(hint))


AT_LEAST = {"train.global_batch_size": 1, "train.micro_batch_size": 1, "data.seq_len": 2}
AT_LEAST |= dict.fromkeys(
    ("train.steps", "train.warmup_steps", "train.stop_after", "train.loss_chunk_tokens"), 0
)
AT_LEAST |= {"checkpoint.interval": 0, "checkpoint.keep_latest": 1, "metrics.log_every": 1}
AT_LEAST |= {"lora.r": 0, "lora.dropout": 0, "eval.max_sequences": 1, "eval.batch_size": 1}
AT_LEAST |= {"eval.interval": 0, "eval.early_stopping_patience": 0, "eval.early_stopping_threshold": 0}
ABOVE_ZERO = ("train.lr", "parallelism.timeout_minutes")


def check_types(cfg: Config) -> None:
    """Every value against its field's type hint, and the bounds below."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for key, hint in get_type_hints(type(values)).items():
            path, value = f"{section.name}.{key}", getattr(values, key)
            if not _fits(value, hint):
                close = did_you_mean(str(value), get_args(hint), False) if get_origin(hint) is Literal else ""
                raise ConfigError(f"{path} is {value!r}; use {_describe(hint)}{close}")
            if path in AT_LEAST and value < AT_LEAST[path]:
                raise ConfigError(f"{path} is {value}; it must be >= {AT_LEAST[path]}")
            if path in ABOVE_ZERO and value <= 0:
                raise ConfigError(f"{path} is {value}; it must be > 0")


def normalize_state_dict_type(value: Any) -> Any:
    """Upper-cased, Accelerate's FULL / SHARDED spelled out; unknown ones as given."""
    if not isinstance(value, str):
        return value
    name = STATE_DICT_TYPES.get(value.upper(), value.upper())
    return name if name in STATE_DICT_TYPES.values() else value


def parse_scalar(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def fill_fields(obj, values: dict, prefix: str) -> None:
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"unknown key '{prefix}{key}'{did_you_mean(key, names)}")
        current = getattr(obj, key)
        if not dataclasses.is_dataclass(current):
            setattr(obj, key, value)
        elif isinstance(value, dict):
            fill_fields(current, value, f"{prefix}{key}.")
        else:
            raise ConfigError(f"'{prefix}{key}' must be an object, got {value!r}")


def apply_override(
    cfg: Config, item: str, changes: list | None = None, translation: Translation | None = None
) -> None:
    """`section.key=value`; dict-valued keys such as `model.config` take deeper paths. An FSDP1 key
    (`fsdp.sharding_strategy=SHARD_GRAD_OP`) is translated (common/ops/fsdp1.py)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not key.path=value (e.g. train.steps=20)")
    path, text = item.split("=", 1)
    *parents, leaf = path.split(".")
    if parents == ["fsdp"] and leaf == "reshard_after_forward" and text.strip('"').upper() in RESHARD:
        leaf = "sharding_strategy"  # an FSDP1 strategy name, as `accelerate config` writes it
    if parents == ["fsdp"] and leaf in FSDP1_KEYS:
        translation = translation or Translation()
        for key, value in translation.add(path, leaf, parse_scalar(text), "an override").items():
            setattr(cfg.fsdp, key, value)
        for key, value in translation.parallelism.items():
            setattr(cfg.parallelism, key, value)
        return
    obj: Any = cfg
    for depth, name in enumerate(parents + [leaf]):
        if not isinstance(obj, dict):
            valid = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
            if name not in valid:
                where = ".".join(path.split(".")[: depth + 1])
                raise ConfigError(f"unknown key '{where}' in override '{item}'{did_you_mean(name, valid)}")
        if depth < len(parents):
            obj = obj.setdefault(name, {}) if isinstance(obj, dict) else getattr(obj, name)
    value = parse_scalar(text)
    old = obj.get(leaf) if isinstance(obj, dict) else getattr(obj, leaf)
    if dataclasses.is_dataclass(old):
        raise ConfigError(f"override '{item}' names a section; name one of its keys instead")
    if changes is not None and old != value:
        changes.append(f"{path} {old!r} -> {value!r} (key=value)")
    if isinstance(obj, dict):
        obj[leaf] = value
    else:
        setattr(obj, leaf, value)


def normalize_fsdp_keys(
    values: dict, source: str, translation: Translation | None = None, external: bool = True
) -> dict:
    """A Transformers/Accelerate fsdp_config dict in our `fsdp` keys; FSDP1 keys translated. In another
    tool's config (`external`), version 1 only says that it is an FSDP1 config, so it is translated too;
    in the run config it was asked for, and stays an error."""
    known = {f.name for f in dataclasses.fields(FsdpConfig)}
    translation = translation or Translation()
    out = {}
    for raw_key, value in values.items():
        key = raw_key.removeprefix("fsdp_")
        key = FSDP_KEY_ALIASES.get(key, key)
        if external and key == "version" and str(value) == "1":
            translation.translated.append(f"{raw_key}=1 -> version=2")
            continue
        if key == "reshard_after_forward" and str(value).upper() in RESHARD:
            key = "sharding_strategy"  # what `accelerate config` writes for FSDP1 (to-fsdp2 maps it too)
        if key in FSDP1_KEYS:
            for new_key, new_value in translation.add(raw_key, key, value, source).items():
                if out.get(new_key, new_value) != new_value:
                    raise ConfigError(
                        f"'{raw_key}' in {source} means {new_key}={new_value} but {source} also sets "
                        f"{new_key}={out[new_key]}; give one of them"
                    )
                out[new_key] = new_value
            continue
        if key not in known:
            raise ConfigError(f"unknown key '{raw_key}' in {source}{did_you_mean(key, known)}")
        if external and key == "mixed_precision":  # Accelerate's (Transformers takes its bf16 from it)
            translation.accelerate_mixed_precision(value)
        if out.get(key, value) != value:
            raise ConfigError(
                f"'{raw_key}' in {source} is {value!r} but its FSDP1 keys mean {out[key]!r}; give one"
            )
        out[key] = value
    return out


def _accelerate_fsdp(doc: dict, path: str, translation: Translation) -> dict:
    if str(doc.get("distributed_type", "FSDP")).upper() != "FSDP":
        raise ConfigError(
            f"--accelerate-config {path}: distributed_type is {doc['distributed_type']!r}; set it to FSDP"
        )
    mixed_precision = {"mixed_precision": doc["mixed_precision"]} if "mixed_precision" in doc else {}
    return normalize_fsdp_keys({**(doc.get("fsdp_config") or {}), **mixed_precision}, path, translation)


def accelerate_parallelism(values: dict, source: str) -> dict:
    """A key or value we cannot honour is an error, never ignored."""
    out = {}
    for raw_key, value in values.items():
        key = raw_key.lower().removeprefix("parallelism_config_")
        if key in PARALLELISM_IGNORED:
            if str(value) != PARALLELISM_IGNORED[key]:
                raise ConfigError(
                    f"{raw_key}={value!r} in {source} is not supported; only "
                    f"{PARALLELISM_IGNORED[key]!r} (remove it)"
                )
            continue
        if key not in PARALLELISM_KEYS:
            raise ConfigError(
                f"'{raw_key}' in {source} has no equivalent here{did_you_mean(key, PARALLELISM_KEYS)}"
            )
        out[key] = value if key == "cp_comm_strategy" else int(value)
    return out


def accelerate_launch_env(environ: dict, translation: Translation) -> dict:
    if environ.get("ACCELERATE_USE_FSDP", "").lower() != "true":
        return {}
    fsdp1 = environ.get("FSDP_VERSION", "1") != "2"
    keys = LAUNCH_ENV_KEYS + FSDP1_LAUNCH_KEYS if fsdp1 else LAUNCH_ENV_KEYS
    names = {f"FSDP_{key.upper()}": key for key in keys} | {"ACCELERATE_MIXED_PRECISION": "mixed_precision"}
    values = {key: parse_scalar(environ[name]) for name, key in names.items() if name in environ}
    out = normalize_fsdp_keys(fsdp1_launch_values(values) if fsdp1 else values, LAUNCH_ENV, translation)
    # FSDP_MIN_NUM_PARAMS is always exported (default 1e8), but means something only for SIZE_BASED_WRAP.
    if out.get("auto_wrap_policy") == "SIZE_BASED_WRAP" and "FSDP_MIN_NUM_PARAMS" in environ:
        out["min_num_params"] = int(environ["FSDP_MIN_NUM_PARAMS"])
    return out


def _layer_sources(run_config: dict, externals: list[tuple[str, dict]], section: str, changes: list) -> dict:
    """The run config's keys under the external sources', which must agree with each other."""
    external, origin = {}, {}
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
    if key == "state_dict_type":
        return normalize_state_dict_type(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


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
    translation: Translation | None = None,
) -> Config:
    """Each value that a higher source changed is appended to `changes` as one short text; `translation`
    collects what the FSDP1 keys of every source became."""
    changes = [] if changes is None else changes
    environ = environ or {}
    translation = translation or Translation()
    translation.environ = environ
    values = _read_json(path, "--config")
    cfg = Config()
    run_fsdp = values.pop("fsdp", {}) or {}
    fill_fields(cfg, values, "")
    run_fsdp = normalize_fsdp_keys(run_fsdp, f"{path} (fsdp)", translation, external=False)
    fsdp_sources, parallelism_sources = [], []
    if fsdp_config:
        from_file = normalize_fsdp_keys(_read_json(fsdp_config, "--fsdp-config"), fsdp_config, translation)
        fsdp_sources.append((fsdp_config, from_file))
    if accelerate_config:
        if not os.path.exists(accelerate_config):
            raise ConfigError(
                f"--accelerate-config {accelerate_config} does not exist; pass an existing YAML file"
            )
        import yaml

        with open(accelerate_config) as f:
            doc = yaml.safe_load(f) or {}
        fsdp_sources.append((accelerate_config, _accelerate_fsdp(doc, accelerate_config, translation)))
    if launch_env := accelerate_launch_env(environ, translation):
        fsdp_sources.append((LAUNCH_ENV, launch_env))
    fill_fields(cfg.fsdp, _layer_sources(run_fsdp, fsdp_sources, "fsdp", changes), "fsdp.")
    if accelerate_config:
        block = doc.get("parallelism_config") or {}
        parallelism_sources.append((accelerate_config, accelerate_parallelism(block, accelerate_config)))
    if translation.parallelism:  # FSDP1's hybrid sharding: HSDP over the launcher's nodes
        parallelism_sources.append(("FSDP1 sharding_strategy", translation.parallelism))
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
        exported = {k: v for k, v in environ.items() if k.startswith("PARALLELISM_CONFIG_")}
        parallelism_sources.append((LAUNCH_ENV, accelerate_parallelism(exported, LAUNCH_ENV)))
    parallelism = _layer_sources(values.get("parallelism", {}), parallelism_sources, "parallelism", changes)
    fill_fields(cfg.parallelism, parallelism, "parallelism.")
    for item in overrides:
        apply_override(cfg, item, changes, translation)
    cfg.fsdp.state_dict_type = normalize_state_dict_type(cfg.fsdp.state_dict_type)
    check_types(cfg)
    validate(cfg)
    return cfg
