"""Config handling: the Transformers/Accelerate inputs are applied, and bad input is one line + exit 2."""

import json
import os
import re

import pytest
import yaml

from common.config import ConfigError
from common.ops.cli import parse_args, run_cli
from common.ops.config_checks import is_shard_size
from common.ops.config_sources import load_config
from launch import REPO, TINY, each_rank, event, free_port, pretrain, read_metrics, run

pretrain_script = None


def cli():
    """scripts/pretrain_fsdp.py run as its command line does, in-process (errors precede process groups)."""
    global pretrain_script
    if pretrain_script is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "pretrain_fsdp", os.path.join(REPO, "scripts", "pretrain_fsdp.py")
        )
        pretrain_script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pretrain_script)
    return lambda argv: run_cli(pretrain_script.main, argv)


def test_transformers_docs_fsdp_config_is_taken_unchanged():
    cfg = load_config(TINY, fsdp_config=os.path.join(REPO, "configs", "fsdp", "transformers_doc.json"))
    f = cfg.fsdp
    assert (f.version, f.reshard_after_forward, f.cpu_offload, f.auto_wrap_policy) == (
        2,
        True,
        False,
        "TRANSFORMER_BASED_WRAP",
    )
    assert f.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"] and f.state_dict_type == "FULL_STATE_DICT"
    assert f.cpu_ram_efficient_loading is True and f.activation_checkpointing is True


def test_fsdp_prefixed_keys_and_accelerate_yaml_map_offload_params(tmp_path):
    cfg = load_config(TINY, fsdp_config=os.path.join(REPO, "configs", "fsdp", "zero2_offload.json"))
    assert cfg.fsdp.cpu_offload is True and cfg.fsdp.reshard_after_forward is False
    assert cfg.fsdp.state_dict_type == "SHARDED_STATE_DICT"
    doc = yaml.safe_load(open(os.path.join(REPO, "configs", "fsdp", "accelerate_fsdp2.yaml")))
    doc["fsdp_config"]["fsdp_offload_params"] = True
    doc["mixed_precision"] = "bf16"
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(doc))
    cfg = load_config(TINY, accelerate_config=str(tmp_path / "acc.yaml"))
    assert cfg.fsdp.cpu_offload is True  # Transformers ignores fsdp_offload_params; we must not
    assert cfg.fsdp.transformer_layer_cls_to_wrap == "LlamaDecoderLayer"
    assert cfg.fsdp.mixed_precision == "bf16"


def test_accelerate_parallelism_config_block_is_honoured_never_ignored(tmp_path):
    block = {
        "parallelism_config_dp_replicate_size": 1,
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_cp_size": 2,
        "parallelism_config_cp_comm_strategy": "alltoall",
        "parallelism_config_cp_backend": "torch",
    }
    acc = tmp_path / "acc.yaml"
    acc.write_text(
        yaml.safe_dump({"distributed_type": "FSDP", "fsdp_config": {}, "parallelism_config": block})
    )
    p = load_config(TINY, accelerate_config=str(acc)).parallelism
    assert (p.dp_shard_size, p.cp_size, p.cp_comm_strategy) == (2, 2, "alltoall")
    env = {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_CP_SIZE": "4",
        "PARALLELISM_CONFIG_SP_SIZE": "1",
        "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed",
    }
    assert load_config(TINY, environ=env).parallelism.cp_size == 4
    # The run config says cp_size=1, the Accelerate file 2: the more specific file wins, and says so.
    changes = []
    assert _with_json_cp(tmp_path, acc, changes).parallelism.cp_size == 2
    assert changes == [f"parallelism.cp_size 1 -> 2 ({acc})"]
    for bad, message in [
        ({"parallelism_config_cp_backend": "deepspeed"}, "is not supported; only 'torch'"),
        ({"parallelism_config_cp_sizes": 2}, "did you mean 'cp_size'"),
    ]:
        acc.write_text(yaml.safe_dump({"distributed_type": "FSDP", "parallelism_config": bad}))
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(TINY, accelerate_config=str(acc))


def _with_json_cp(tmp_path, acc, changes):
    config = json.load(open(TINY))
    config["parallelism"] = {"cp_size": 1}
    (tmp_path / "run.json").write_text(json.dumps(config))
    return load_config(str(tmp_path / "run.json"), accelerate_config=str(acc), changes=changes)


