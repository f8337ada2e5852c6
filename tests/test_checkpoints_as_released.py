"""Exact on the checkpoints users download: trained biases, quantized weights, the checkpoint's own tokenizer,
stray files beside the weights, dtypes Transformers keeps. Before step 1 every run proves that its training
and evaluation losses are Transformers' own (common/ops/loss_check.py, train.verify_loss_at_start): each cause
it must catch is planted from the outside (tests/with_planted.py). Tiny checkpoints are made here, as releases
ship them (tests/launch.py: save_release)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from common.checkpoint_layout import checkpoint_layout
from common.config import ConfigError, DataConfig, ModelConfig
from common.data.checks import check_vocab_size
from common.load_weights import base_weights
from common.model import load_model_config
from common.ops.cli import checkpoint_tokenizer
from common.quantized import dequantizing
from launch import (
    REPO,
    WHOLE_LOAD,
    anonymous_rises,
    event,
    host_memory_env,
    plant_trained_biases,
    pretrain,
    read_metrics,
    run,
    save_hf_llama,
    save_release,
    steps,
)

SFT = os.path.join(REPO, "configs", "debug_sft.json")
SIZES = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
SIZES |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
SIZES |= dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
PER_ARCH = {"granite": dict(logits_scaling=16.0), "gpt2": dict(n_embd=64, n_layer=2, n_head=4)}
PER_ARCH["deepseek_v3"] = dict(
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16,
    n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    num_experts_per_tok=2, moe_intermediate_size=32, num_key_value_heads=4,
)  # fmt: skip
BLOCK = 32  # FP8 blocks of 32 x 32 (releases: 128 x 128) on 64-wide layers


def release(path, arch: str, **extra) -> str:
    """A tiny random release of `arch`: every bias non-zero, a tokenizer of its own."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **{**SIZES, **PER_ARCH.get(arch, {}), **extra})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plant_trained_biases(model)
    return save_release(model, path)


