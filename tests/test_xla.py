"""tpu_xla_fsdp.py: config, wrap plan and key helpers here (main environment, no torch_xla); the real
SPMD FSDPv2 runs (`xla` marker) in the PyTorch/XLA environment on XLA's CPU runtime with 4 devices."""

import importlib.util
import json
import os
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from common.config import ConfigError, FsdpConfig
from common.ops.config_sources import load_config
from launch import REPO, XLA_PYTHON, env, event, losses, pretrain, read_metrics, run, xla_unavailable

DEBUG_TPU = os.path.join(REPO, "configs", "debug_tpu.json")

spec = importlib.util.spec_from_file_location(
    "tpu_xla_fsdp", os.path.join(REPO, "scripts", "tpu_xla_fsdp.py")
)
tpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tpu)


def tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )


def test_settings_parse_dtype_strings_like_transformers_and_refuse_fsdpv1_options():
    kwargs, dtype = tpu.xla_settings(
        FsdpConfig(xla=True, xla_fsdp_settings={"compute_dtype": "bfloat16", "extra_data_axis": "data"})
    )
    assert dtype is torch.bfloat16 and kwargs == {"extra_data_axis": "data"}
    assert tpu.xla_settings(FsdpConfig(xla=True)) == ({}, torch.float32)
    for settings, message in [
        ({"compute_dtype": "bf16"}, "use a torch dtype name"),
        ({"compute_dtype": "float16"}, "XLA autocast computes in bfloat16"),
        ({"buffer_dtype": "bfloat16"}, "buffers (RoPE frequencies) stay float32"),
        ({"fp32_reduce_scatter": True}, "['fp32_reduce_scatter'], which SPMD FSDPv2 does not"),
    ]:
        with pytest.raises(
            ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
        ):
            tpu.xla_settings(FsdpConfig(xla=True, xla_fsdp_settings=settings))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["fsdp.xla_fsdp_v2=false"], "not implement"),
        (["fsdp.cpu_offload=true"], "fsdp.cpu_offload is set"),
        (["fsdp.reshard_after_forward=false"], "fsdp.reshard_after_forward is set"),
        (["fsdp.activation_checkpointing=true"], "use fsdp.xla_fsdp_grad_ckpt"),
        (["train.compile=true"], "train.compile is set"),
        (["train.sync_each_batch=true"], "train.sync_each_batch is set"),
        (["data.document_mask=true"], "data.document_mask is true"),
        (
            ["eval.interval=2", "data.eval_dataset=embedded"],
            "the XLA recipe does not evaluate during training",
        ),
        (["lora.r=4"], "the XLA recipe does not train adapters"),
        (["parallelism.cp_size=2"], "parallelism.cp_size is 2"),
        (["train.micro_batch_size=2", "train.global_batch_size=8"], "not a multiple of the 4 XLA devices"),
    ],
)
def test_keys_without_an_xla_meaning_are_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tpu.check_xla_config(load_config(DEBUG_TPU, overrides), num_devices=4)


def test_wrap_plan_follows_auto_wrap_policy_and_grad_ckpt_takes_the_layers():
    model = tiny_llama()
    wrapped, checkpointed = tpu.wrap_plan(model, FsdpConfig(), grad_ckpt=True)
    layers = set(model.model.layers)
    assert checkpointed == layers
    assert wrapped == layers | {model.model.embed_tokens, model.model.norm, model.lm_head}
    named = FsdpConfig(transformer_layer_cls_to_wrap="LlamaDecoderLayer")
    assert tpu.wrap_plan(model, named, grad_ckpt=False) == (wrapped, set())
    assert tpu.wrap_plan(model, FsdpConfig(auto_wrap_policy="NO_WRAP"), grad_ckpt=False) == (set(), set())
    by_size, _ = tpu.wrap_plan(
        model, FsdpConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=5000), False
    )
    # Bottom-up: each MLP (6,144 parameters) is a unit, then the base model gathers the rest (10,304).
    assert by_size == {layer.mlp for layer in model.model.layers} | {model.model}
    with pytest.raises(ConfigError, match="wraps no transformer layer"):
        tpu.wrap_plan(model, FsdpConfig(auto_wrap_policy="NO_WRAP"), grad_ckpt=True)
    with pytest.raises(ConfigError, match="not in this model"):
        tpu.wrap_plan(model, FsdpConfig(transformer_layer_cls_to_wrap="GPT2Block"), grad_ckpt=False)


