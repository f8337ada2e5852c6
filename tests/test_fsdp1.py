"""FSDP1 configs run as they are: Accelerate's `to-fsdp2` mapping, hybrid sharding as HSDP over the nodes,
dropped keys named in one line; from an Accelerate YAML, the `accelerate launch` environment, a Transformers
fsdp_config JSON and key=value overrides."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from common.ops.config_sources import load_config
from common.ops.fsdp1 import Translation
from launch import REPO, TINY, env, event, free_port, losses, pretrain, read_metrics, run

FSDP1_YAML = os.path.join(REPO, "configs", "fsdp", "accelerate_fsdp1.yaml")
# (FSDP1 value, reshard_after_forward, HSDP over the nodes)
TABLE = [
    ("FULL_SHARD", True, False),
    ("SHARD_GRAD_OP", False, False),
    ("NO_SHARD", False, False),
    ("HYBRID_SHARD", True, True),
    ("HYBRID_SHARD_ZERO2", False, True),
    (2, False, False),  # Accelerate's numbers: 2 is SHARD_GRAD_OP
]
LAUNCHER = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}  # 2 nodes x 2 processes
ALL_DROPPED = (
    "dropped (no FSDP2 meaning): backward_prefetch, forward_prefetch, sync_module_states, use_orig_params"
)


def accelerate_launch_environment(yaml_path: str) -> dict:
    """The environment `accelerate launch --config_file yaml_path` gives the script, built by Accelerate's
    own launcher code (it also exports defaults the YAML never set, such as FSDP_VERSION=1)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", yaml_path, "train.py"])
    return prepare_multi_gpu_env(_validate_launch_command(args)[0])


def translated(source: str, value, tmp_path, key: str = "sharding_strategy") -> tuple:
    """(cfg, the one line) after giving `key`=value and the dropped keys through `source`."""
    fsdp1 = {key: value, "backward_prefetch": "BACKWARD_PRE", "use_orig_params": True}
    environ, kwargs = dict(LAUNCHER), {}
    if source in ("yaml", "launch environment"):
        doc = {"distributed_type": "FSDP", "fsdp_config": {f"fsdp_{k}": v for k, v in fsdp1.items()}}
        doc |= {"num_processes": 4, "use_cpu": True}
        (tmp_path / "acc.yaml").write_text(yaml.safe_dump(doc))
        if source == "yaml":
            kwargs["accelerate_config"] = str(tmp_path / "acc.yaml")
        else:
            environ |= accelerate_launch_environment(str(tmp_path / "acc.yaml"))
    elif source == "fsdp_config json":
        (tmp_path / "fsdp.json").write_text(json.dumps({f"fsdp_{k}": v for k, v in fsdp1.items()}))
        kwargs["fsdp_config"] = str(tmp_path / "fsdp.json")
    translation = Translation()
    overrides = [f"fsdp.sharding_strategy={value}"] if source == "key=value" else []
    cfg = load_config(TINY, overrides, environ=environ, translation=translation, **kwargs)
    return cfg, translation.line()


@pytest.mark.parametrize("source", ["yaml", "launch environment", "fsdp_config json", "key=value"])
@pytest.mark.parametrize("value,reshard,hybrid", TABLE, ids=[str(row[0]) for row in TABLE])
def test_each_fsdp1_sharding_strategy_becomes_its_fsdp2_keys(tmp_path, source, value, reshard, hybrid):
    cfg, line = translated(source, value, tmp_path)
    assert cfg.fsdp.reshard_after_forward is reshard
    sizes = (cfg.parallelism.dp_replicate_size, cfg.parallelism.dp_shard_size)
    assert sizes == ((2, 2) if hybrid else (1, -1))
    name = {2: "SHARD_GRAD_OP"}.get(value, value)
    assert f"sharding_strategy={name} -> reshard_after_forward={str(reshard).lower()}" in line
    if hybrid:
        assert "parallelism.dp_replicate_size=2 (nodes) x dp_shard_size=2" in line
    if source == "launch environment":  # Accelerate exports these two whatever the YAML says
        assert line.endswith(ALL_DROPPED)
    elif source != "key=value":
        assert line.endswith("dropped (no FSDP2 meaning): backward_prefetch, use_orig_params")


@pytest.mark.parametrize("source", ["yaml", "launch environment", "fsdp_config json", "key=value"])
def test_an_fsdp1_strategy_in_reshard_after_forward_is_translated_too(tmp_path, source):
    """`accelerate config` now writes FSDP1 as fsdp_version 1 with the strategy in fsdp_reshard_after_forward,
    and `accelerate launch` then exports FSDP_SHARDING_STRATEGY=FULL_SHARD beside it: the chosen one wins."""
    cfg, line = translated(source, "SHARD_GRAD_OP", tmp_path, key="reshard_after_forward")
    assert cfg.fsdp.reshard_after_forward is False and cfg.fsdp.version == 2
    assert "=SHARD_GRAD_OP -> reshard_after_forward=false" in line