def quantize_fp8(path) -> None:
    """The release's projection weights as DeepSeek-V3 and Qwen3-FP8 ship them: F8_E4M3 values and an fp32
    `weight_scale_inv` per block, with quantization_config in config.json."""
    weights, out = load_file(os.path.join(path, "model.safetensors")), {}
    for key, weight in weights.items():
        if not key.endswith("proj.weight"):
            out[key] = weight
            continue
        rows, cols = weight.shape
        blocks = weight.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
        quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
        out[key], out[f"{key}_scale_inv"] = quantized, scale
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", weight_block_size=[BLOCK, BLOCK])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("releases")
    made = {arch: release(root / arch, arch) for arch in ("phi", "granite", "llama", "qwen3")}
    made["gpt2"] = release(root / "gpt2", "gpt2", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    made["fp8"] = release(root / "fp8", "qwen3")
    quantize_fp8(made["fp8"])
    return made


def finetune(run_dir, checkpoint: str, *overrides: str, nproc: int = 0, plant: str | None = None, **kwargs):
    args = [
        "--config",
        SFT,
        f"model.name_or_path={checkpoint}",
        "model.config={}",
        f"checkpoint.dir={run_dir}",
    ]
    args += ["train.steps=1", "checkpoint.load_best_model_at_end=false", *overrides]
    return run(
        "pretrain_fsdp.py",
        args,
        nproc=nproc,
        check=False,
        wrapper="with_planted.py" if plant else None,
        extra_env={"FSDP2_RECIPES_PLANT": plant} if plant else None,
        **kwargs,
    )


def first_loss(run_dir) -> float:
    return steps(read_metrics(run_dir))[0]["loss"]


@pytest.mark.parametrize(
    "plant, arch",
    [("bias", "phi"), ("transform", "granite"), ("inplace", "llama")],
)
def test_a_chunked_loss_that_is_not_the_models_gives_way_to_full_logits(tmp_path, releases, plant, arch):
    """The check sees each cause, says so in one line, and trains the model's own loss; without the check
    (train.verify_loss_at_start=false) the same plant trains another loss."""
    checked = finetune(tmp_path / "checked", releases[arch], plant=plant, timeout=300)
    assert checked.returncode == 0, checked.stderr[-3000:]
    lines = [line for line in checked.stderr.splitlines() if "which the chunked loss cannot" in line]
    assert len(lines) == 1 and "where its own is" in lines[0], checked.stderr[-3000:]
    numbers = event(read_metrics(tmp_path / "checked"), "model_ready")["loss_at_start"]
    assert numbers["train"] == pytest.approx(numbers["transformers"], rel=1e-5)
    assert numbers["eval"] == pytest.approx(numbers["transformers"], rel=1e-5)
    unchecked = finetune(
        tmp_path / "unchecked", releases[arch], "train.verify_loss_at_start=false", plant=plant
    )
    if plant == "transform":  # the chunked loss meets the transformed result and stops: never silently wrong
        assert unchecked.returncode != 0 and "changed its output layer's result" in unchecked.stderr
    else:
        assert unchecked.returncode == 0, unchecked.stderr[-3000:]
        assert "loss check skipped: train.verify_loss_at_start is false" in unchecked.stderr
        assert abs(first_loss(tmp_path / "unchecked") - first_loss(tmp_path / "checked")) > 1e-3


def test_a_loss_that_is_not_cross_entropy_over_the_logits_stops_before_step_1(tmp_path, releases):
    proc = finetune(tmp_path / "run", releases["llama"], plant="loss_function")
    lines = [line for line in proc.stderr.strip().splitlines() if "config error" in line]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "LlamaForCausalLM's train loss is" in lines[0] and "with full logits too" in lines[0]
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # stopped before the model_ready line


def test_a_forward_that_is_not_deterministic_is_named_as_such(tmp_path, releases):
    """Reformer's LSH attention draws new random rotations on every forward: the check says that, not that
    the loss is another one."""
    proc = finetune(tmp_path / "run", releases["llama"], plant="random")
    lines = [line for line in proc.stderr.strip().splitlines() if "config error" in line]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "LlamaForCausalLM's forward is not deterministic in eval mode" in lines[0]


def test_phi_trains_its_output_layer_bias_and_exports_the_loss_transformers_computes(tmp_path, releases):
    """Phi's head has a bias (so do GPT-J's and CodeGen's, in the architecture matrix): the chunked loss
    takes it, it trains, and the export gives the run's loss in Transformers, on 2 ranks. GPT-2 with dropout:
    the fixed-batch loss is taken in eval mode, as Transformers' reference is."""
    done = finetune(tmp_path / "phi", releases["phi"], "train.steps=2", nproc=2, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before = AutoModelForCausalLM.from_pretrained(releases["phi"], dtype=torch.float32)
    for arch in ("phi", "gpt2"):
        if arch == "gpt2":
            done = finetune(tmp_path / "gpt2", releases["gpt2"], "train.steps=2", timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
        export = str(tmp_path / arch / "export")
        trained = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        assert transformers_fixed_loss(trained, tmp_path / arch) == pytest.approx(
            event(read_metrics(tmp_path / arch), "final")["fixed_batch_loss"], abs=1e-5
        ), arch
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "phi" / "export"), dtype=torch.float32)
    assert not torch.equal(trained.lm_head.bias, before.lm_head.bias)


def transformers_fixed_loss(model, run_dir) -> float:
    """Transformers' loss on the run's fixed batch, rebuilt from its config as the recipe builds it."""
    from common.config import TrainConfig
    from common.data.train_batches import build_batches

    with open(os.path.join(run_dir, "run_config.json")) as f:
        config = json.load(f)
    data, train = DataConfig(**config["data"]), TrainConfig(**config["train"])
    _, batches = build_batches(data, train, 0, 1, True)
    batch = batches.fixed_batch(train.micro_batch_size)
    labels = batch.labels.contiguous()
    with torch.no_grad():
        inputs = dict(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        out = model(**inputs, labels=labels, shift_labels=labels)  # no cache: packed rows by position ids
    return float(out.loss)


def test_an_fp8_release_is_dequantized_bit_for_bit_as_transformers_does_and_exports_plain(tmp_path, releases):
    """Block-quantized FP8 on 2 ranks, each reading its share of the blocks and their scales: the weights
    are Transformers' own dequantization bit for bit, the start-up check passes, and the export is a plain
    fp32 model without quantization_config that Transformers loads."""
    done = finetune(tmp_path / "run", releases["fp8"], "train.steps=0", nproc=2, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert WHOLE_LOAD not in done.stderr, done.stderr[-3000:]  # each rank read its share
    expected = AutoModelForCausalLM.from_pretrained(releases["fp8"], dtype=torch.float32).state_dict()
    export = str(tmp_path / "run" / "export")
    with open(os.path.join(export, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    exported = load_file(os.path.join(export, "model.safetensors"))
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[key], expected[key]) for key in expected)
    assert exported["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32
    assert "loss_at_start" in event(read_metrics(tmp_path / "run"), "model_ready")


def test_an_fp8_release_raises_no_ranks_memory_past_its_share_and_one_tensor(tmp_path):
    """About 100M parameters in FP8 on 2 ranks: loading raises each rank's anonymous memory by its share of
    the fp32 weights, plus at most the largest tensor (its scales spread over its elements) and 16 MiB."""
    source = save_hf_llama(tmp_path / "fp8", hidden_size=1024, intermediate_size=4096)
    quantize_fp8(source)
    share_mib, largest_mib = 100e6 * 4 / 2 / 2**20, 4096 * 1024 * 4 / 2**20
    out = tmp_path / "mem"
    overrides = [
        "train.steps=0",
        "checkpoint.export=false",
        f"model.name_or_path={source}",
        "model.config={}",
    ]
    pretrain(tmp_path / "run", *overrides, extra_env=host_memory_env(out), wrapper="with_host_memory.py")
    for rise in anonymous_rises(out, "load"):
        assert share_mib * 0.9 < rise <= share_mib + largest_mib + 16, rise


def test_a_whole_load_of_an_fp8_release_asks_transformers_to_dequantize(releases):
    """Loaded whole (a model whose keys Transformers converts otherwise), an FP8 release is dequantized on a
    GPU too, where from_pretrained would otherwise keep FP8 layers: the same weights here, on CPU."""
    asked = dequantizing(releases["fp8"])["quantization_config"]
    assert asked.dequantize and list(asked.weight_block_size) == [BLOCK, BLOCK]
    assert dequantizing(releases["llama"]) == {}
    plain = AutoModelForCausalLM.from_pretrained(releases["fp8"], dtype=torch.float32).state_dict()
    whole = AutoModelForCausalLM.from_pretrained(
        releases["fp8"], dtype=torch.float32, **dequantizing(releases["fp8"])
    )
    assert all(torch.equal(tensor, plain[name]) for name, tensor in whole.state_dict().items())


def test_an_fp8_moe_release_is_dequantized_per_expert_bit_for_bit(tmp_path):
    """FP8 experts (Qwen3-30B-A3B-FP8's layout: an F8_E4M3 weight and block scales per expert) on 2 ranks at
    ep 2: each rank reads and dequantizes its own experts only, and the model is Transformers' own
    dequantization bit for bit (compared through from_pretrained, which fuses the experts)."""
    source = release(
        tmp_path / "fp8_moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    quantize_fp8(source)
    args = ["--config", os.path.join(REPO, "configs", "debug_moe.json"), f"model.name_or_path={source}"]
    args += ["model.config={}", f"checkpoint.dir={tmp_path / 'run'}", "train.steps=0", "eval.interval=0"]
    ep = run("finetune_moe_ep_fsdp.py", [*args, "parallelism.ep_size=2"], nproc=2)
    assert WHOLE_LOAD not in ep.stderr, ep.stderr[-3000:]  # each rank read its own experts
    expected = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "export", dtype=torch.float32).state_dict()
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[key], expected[key]) for key in expected)


def quantize_mxfp4(path) -> None:
    """The release's experts as gpt-oss ships them: per expert and output column, FP4 pairs in uint8
    `_blocks` and one E8M0 exponent per 32 inputs in `_scales` (random: any bytes are valid MXFP4)."""
    weights, out = load_file(os.path.join(path, "model.safetensors")), {}
    generator = torch.Generator().manual_seed(1)
    for key, weight in weights.items():
        if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[key] = weight
            continue
        experts, rows, cols = weight.shape  # [experts, in, out]
        blocks = (experts, cols, rows // 32, 16)
        out[f"{key}_blocks"] = torch.randint(0, 256, blocks, generator=generator, dtype=torch.uint8)
        out[f"{key}_scales"] = torch.randint(122, 130, blocks[:3], generator=generator, dtype=torch.uint8)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(quant_method="mxfp4", modules_to_not_convert=["lm_head"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_an_mxfp4_release_is_dequantized_per_expert_bit_for_bit(tmp_path):
    """gpt-oss's MXFP4 experts, on 2 ranks: sharded by FSDP in pretrain_fsdp.py and at ep 2 in
    finetune_moe_ep_fsdp.py, each rank dequantizes its own experts only; both models are Transformers' own
    dequantization bit for bit, the start-up check passes, and the export is plain."""
    source = release(tmp_path / "mxfp4", "gpt_oss", num_local_experts=4, num_experts_per_tok=2)
    quantize_mxfp4(source)
    expected = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **dequantizing(source))
    expected = expected.state_dict()
    dense = finetune(tmp_path / "dense", source, "train.steps=0", nproc=2, timeout=300)
    assert dense.returncode == 0, dense.stderr[-3000:]
    assert "loss_at_start" in event(read_metrics(tmp_path / "dense"), "model_ready")
    args = ["--config", os.path.join(REPO, "configs", "debug_moe.json"), f"model.name_or_path={source}"]
    args += ["model.config={}", f"checkpoint.dir={tmp_path / 'ep'}", "train.steps=0", "eval.interval=0"]
    ep = run("finetune_moe_ep_fsdp.py", [*args, "parallelism.ep_size=2"], nproc=2)
    for done in (dense, ep):  # per rank, not from_pretrained's whole load (exact too)
        assert WHOLE_LOAD not in done.stderr, done.stderr[-3000:]
    for export in (tmp_path / "dense" / "export", tmp_path / "ep" / "export"):
        with open(export / "config.json") as f:
            assert "quantization_config" not in json.load(f)
        ours = load_file(export / "model.safetensors")
        assert ours.keys() == expected.keys()
        assert all(torch.equal(ours[key], expected[key]) for key in expected)


def test_an_fp8_moe_release_raises_no_ranks_memory_past_its_share_and_one_fused_weight(tmp_path):
    """A 54M-parameter Qwen3-MoE in FP8 at ep 2 on 2 ranks: each rank reads and dequantizes its own experts,
    one at a time, and its anonymous memory rises by its fp32 share plus at most one fused expert weight (the
    converter's) and 16 MiB."""
    torch.manual_seed(0)
    sizes = dict(SIZES, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    config = AutoConfig.for_model(
        "qwen3_moe",
        **sizes | dict(head_dim=64, moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2),
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    numel, fused = model.num_parameters(), model.model.layers[0].mlp.experts.gate_up_proj.numel()
    source = save_release(model, tmp_path / "fp8_moe")
    quantize_fp8(source)
    share_mib, fused_mib, out = numel * 4 / 2 / 2**20, fused * 4 / 2**20, tmp_path / "mem"
    args = ["--config", os.path.join(REPO, "configs", "debug_moe.json"), f"model.name_or_path={source}"]
    args += ["model.config={}", f"checkpoint.dir={tmp_path / 'run'}", "train.steps=0", "eval.interval=0"]
    args += ["parallelism.ep_size=2", "checkpoint.export=false"]
    run(
        "finetune_moe_ep_fsdp.py",
        args,
        nproc=2,
        extra_env=host_memory_env(out),
        wrapper="with_host_memory.py",
    )
    for rise in anonymous_rises(out, "load"):
        assert share_mib * 0.9 < rise <= share_mib + fused_mib + 16, rise


@pytest.mark.parametrize(
    "quantization, says",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"is quantized \(bitsandbytes\)"),
        ({"quant_method": "gptq", "bits": 4}, r"is quantized \(gptq\)"),
        ({"quant_method": "awq", "bits": 4}, r"is quantized \(awq\)"),
        ({"quant_method": "compressed-tensors"}, r"is quantized \(compressed-tensors\)"),
        ({"quant_method": "fp8", "fmt": "e4m3"}, r"is quantized \(per-tensor FP8\)"),
    ],
)
def test_other_quantized_releases_are_one_line_with_what_to_do(tmp_path, quantization, says):
    config = AutoConfig.for_model("llama", **SIZES)
    config.quantization_config = quantization
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=f"{says}.*dequantize it with Transformers first"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path)))


def test_the_files_are_the_ones_the_index_names_and_a_stray_key_is_one_line(tmp_path, releases):
    """Mistral's releases ship consolidated.safetensors beside the indexed shards: it is not read. A key that
    the model does not use, and that Transformers would not drop either, is one line naming it."""
    model = AutoModelForCausalLM.from_pretrained(releases["llama"], dtype=torch.float32)
    save_release(model, tmp_path / "sharded", max_shard_size="200KB")
    save_file(
        {"layers.0.attention.wq.weight": torch.zeros(4, 4)}, tmp_path / "sharded" / "consolidated.safetensors"
    )
    layout = checkpoint_layout(model, str(tmp_path / "sharded"), base_weights(model))
    assert layout.why_not is None and len(layout.files) > 1
    assert not any("consolidated" in file for file in layout.files)
    weights = load_file(os.path.join(releases["llama"], "model.safetensors"))
    weights["model.layers.0.mlp.extra_scale"] = torch.ones(4)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match="holds 'model.layers.0.mlp.extra_scale', which LlamaForCausalLM does"
    ):
        checkpoint_layout(model, str(tmp_path), base_weights(model))
    weights.pop("model.layers.0.mlp.extra_scale")
    weights["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(4, 4)  # a scale on fp32 weights
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="up_proj.weight .F32. has block scales"):
        checkpoint_layout(model, str(tmp_path), base_weights(model))