def test_wrapped_keys_map_to_the_names_transformers_loads():
    assert (
        tpu.hf_key("_orig_module.model.layers.0._orig_module.self_attn.q_proj.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert tpu.hf_key("_orig_module.lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize(
    "script,overrides,message",
    [
        ("tpu_xla_fsdp.py", [], "torch_xla is not importable"),
        (
            "tpu_xla_fsdp.py",
            ["fsdp.xla=false"],
            "fsdp.xla is false but scripts/tpu_xla_fsdp.py is the PyTorch/XLA",
        ),
        (
            "pretrain_fsdp.py",
            [],
            "fsdp.xla is true, which is the PyTorch/XLA recipe: run scripts/tpu_xla_fsdp.py",
        ),
        (
            "pretrain_fsdp.py",
            ["fsdp.xla=false", "fsdp.xla_fsdp_grad_ckpt=true"],
            "apply only to scripts/tpu_xla_fsdp.py",
        ),
    ],
)
def test_misplaced_xla_config_is_one_line_and_exit_2(tmp_path, script, overrides, message):
    proc = run(
        script, ["--config", DEBUG_TPU, f"checkpoint.dir={tmp_path}", *overrides], nproc=0, check=False
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not os.listdir(tmp_path)


def xla_run(run_dir, *overrides: str) -> list[dict]:
    if not os.path.exists(XLA_PYTHON):
        pytest.skip(xla_unavailable())
    cmd = [
        XLA_PYTHON,
        os.path.join(REPO, "scripts", "tpu_xla_fsdp.py"),
        "--config",
        DEBUG_TPU,
        f"checkpoint.dir={run_dir}",
        *overrides,
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return xla_run(tmp_path_factory.mktemp("xla_straight"))


@pytest.mark.xla
def test_fsdpv2_on_4_devices_trains_like_one_cpu_process(straight, tmp_path):
    """The same config through pretrain_fsdp.py (one process, plain CPU torch): same init, data and
    optimizer."""
    reference = pretrain(tmp_path, "fsdp.xla=false", "checkpoint.export=false", nproc=0, config=DEBUG_TPU)
    assert event(straight, "model_ready")["devices"] == 4
    assert len(losses(straight)) == 5
    assert losses(straight) == pytest.approx(losses(reference), abs=1e-5)  # measured: 1e-6
    assert event(straight, "final")["fixed_batch_loss"] == pytest.approx(
        event(reference, "final")["fixed_batch_loss"], abs=1e-5
    )
    assert losses(straight)[-1] < losses(straight)[0] - 0.2


@pytest.mark.xla
def test_export_loads_in_plain_transformers_with_the_trained_loss(straight):
    export = event(straight, "exported")["path"]
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    cfg = load_config(DEBUG_TPU)
    from common.data.train_batches import build_batches

    cfg.data.tokenizer = export
    _, data = build_batches(cfg.data, cfg.train, 0, 1, is_main=True)
    batch = data.fixed_batch(4)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)
    assert loss.item() == pytest.approx(event(straight, "final")["fixed_batch_loss"], abs=1e-5)


@pytest.mark.xla
def test_grad_ckpt_keeps_the_losses_and_resume_continues_exactly(straight, tmp_path):
    """3 steps with xla_fsdp_grad_ckpt, stop, resume from the DCP checkpoint to 5 with a SHARDED export."""
    first = xla_run(tmp_path, "fsdp.xla_fsdp_grad_ckpt=true", "train.stop_after=3")
    assert event(first, "model_ready")["checkpointed_layers"] == 2
    assert losses(first) == pytest.approx(losses(straight)[:3], abs=1e-6)
    resumed = xla_run(tmp_path, "fsdp.xla_fsdp_grad_ckpt=true", "fsdp.state_dict_type=SHARDED_STATE_DICT")
    # the log is appended to
    assert [r["start_step"] for r in resumed if r.get("event") == "model_ready"] == [
        0,
        3,
    ]
    assert losses(resumed)[3:] == pytest.approx(losses(straight)[3:], abs=1e-6)
    # The SHARDED export is pretrain_fsdp.py's format: eval_cp.py reads it as it reads the FULL one.
    results = []
    for source in (event(straight, "exported")["path"], os.path.join(tmp_path, "export")):
        out = tmp_path / f"eval{len(results)}"
        run(
            "eval_cp.py",
            [
                "--config",
                os.path.join(REPO, "configs", "debug_eval_cp.json"),
                f"model.name_or_path={source}",
                f"checkpoint.dir={out}",
                "data.seq_len=64",
                "parallelism.cp_size=1",
                "data.embedded_max_bytes=1000000",
            ],
            nproc=0,
        )
        with open(out / "eval_results.json") as f:
            results.append(json.load(f)["eval_loss"])
    assert results[1] == pytest.approx(results[0], abs=1e-5)


@pytest.mark.xla
def test_bf16_compute_dtype_autocasts_and_exports_bf16(straight, tmp_path):
    records = xla_run(tmp_path, 'fsdp.xla_fsdp_settings={"compute_dtype": "bfloat16"}')
    difference = max(abs(a - b) for a, b in zip(losses(records), losses(straight)))
    assert 0 < difference < 1e-2  # bf16 matmuls really ran, and still train the same model
    export = event(records, "exported")["path"]
    assert AutoModelForCausalLM.from_pretrained(export, dtype="auto").lm_head.weight.dtype == torch.bfloat16