@pytest.mark.parametrize("source", ["yaml", "launch environment", "fsdp_config json"])
def test_every_common_fsdp1_key_becomes_its_fsdp2_key_or_is_dropped(tmp_path, source):
    fsdp1 = {
        "version": 1,
        "sharding_strategy": "SHARD_GRAD_OP",
        "offload_params": True,
        "auto_wrap_policy": "SIZE_BASED_WRAP",
        "min_num_params": 12345,
        "backward_prefetch": "BACKWARD_PRE",
        "forward_prefetch": True,
        "use_orig_params": True,
        "sync_module_states": True,
        "state_dict_type": "SHARDED_STATE_DICT",
        "activation_checkpointing": True,
    }
    environ, kwargs = dict(LAUNCHER), {}
    if source == "fsdp_config json":
        (tmp_path / "fsdp.json").write_text(json.dumps({f"fsdp_{k}": v for k, v in fsdp1.items()}))
        kwargs["fsdp_config"] = str(tmp_path / "fsdp.json")
    else:
        doc = {"distributed_type": "FSDP", "fsdp_config": {f"fsdp_{k}": v for k, v in fsdp1.items()}}
        (tmp_path / "acc.yaml").write_text(yaml.safe_dump(doc | {"num_processes": 4, "use_cpu": True}))
        if source == "yaml":
            kwargs["accelerate_config"] = str(tmp_path / "acc.yaml")
        else:
            environ |= accelerate_launch_environment(str(tmp_path / "acc.yaml"))
    translation = Translation()
    f = load_config(TINY, [], environ=environ, translation=translation, **kwargs).fsdp
    assert (f.version, f.reshard_after_forward, f.cpu_offload, f.auto_wrap_policy) == (
        2,
        False,
        True,
        "SIZE_BASED_WRAP",
    )
    assert (f.min_num_params, f.state_dict_type, f.activation_checkpointing) == (
        12345,
        "SHARDED_STATE_DICT",
        True,
    )
    assert translation.line().endswith(ALL_DROPPED)


def test_keys_that_cannot_be_translated_are_one_error_and_version_1_stays_one():
    with pytest.raises(Exception, match="FSDP2 would leave unsharded with gradients no rank reduces"):
        load_config(TINY, ['fsdp.ignored_modules=["lm_head"]'])
    with pytest.raises(Exception, match="fsdp.version is 1; FSDP1 is not supported"):
        load_config(TINY, ["fsdp.version=1"])
    translation = Translation()
    load_config(TINY, ["fsdp.ignored_modules=[]"], translation=translation)  # empty: nothing to ignore
    assert translation.line() == "config: dropped (no FSDP2 meaning): ignored_modules"


def test_what_runs_differently_from_accelerate_is_said_in_the_one_line(tmp_path):
    """NO_SHARD keeps the parameters sharded (FSDP1 replicated them); Accelerate's bf16 reduces in bf16."""
    _, line = translated("yaml", "NO_SHARD", tmp_path)
    assert "not as Accelerate runs it: NO_SHARD -> parameters stay sharded" in line
    assert line.endswith("dropped (no FSDP2 meaning): backward_prefetch, use_orig_params")
    doc = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}, "mixed_precision": "bf16"}
    (tmp_path / "bf16.yaml").write_text(yaml.safe_dump(doc | {"num_processes": 2, "use_cpu": True}))
    for kwargs in (
        {"accelerate_config": str(tmp_path / "bf16.yaml")},
        {"environ": accelerate_launch_environment(str(tmp_path / "bf16.yaml"))},
    ):
        translation = Translation()
        cfg = load_config(TINY, translation=translation, **kwargs)
        assert cfg.fsdp.mixed_precision == "bf16"
        assert translation.line() == (
            "config: not as Accelerate runs it: mixed_precision=bf16 -> gradients reduced in float32 "
            '(Accelerate reduces them in bf16; fsdp.mixed_precision={"param_dtype": "bfloat16", '
            '"reduce_dtype": "bfloat16"} does that)'
        )


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("source", ["yaml", "launch environment", "fsdp_config json", "key=value"])
def test_activation_checkpointing_offload_is_read_from_every_source(tmp_path, source, version):
    """Accelerate's key (FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD under accelerate launch), FSDP1 or FSDP2."""
    fsdp = {"fsdp_version": version, "fsdp_activation_checkpointing": True}
    fsdp["fsdp_activation_checkpointing_offload"] = True
    environ, kwargs, overrides = {}, {}, []
    if source in ("yaml", "launch environment"):
        doc = {"distributed_type": "FSDP", "fsdp_config": fsdp, "num_processes": 2, "use_cpu": True}
        (tmp_path / "acc.yaml").write_text(yaml.safe_dump(doc))
        if source == "yaml":
            kwargs["accelerate_config"] = str(tmp_path / "acc.yaml")
        else:
            environ = accelerate_launch_environment(str(tmp_path / "acc.yaml"))
            assert environ["FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"] == "true"
    elif source == "fsdp_config json":
        (tmp_path / "fsdp.json").write_text(json.dumps(fsdp))
        kwargs["fsdp_config"] = str(tmp_path / "fsdp.json")
    else:
        overrides = ["fsdp.activation_checkpointing=true", "fsdp.activation_checkpointing_offload=true"]
    f = load_config(TINY, overrides, environ=environ, **kwargs).fsdp
    assert f.activation_checkpointing and f.activation_checkpointing_offload
    with pytest.raises(
        Exception, match="activation_checkpointing_offload is true but nothing is checkpointed"
    ):
        load_config(TINY, ["fsdp.activation_checkpointing_offload=true"])  # Accelerate refuses it too