def test_accelerate_launch_environment_is_honoured():
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_OFFLOAD_PARAMS": "true",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
        "FSDP_MIN_NUM_PARAMS": "1000",
        "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
        "ACCELERATE_MIXED_PRECISION": "no",
    }
    f = load_config(TINY, environ=env).fsdp
    assert (f.cpu_offload, f.reshard_after_forward, f.auto_wrap_policy, f.min_num_params) == (
        True,
        False,
        "SIZE_BASED_WRAP",
        1000,
    )


def test_overrides_reach_nested_keys():
    cfg = load_config(
        TINY,
        [
            "train.steps=7",
            "fsdp.reshard_after_forward=2",
            "model.config.num_hidden_layers=3",
            "data.dataset=/data/*.jsonl",
            "train.betas=[0.8, 0.9]",
        ],
    )
    assert cfg.train.steps == 7 and cfg.fsdp.reshard_after_forward == 2
    assert cfg.model.config["num_hidden_layers"] == 3 and cfg.data.dataset == "/data/*.jsonl"
    assert cfg.train.betas == [0.8, 0.9]


def write(tmp_path, name, content) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


BEST_MODEL = ["data.eval_dataset=embedded", "checkpoint.load_best_model_at_end=true"]
BAD_INPUTS = {
    "shard_size_in_gib": (
        ["checkpoint.max_shard_size=5GiB", "fsdp.state_dict_type=FULL_STATE_DICT"],
        r"checkpoint.max_shard_size is '5GiB'; give a number of bytes, or a size in TB, GB, MB or KB",
    ),
    "shard_size_zero": (
        ["checkpoint.max_shard_size=0", "fsdp.state_dict_type=FULL_STATE_DICT"],
        r"checkpoint.max_shard_size is 0; give a number of bytes",
    ),
    "unknown_section": (["trian.steps=3"], "did you mean 'train'"),
    "unknown_key": (["train.stpes=3"], "did you mean 'steps'"),
    "fsdp1": (["fsdp.version=1"], "fsdp.version is 1; FSDP1 is not supported"),
    "wrap_policy": (
        ["fsdp.auto_wrap_policy=TRANSFORMER_WRAP"],
        "fsdp.auto_wrap_policy is 'TRANSFORMER_WRAP'",
    ),
    "size_wrap_zero": (
        ["fsdp.auto_wrap_policy=SIZE_BASED_WRAP", "fsdp.min_num_params=0"],
        "fsdp.min_num_params is 0",
    ),
    "ac_and_gc": (
        ["fsdp.activation_checkpointing=true", "train.gradient_checkpointing=true"],
        "fsdp.activation_checkpointing and train.gradient_checkpointing are both true",
    ),
    "ac_policy_without_ac": (
        ["fsdp.ac_policy=op"],
        "fsdp.ac_policy is 'op' but fsdp.activation_checkpointing",
    ),
    "ac_policy_value": (
        ["fsdp.activation_checkpointing=true", "fsdp.ac_policy=selective"],
        "fsdp.ac_policy is 'selective'; use one of full, op or an integer",
    ),
    "ac_policy_zero": (
        ["fsdp.activation_checkpointing=true", "fsdp.ac_policy=0"],
        "every Nth layer needs N >= 1",
    ),
    "state_dict_type": (
        ["fsdp.state_dict_type=LOCAL_STATE_DICT"],
        "fsdp.state_dict_type is 'LOCAL_STATE_DICT'",
    ),
    "fp16": (["fsdp.mixed_precision=fp16"], "needs loss scaling"),
    "micro_batch": (["train.micro_batch_size=0"], "train.micro_batch_size is 0"),
    "batch_divisibility": (
        ["train.global_batch_size=10", "train.micro_batch_size=4"],
        "make it a multiple of 4",
    ),
    "mesh": (["parallelism.dp_replicate_size=2"], "does not cover the world size 1"),
    "tp_world": (["parallelism.tp_size=2"], "parallelism.tp_size=2 does not divide the world size 1"),
    "layer_class": (
        ['fsdp.transformer_layer_cls_to_wrap=["LlamaBlock"]'],
        "its classes are:.*LlamaDecoderLayer",
    ),
    "override_syntax": (["train.steps"], "is not key.path=value"),
    "lr": (["train.lr=-1"], "train.lr is -1"),
    "reshard_type": (['fsdp.reshard_after_forward="yes"'], "fsdp.reshard_after_forward is 'yes'"),
    "cp_and_sp": (["parallelism.cp_size=2", "parallelism.sp_size=2"], "pick one"),
    "missing_checkpoint": (
        ["model.name_or_path=/nonexistent/llama", "model.config={}"],
        "model.name_or_path '/nonexistent/llama'",
    ),
    "both_model_sources": (["model.name_or_path=/some/dir"], "set model.config={}"),
    "seq_len": (["data.seq_len=1"], "data.seq_len is 1"),
    # Checked by type: these were TypeError tracebacks before every field was checked against its annotation.
    "warmup_type": (['train.warmup_steps="5"'], "train.warmup_steps is '5'; use an integer"),
    "log_every_type": (['metrics.log_every="often"'], "metrics.log_every is 'often'; use an integer"),
    "bool_as_size": (["parallelism.cp_size=true"], "parallelism.cp_size is True; use an integer"),
    "enum": (["train.lr_schedule=linear"], "train.lr_schedule is 'linear'; use one of cosine, wsd"),
    "profile_steps": (
        ["metrics.profile_steps=[3, 2]"],
        r"metrics.profile_steps is \[3, 2\]; give \[first, last\]",
    ),
    "memory_snapshot_on_cpu": (["metrics.memory_snapshot=true"], "this run is on the CPU; it records CUDA's"),
    # Evaluation during training, the best model and early stopping (the Trainer's rules).
    "eval_without_held_out_set": (["eval.interval=5"], "eval.interval is 5 but data.eval_dataset is not set"),
    "negative_patience": (
        ["eval.early_stopping_patience=-1"],
        "eval.early_stopping_patience is -1; it must be >= 0",
    ),
    "early_stopping_without_eval": (
        ["eval.early_stopping_patience=2"],
        "eval.early_stopping_patience is 2 but eval.interval is 0, so nothing is evaluated",
    ),
    "best_model_without_checkpoints": (
        ["data.eval_dataset=embedded", "eval.interval=5", "checkpoint.load_best_model_at_end=true"],
        "checkpoint.interval is 0 and eval.interval is 5; set checkpoint.interval to a multiple of 5",
    ),
    "best_model_with_unranked_checkpoints": (
        [*BEST_MODEL, "eval.interval=6", "checkpoint.interval=4"],
        "checkpoint.interval is 4 and eval.interval is 6; set checkpoint.interval to a multiple of 6 "
        r"\(the Trainer's rule for save_steps and eval_steps\) or a divisor",
    ),
}