def test_the_tokenizer_is_the_checkpoints_own_by_default(tmp_path, releases):
    """data.tokenizer unset: the checkpoint's own tokenizer; the embedded one only for a model made from
    model.config; a checkpoint without a tokenizer is one line. Ids past the model's vocabulary, also
    where added tokens leave a gap, are one line."""
    assert (
        checkpoint_tokenizer(DataConfig(), ModelConfig(name_or_path=releases["llama"])) == releases["llama"]
    )
    assert checkpoint_tokenizer(DataConfig(tokenizer="other"), ModelConfig(name_or_path="x")) == "other"
    assert checkpoint_tokenizer(DataConfig(), ModelConfig(config={"vocab_size": 64})) is None
    AutoConfig.for_model("llama", **SIZES).save_pretrained(tmp_path / "bare")
    with pytest.raises(ConfigError, match="holds no tokenizer .* set data.tokenizer"):
        checkpoint_tokenizer(DataConfig(), ModelConfig(name_or_path=str(tmp_path / "bare")))
    gap = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "<tool>": 5000}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=gap)
    assert len(tokenizer) == 3
    with pytest.raises(ConfigError, match="ids reach 5000 but the model's vocab_size is 4096"):
        check_vocab_size(tokenizer, 4096)
    done = finetune(tmp_path / "run", releases["qwen3"], "train.steps=0", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"config: data.tokenizer is model.name_or_path's own ({releases['qwen3']})" in done.stdout
    with open(tmp_path / "run" / "export" / "tokenizer.json") as f:
        assert len(json.load(f)["model"]["vocab"]) == 1024  # the release's, not the embedded 4,096


def test_the_export_keeps_deepseek_v3s_fp32_modules_as_transformers_saves_them(tmp_path):
    """A bf16 export of DeepSeek-V3 keeps its router weights and e_score_correction_bias in fp32
    (_keep_in_fp32_modules_strict): the bytes are Transformers' own save_pretrained of the model loaded in
    bf16."""
    source = release(tmp_path / "deepseek_v3", "deepseek_v3")
    args = ["--config", os.path.join(REPO, "configs", "debug_moe.json"), f"model.name_or_path={source}"]
    args += ["model.config={}", f"checkpoint.dir={tmp_path / 'run'}", "train.steps=0", "eval.interval=0"]
    run("finetune_moe_ep_fsdp.py", [*args, "checkpoint.export_dtype=bfloat16"], nproc=0)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    reference.save_pretrained(tmp_path / "reference")
    ours = load_file(tmp_path / "run" / "export" / "model.safetensors")
    assert ours["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert ours["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert ours["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    with (
        open(tmp_path / "reference" / "model.safetensors", "rb") as a,
        open(tmp_path / "run" / "export" / "model.safetensors", "rb") as b,
    ):
        assert a.read() == b.read()


def test_the_export_keeps_the_releases_names_also_after_a_resume(tmp_path):
    """save_pretrained reverts only the renames its load used: DeepSeek-V4's release names its embedding
    model.embed_tokens, which the export keeps (not the original format's model.embed, which Transformers
    would re-initialise), also in a run that resumed and never loaded the release."""
    source = release(tmp_path / "deepseek_v4", "deepseek_v4", q_lora_rank=16, qk_rope_head_dim=16)
    released = set(load_file(os.path.join(source, "model.safetensors")))
    run_dir = tmp_path / "run"
    for last in (1, 2):  # the second run resumes from the first one's checkpoint at step 1
        assert finetune(run_dir, source, f"train.steps={last}").returncode == 0
        assert set(load_file(run_dir / "export" / "model.safetensors")) == released
    assert any(r.get("resumed_from") for r in read_metrics(run_dir) if r.get("event") == "model_ready")


def test_under_cp_the_check_runs_with_the_cp_attention_and_sees_a_planted_bias(tmp_path, releases):
    """Each cp rank runs both losses on its positions of the probe's rows, with the CP attention: the
    planted head bias is seen there too, and the run trains Transformers' loss."""
    proc = finetune(tmp_path / "run", releases["phi"], "parallelism.cp_size=2", nproc=2, plant="bias")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum("which the chunked loss cannot" in line for line in proc.stderr.splitlines()) == 1
    numbers = event(read_metrics(tmp_path / "run"), "model_ready")["loss_at_start"]
    assert numbers["train"] == pytest.approx(numbers["transformers"], rel=1e-5)
    assert numbers["eval"] == pytest.approx(numbers["transformers"], rel=1e-5)


def test_weights_a_release_stores_joined_export_joined_again(tmp_path):
    """Sarvam-MoE stores q, k and v as one query_key_value, which Transformers splits as it loads (the model
    then loads whole): on 2 ranks the export joins the trained q, k and v back, and Transformers gives the
    run's own final loss on it (the export once wrote one of them over the others)."""
    experts = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32)
    experts |= dict(first_k_dense_replace=1, n_group=1, topk_group=1, shared_expert_intermediate_size=32)
    source = release(tmp_path / "sarvam_moe", "sarvam_moe", **experts)
    done = finetune(tmp_path / "run", source, "train.steps=2", nproc=2, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "export", dtype=torch.float32).eval()
    assert transformers_fixed_loss(trained, tmp_path / "run") == pytest.approx(
        event(read_metrics(tmp_path / "run"), "final")["fixed_batch_loss"], abs=1e-5
    )