def test_ignored_modules_under_an_fsdp2_accelerate_launch_are_one_error(tmp_path):
    """FSDP_IGNORED_MODULES (FSDP_VERSION=2) is read, and refused as in an FSDP1 config."""
    fsdp = {"fsdp_version": 2, "fsdp_ignored_modules": "model.layers.0"}
    doc = {"distributed_type": "FSDP", "fsdp_config": fsdp, "num_processes": 2, "use_cpu": True}
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(doc))
    environ = accelerate_launch_environment(str(tmp_path / "acc.yaml"))
    assert environ["FSDP_VERSION"] == "2" and environ["FSDP_IGNORED_MODULES"] == "model.layers.0"
    with pytest.raises(Exception, match="'ignored_modules' in the accelerate launch environment is 'model"):
        load_config(TINY, environ=environ)


@pytest.mark.compat
def test_the_shipped_fsdp1_accelerate_yaml_trains_under_accelerate_launch_and_records_the_translation(
    tmp_path,
):
    """As a user runs it: `accelerate launch --config_file accelerate_fsdp1.yaml`, whose environment says
    FSDP_VERSION=1 and FSDP_RESHARD_AFTER_FORWARD=true beside the FSDP1 keys."""
    plain = pretrain(tmp_path / "plain", "train.steps=2", "checkpoint.export=false")  # the FSDP2 defaults
    translated_dir = tmp_path / "translated"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", FSDP1_YAML]
    launcher += ["--main_process_port", str(free_port())]
    proc = run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={translated_dir}", "train.steps=2"],
        launcher=launcher,
        timeout=300,
    )
    assert proc.stdout.count("sharding_strategy=FULL_SHARD -> reshard_after_forward=true") == 1
    assert ALL_DROPPED in proc.stdout
    with open(translated_dir / "run_config.json") as f:
        fsdp = json.load(f)["fsdp"]
    assert fsdp["reshard_after_forward"] is True and fsdp["state_dict_type"] == "SHARDED_STATE_DICT"
    assert fsdp["cpu_ram_efficient_loading"] is True and fsdp["version"] == 2
    assert losses(read_metrics(translated_dir)) == pytest.approx(losses(plain), abs=1e-5)


def test_hybrid_shard_on_two_nodes_of_two_processes_is_hsdp_and_trains_like_one_process(tmp_path):
    """Two torchrun agents (--nnodes 2) of 2 processes: HYBRID_SHARD becomes dp_replicate 2 x dp_shard 2."""
    reference = pretrain(tmp_path / "one", "train.steps=4", "checkpoint.export=false", nproc=0)
    run_dir, port = tmp_path / "hybrid", free_port()
    nodes = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2"]
        cmd += [f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}"]
        cmd += [
            os.path.join(REPO, "scripts", "pretrain_fsdp.py"),
            "--config",
            TINY,
            f"checkpoint.dir={run_dir}",
        ]
        cmd += ["train.steps=4", "checkpoint.export=false", "fsdp.sharding_strategy=HYBRID_SHARD"]
        log = open(tmp_path / f"node{node}.log", "w")
        nodes.append(subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=log, stderr=log))
    assert [node.wait(timeout=300) for node in nodes] == [0, 0], (tmp_path / "node0.log").read_text()[-3000:]
    records = read_metrics(run_dir)
    assert event(records, "model_ready")["mesh"] == {"dp_replicate": 2, "dp_shard": 2}
    assert "dp_replicate_size=2 (nodes) x dp_shard_size=2" in (tmp_path / "node0.log").read_text()
    assert losses(records) == pytest.approx(losses(reference), abs=1e-5)


@pytest.mark.parametrize("example", ["transformers_doc.json", "zero2_offload.json"])
def test_the_shipped_fsdp_config_examples_train(tmp_path, example):
    """configs/fsdp/ as shipped (the YAML ones run above and in test_config.py and test_tp.py)."""
    config = os.path.join(REPO, "configs", "fsdp", example)
    records = pretrain(tmp_path, "train.steps=2", "checkpoint.export=false", "--fsdp-config", config)
    assert len(losses(records)) == 2