def test_the_best_model_takes_the_trainers_save_and_eval_steps():
    """checkpoint.interval a multiple of eval.interval, as the Trainer asks of save_steps and eval_steps,
    or a divisor of it (a checkpoint at every evaluation); any other is refused."""
    accepted = []
    for interval in range(1, 21):
        try:
            load_config(TINY, [*BEST_MODEL, "eval.interval=5", f"checkpoint.interval={interval}"])
            accepted.append(interval)
        except ConfigError as error:
            assert f"checkpoint.interval is {interval} and eval.interval is 5" in str(error)
    assert accepted == [1, 5, 10, 15, 20]


@pytest.mark.parametrize("size", ["5GB", "0.5GB", " 2 mb", "5 GB", "1TB", "5GiB", "5G", "5", "GB", "abc"])
def test_max_shard_size_takes_what_save_pretrained_takes(size):
    """Checked before training with the parser save_pretrained uses after it (huggingface_hub's)."""
    from huggingface_hub.serialization import split_torch_state_dict_into_shards

    try:
        split_torch_state_dict_into_shards({}, max_shard_size=size)
        theirs = True
    except ValueError:
        theirs = False
    assert is_shard_size(size) == theirs
    assert is_shard_size(1_000_000) and not is_shard_size(0) and not is_shard_size(True)


@pytest.mark.parametrize("key", ["max_shard_size=1MB", "export_dtype=bfloat16", "export_writers=one"])
@pytest.mark.parametrize("export", ["fsdp.state_dict_type=SHARDED_STATE_DICT", "lora.r=4"])
def test_a_key_that_shapes_a_full_export_is_an_error_with_any_other(key, export):
    """A SHARDED export is DCP's files, and a LoRA one PEFT's adapters: keys of save_pretrained's layout would
    do nothing there."""
    name = key.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^checkpoint\.{name} is set but the export is (SHARDED|PEFT)"):
        load_config(TINY, [f"checkpoint.{key}", export])
    load_config(TINY, [f"checkpoint.{key}", "fsdp.state_dict_type=FULL_STATE_DICT"])


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, name):
    overrides, message = BAD_INPUTS[name]
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        cli()(["--config", TINY, f"checkpoint.dir={run_dir}", *overrides])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: "), err
    assert __import__("re").search(message, err[0]), err[0]
    assert not run_dir.exists()


def test_bad_files_are_one_line_and_exit_2(tmp_path, capsys):
    cases = [
        (["--config", str(tmp_path / "missing.json")], "does not exist"),
        (["--config", write(tmp_path, "bad.json", "{not json")], "is not valid JSON"),
        (
            [
                "--config",
                TINY,
                "--fsdp-config",
                write(tmp_path, "f1.json", {"ignored_modules": ["lm_head"]}),
            ],
            "leave unsharded with gradients no rank reduces",
        ),
        (
            [
                "--config",
                TINY,
                "--fsdp-config",
                write(tmp_path, "f2.json", {"reshard_after_forward": False}),
                "--accelerate-config",
                write(
                    tmp_path,
                    "a.yaml",
                    "distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: true\n",
                ),
            ],
            "give it in one of them only",
        ),
        (
            ["--config", TINY, "--fsdp-config", write(tmp_path, "f3.json", {"cpu_offlaod": True})],
            "did you mean 'cpu_offload'",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            cli()(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], (argv, err)


def test_bad_input_under_python_and_on_every_rank_prints_one_line(tmp_path):
    single = run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}/a", "fsdp.version=1"],
        nproc=0,
        check=False,
    )
    assert single.returncode == 2 and single.stderr.strip().splitlines() == [
        "config error: fsdp.version is 1; FSDP1 is not supported, set it to 2 (fully_shard)"
    ]
    ranks = each_rank(
        "pretrain_fsdp.py", ["--config", TINY, f"checkpoint.dir={tmp_path}/b", "fsdp.version=1"]
    )
    for rank, (code, stderr) in enumerate(ranks):
        assert code == 2 and stderr.strip().splitlines() == [
            f"[rank{rank}] config error: fsdp.version is 1; FSDP1 is not supported, set it to 2 (fully_shard)"
        ], stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_llama_json_offline_fails_with_a_clear_message():
    proc = run(
        "pretrain_fsdp.py",
        ["--config", os.path.join(REPO, "configs", "llama.json")],
        nproc=0,
        check=False,
        extra_env={"HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("config error: data.tokenizer 'meta-llama/Llama-3.1-8B'")
    )


def test_transformers_doc_fsdp_config_runs_for_real(tmp_path):
    records = pretrain(
        tmp_path,
        "train.steps=2",
        "--fsdp-config",
        os.path.join(REPO, "configs", "fsdp", "transformers_doc.json"),
    )
    resolved = json.load(open(tmp_path / "run_config.json"))["fsdp"]
    assert resolved["activation_checkpointing"] is True and resolved["transformer_layer_cls_to_wrap"] == [
        "LlamaDecoderLayer"
    ]
    assert event(records, "model_ready")["world_size"] == 2


def test_accelerate_launch_runs_fsdp2_on_two_cpu_processes(tmp_path):
    doc = yaml.safe_load(open(os.path.join(REPO, "configs", "fsdp", "accelerate_fsdp2.yaml")))
    doc["fsdp_config"].update(
        fsdp_offload_params=True, fsdp_reshard_after_forward=False, fsdp_state_dict_type="SHARDED_STATE_DICT"
    )
    acc = tmp_path / "default_config.yaml"
    acc.write_text(yaml.safe_dump(doc))
    run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}/run", "train.steps=2"],
        launcher=["accelerate", "launch", "--config_file", str(acc), "--main_process_port", str(free_port())],
    )
    records = read_metrics(tmp_path / "run")
    assert event(records, "model_ready")["world_size"] == 2
    resolved = json.load(open(tmp_path / "run" / "run_config.json"))["fsdp"]
    assert resolved["cpu_offload"] is True and resolved["reshard_after_forward"] is False
    assert sorted(f for f in os.listdir(tmp_path / "run" / "export") if f.endswith(".distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]


def test_the_more_specific_source_wins_and_is_logged(tmp_path, capsys, monkeypatch):
    """debug_llama.json sets reshard_after_forward and auto_wrap_policy; a user's Accelerate YAML differs."""
    monkeypatch.delenv("RANK", raising=False)
    yaml_path = write(
        tmp_path,
        "accelerate.yaml",
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n"
        "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 100000\n",
    )
    debug_llama = os.path.join(REPO, "configs", "debug_llama.json")
    cfg = parse_args(["--config", debug_llama, "--accelerate-config", yaml_path, "train.steps=3"])
    assert (cfg.fsdp.reshard_after_forward, cfg.fsdp.auto_wrap_policy) == (False, "SIZE_BASED_WRAP")
    assert cfg.train.steps == 3
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("config: 3 value(s) changed by a more specific source"), (
        lines
    )
    for change in (
        "fsdp.reshard_after_forward True -> False",
        "fsdp.auto_wrap_policy 'TRANSFORMER_BASED_WRAP'",
        "train.steps 60 -> 3 (key=value)",
    ):
        assert change in lines[0], lines[0]
    # key=value beats the external config; a key no source changes is not listed.
    cfg = parse_args(
        ["--config", debug_llama, "--accelerate-config", yaml_path, "fsdp.reshard_after_forward=true"]
    )
    assert cfg.fsdp.reshard_after_forward is True
    assert "fsdp.reshard_after_forward False -> True (key=value)" in capsys.readouterr().out
    parse_args(["--config", debug_llama])
    assert capsys.readouterr().out == ""


# Public FSDP configs beside the clone (../shared/configs-in-the-wild, never copied into the project; its
# SOURCES.md says where each comes from): Accelerate YAMLs through --accelerate-config, Transformers JSONs
# through --fsdp-config. The four that stop do so with one line naming what is wrong.
WILD = os.path.join(REPO, "..", "shared", "configs-in-the-wild")
REFUSED_IN_THE_WILD = {
    "hiyouga__LLaMA-Factory__examples_accelerate_fsdp_config@935ee0a.yaml": (
        "fsdp.mixed_precision.param_dtype is float16, which needs loss scaling that FSDP2 does not do"
    ),
    "hiyouga__LLaMA-Factory__examples_accelerate_fsdp_v2_config.yaml": (
        "'fsdp_sharding_strategy' in {path} means reshard_after_forward=True but {path} also sets "
        "reshard_after_forward=False; give one of them"
    ),
    "mamhamed__memorization-and-retrieval__fsdp_config.json": "fsdp.cpu_offload is 'true'; use true or false",
    "tatsu-lab__alpaca_farm__examples_accelerate_configs_rlhf_ppo_fsdp_llama_8gpu.yaml": (
        "unknown key 'fsdp_backward_prefetch_policy' in {path} (valid: "
    ),
}


@pytest.mark.skipif(
    not os.path.isdir(WILD), reason=f"{WILD} is absent (it lives beside the clone, not in it)"
)
def test_35_configs_in_the_wild_load_or_stop_with_one_clear_line():
    names = sorted(n for n in os.listdir(WILD) if n.endswith((".yaml", ".json")))
    assert len(names) == 35
    loaded, refused = [], {}
    for name in names:
        path = os.path.join(WILD, name)
        source = {"fsdp_config": path} if name.endswith(".json") else {"accelerate_config": path}
        try:
            load_config(TINY, environ={}, **source)
            loaded.append(name)
        except ConfigError as error:
            refused[name] = str(error)
    assert len(loaded) == 31 and sorted(refused) == sorted(REFUSED_IN_THE_WILD), refused
    for name, message in refused.items():
        expected = REFUSED_IN_THE_WILD[name].format(path=os.path.join(WILD, name))
        assert expected in message and "\n" not in message, message
