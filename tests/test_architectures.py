"""Every decoder architecture in the matrix trains as exactly Transformers' model: after sharding and loading,
every parameter and buffer is `from_pretrained`'s; the training loss, evaluate(), eval_cp.py, the start-up
check and the fixed-batch loss are Transformers' own forward loss on the same tokens; LoRA trains on the same
base; both exports load back with the trained loss. Tiny random checkpoints are made here (no downloads), as
releases ship them: every bias non-zero (Phi, GPT-J and CodeGen train one on the output layer), a tokenizer
of their own, the logit transforms switched on at realistic values. One launch per world size runs every
architecture (tests/arch_matrix.py)."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch
import transformers
from image_releases import WITH_PROCESSOR, add_processor, processor_without_torchvision, write_shape_records
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto import image_processing_auto

import launch
from common import image_text
from common.architectures import auto_class
from common.checkpoint_layout import checkpoint_layout
from common.config import ConfigError, ModelConfig
from common.model import build_meta_model, load_model_config, materialise
from launch import (
    WHOLE_LOAD,
    each_rank,
    estimate,
    event,
    plant_trained_biases,
    read_metrics,
    run_command,
    save_release,
    torchrun,
)

DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite"]
DENSE += ["smollm3", "starcoder2", "gpt_neox", "cohere2", "glm4", "phi", "falcon", "gptj", "codegen"]
# gpt_oss: attention sinks; qwen3_next: linear attention; deepseek_v3, glm4_moe: no auxiliary loss
MOE = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss", "granitemoe", "qwen3_next"]
MOE += ["deepseek_v3", "glm4_moe"]
SIZES = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
SIZES |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
SIZES |= dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# MoE: 4 experts, 2 per token; Qwen2-MoE's shared expert as small as the rest
SIZES |= dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
SIZES |= dict(shared_expert_intermediate_size=32)
# The logit transforms at the values of real checkpoints (Gemma 2/3: 30; Granite 3 8B: 16; Command R7B)
TRANSFORMS = {
    "gemma2": dict(final_logit_softcapping=30.0),
    "gemma3_text": dict(final_logit_softcapping=30.0),
    "granite": dict(logits_scaling=16.0),
    "cohere2": dict(logit_scale=0.25),
}
# DeepSeek's multi-head latent attention (the RoPE part as wide as a head, a KV head per query head); experts
# routed in one group, one shared, the first layer dense
MLA = dict(qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16)
EXPERTS = dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
PER_ARCH = {**TRANSFORMS, "deepseek_v3": {**MLA, **EXPERTS, "num_key_value_heads": 4}, "glm4_moe": EXPERTS}
PER_ARCH |= {"gptj": dict(rotary_dim=8), "codegen": dict(rotary_dim=8)}  # RoPE on half of a 16-wide head
# Image-text releases: a vision tower, a projector and a language model, with the processor's image settings
IMAGE_TEXT_MOE = ["qwen3_5_moe", "qwen3_vl_moe"]  # finetune_moe_ep_fsdp.py, as MoE text models are
IMAGE_TEXT = ["qwen3_5", "gemma3", "gemma4", "mistral3", "qwen3_vl", *IMAGE_TEXT_MOE]
# Layers of two kinds, one of each: Qwen3.5's linear and full attention (3:1 in its releases), Gemma 4's
# sliding and full (5:1), with its per-layer embeddings
TEXT = {arch: dict(layer_types=["linear_attention", "full_attention"]) for arch in ("qwen3_5", "qwen3_5_moe")}
TEXT["gemma4"] = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=32)
TEXT["gemma4"] |= dict(vocab_size_per_layer_input=4096, hidden_size_per_layer_input=16)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, depth=2)
VISION |= dict(num_heads=2, patch_size=4, image_size=16, out_hidden_size=64)
VISION |= dict(deepstack_visual_indexes=[0])  # Qwen3-VL's: a tower layer's features into the language model's
# Gemma 4's tower: its own head sizes, position table and pooling
VISION |= dict(num_key_value_heads=2, head_dim=16, position_embedding_size=64, pooling_kernel_size=2)
TIED = {"qwen2", "gemma2", "gemma3_text", "phi3"}  # tied input and output embeddings, as their families ship
ATOL = 1e-5


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    """Each architecture's checkpoint, and the recipes' records on 1 and 2 ranks."""
    root = tmp_path_factory.mktemp("architectures")
    checkpoints = root / "checkpoints"
    for arch in DENSE + MOE + IMAGE_TEXT:
        torch.manual_seed(0)
        config = tiny_image_text_config(arch) if arch in IMAGE_TEXT else tiny_config(arch)
        if arch in WITH_PROCESSOR:  # its tokenizer with image tokens, and its processor
            add_processor(arch, config, checkpoints / arch)
        model = auto_class(config).from_config(config, dtype=torch.float32)
        plant_trained_biases(model)
        if arch in WITH_PROCESSOR:
            model.save_pretrained(checkpoints / arch)
        else:
            save_release(model, checkpoints / arch)
        if arch in IMAGE_TEXT and arch not in WITH_PROCESSOR:  # the image processor (PIL's: no torchvision)
            # Qwen3-VL-MoE ships Qwen3-VL's image processor
            names = image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES[arch.replace("vl_moe", "vl")]
            getattr(transformers, names["pil"])().save_pretrained(checkpoints / arch)
    write_shape_records(root / "shapes", 16)  # image-text records for the releases with a processor
    write_shape_records(root / "shapes", 4, "held_out.jsonl", split="test")
    driver = os.path.join(os.path.dirname(__file__), "arch_matrix.py")
    logs = []
    for nproc in (1, 2):
        args = [str(root / f"ranks{nproc}"), str(checkpoints), *DENSE, *MOE, *IMAGE_TEXT]
        logs.append(run_command([*torchrun(nproc), driver, *args], timeout=900).stderr)
    return {"root": root, "checkpoints": checkpoints, "stderr": "\n".join(logs)}


def tiny_config(arch: str):
    """The architecture at the sizes above, with its logit transform on; a size the config computes itself
    (Falcon's head_dim) is left to it."""
    computed = type(AutoConfig.for_model(arch))
    sizes = {k: v for k, v in SIZES.items() if not isinstance(getattr(computed, k, None), property)}
    config = AutoConfig.for_model(arch, **{**sizes, **PER_ARCH.get(arch, {})})
    config.tie_word_embeddings = arch in TIED
    return config


def tiny_image_text_config(arch: str):
    """An image-text release at the text sizes above, with a small vision tower (Gemma 4's is off by default,
    and its audio tower left off). Gemma 4's sizes vary per layer, so its config is asked by its keys."""
    default = AutoConfig.for_model(arch)
    text = {
        k: v
        for k, v in SIZES.items()
        if k in default.text_config.to_dict() or hasattr(default.text_config, k)
    }
    vision_default = default.vision_config or AutoConfig.for_model(f"{arch}_vision")
    vision = {k: v for k, v in VISION.items() if hasattr(vision_default, k)}
    other = {"audio_config": None} if hasattr(default, "audio_config") else {}
    return AutoConfig.for_model(arch, text_config=text | TEXT.get(arch, {}), vision_config=vision, **other)


def reference(matrix: dict, arch: str, path: str | None = None):
    source = path or str(matrix["checkpoints"] / arch)
    return auto_class(AutoConfig.from_pretrained(source)).from_pretrained(source, dtype=torch.float32)


@torch.no_grad()
def hf_loss(model, batches: list[dict], pad_id: int | None = None) -> float:
    """Transformers' own loss (its loss_function, mean over target tokens) on pre-shifted labels,
    token-weighted over the batches. Image-text batches (`pad_id` given) go in as the processor makes them for
    TRL's collator: its attention mask and its image inputs, and the model's own positions."""
    total, tokens = 0.0, 0
    for batch in batches:
        count = int((batch["labels"] != -100).sum())
        if not count:
            continue
        if pad_id is None:
            inputs = {"position_ids": batch["position_ids"]}
        else:
            inputs = {"attention_mask": (batch["input_ids"] != pad_id).long(), **batch["images"]}
        out = model(
            input_ids=batch["input_ids"],
            **inputs,
            labels=batch["labels"].contiguous(),
            shift_labels=batch["labels"].contiguous(),
            use_cache=False,  # with a cache, Transformers does not detect packed examples by position ids
        )
        total, tokens = total + float(out.loss) * count, tokens + count
    return total / tokens


def per_image(images: dict) -> list[torch.Tensor]:
    """A batch's pixel values, image by image: Gemma 3's are [images, 3, H, W]; Qwen-VL's are every image's
    patches in one [patches, dim] tensor, split by each image's grid."""
    pixels = images["pixel_values"]
    if "image_grid_thw" in images:
        return list(pixels.split(images["image_grid_thw"].prod(-1).tolist()))
    return list(pixels)


def records(matrix: dict, nproc: int, arch: str, run: str, name: str) -> list[dict]:
    return [
        torch.load(p) for p in sorted(glob.glob(str(matrix["root"] / f"ranks{nproc}" / arch / run / name)))
    ]


def run_dir(matrix: dict, nproc: int, arch: str, run: str):
    return matrix["root"] / f"ranks{nproc}" / arch / run


def assert_is_transformers_model(ready: dict, model) -> None:
    """Every parameter and every buffer (persistent or not) bit for bit."""
    expected = dict(model.named_parameters())
    parameters = {k.replace(".base_layer", ""): v for k, v in ready["parameters"].items() if "lora_" not in k}
    assert parameters.keys() == expected.keys()
    for name, tensor in parameters.items():
        assert torch.equal(tensor, expected[name]), name
    buffers = dict(model.named_buffers())
    assert ready["buffers"].keys() == buffers.keys()
    for name, tensor in ready["buffers"].items():
        assert tensor.dtype == buffers[name].dtype and torch.equal(tensor, buffers[name]), name


@pytest.mark.parametrize("arch", DENSE + MOE + IMAGE_TEXT)
def test_the_recipes_train_transformers_model_exactly(matrix, arch):
    model = reference(matrix, arch)
    runs = ["full"] if arch in MOE + IMAGE_TEXT_MOE else ["full", "lora"]
    for nproc in (1, 2):
        for run in runs:
            where = f"{arch} {run} on {nproc} rank(s)"
            [ready] = records(matrix, nproc, arch, run, "ready.pt")
            assert_is_transformers_model(ready, model)
            # The training loss at step 1 (the loss path with gradients), over every rank's micro-batches
            step1 = records(matrix, nproc, arch, run, "step1-rank*.pt")
            batches = [b for r in step1 for b in r["batches"]]
            assert step1[0]["result"]["loss"] == pytest.approx(hf_loss(model, batches), abs=ATOL), where
            # evaluate() at step 0 on the held-out rows
            evals = records(matrix, nproc, arch, run, "eval-rank*.pt")
            held_out = [b for r in evals for b in r["batches"]]
            expected = hf_loss(model, held_out)
            assert evals[0]["result"]["eval_loss"] == pytest.approx(expected, abs=ATOL), where
            if arch in MOE + IMAGE_TEXT_MOE:
                continue
            # The fixed-batch loss (the no-gradient path) and evaluate() on that batch
            [fixed] = records(matrix, nproc, arch, run, "fixed.pt")
            tokens = int((fixed["batch"]["labels"] != -100).sum())
            fixed_loss = hf_loss(model, [fixed["batch"]])
            assert fixed["loss_sum"] / tokens == pytest.approx(fixed_loss, abs=ATOL), where
            assert fixed["evaluate"]["eval_loss"] == pytest.approx(fixed_loss, abs=ATOL), where
            # The start-up check compared the recipe's losses with Transformers' own on the same rows
            checked = event(read_metrics(run_dir(matrix, nproc, arch, run)), "model_ready")["loss_at_start"]
            assert checked["transformers"] == pytest.approx(fixed_loss, abs=ATOL), where
            assert checked["train"] == checked["eval"] == pytest.approx(fixed_loss, abs=ATOL), where
        # 1 rank = 2 ranks
        for run in runs:
            one, two = (read_metrics(run_dir(matrix, n, arch, run)) for n in (1, 2))
            assert [r["loss"] for r in one if "step" in r and "loss" in r] == pytest.approx(
                [r["loss"] for r in two if "step" in r and "loss" in r], abs=ATOL
            )


def test_each_rank_reads_its_share_of_every_release_and_export(matrix):
    """No release of the matrix, and none of its exports, is loaded whole through from_pretrained (each rank
    holding the whole model): GPT-NeoX's renamed output layer and Qwen3-VL-MoE's fused experts included."""
    fallback = re.search(rf"[^\n]*{WHOLE_LOAD}", matrix["stderr"])
    assert fallback is None, fallback.group()


def test_experts_stored_in_another_layout_are_loaded_whole_as_transformers_transposes_them(tmp_path):
    """Qwen3-VL-MoE's fused experts in the model's layout are read per rank as they are; in the transposed
    layout, the release goes to from_pretrained, which transposes them."""
    torch.manual_seed(0)
    config = tiny_image_text_config("qwen3_vl_moe")
    auto_class(config).from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    model = build_meta_model(config, ModelConfig())
    ours = dict(model.state_dict())
    key = "model.language_model.layers.0.mlp.experts.down_proj"
    assert checkpoint_layout(model, str(tmp_path), ours).names[key] == key
    weights = load_file(tmp_path / "model.safetensors")
    weights |= {
        k: w.transpose(1, 2).contiguous() for k, w in weights.items() if k.endswith("experts.down_proj")
    }
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert (
        checkpoint_layout(model, str(tmp_path), ours).why_not == f"Transformers converts {key!r} as it loads"
    )


@pytest.mark.parametrize("arch", DENSE + MOE + IMAGE_TEXT)
def test_the_exports_load_back_with_the_trained_loss(matrix, arch):
    """The FULL export in Transformers, and eval_cp.py on it; LoRA's in PEFT."""
    full_dir = run_dir(matrix, 2, arch, "full")
    trained = reference(matrix, arch, str(full_dir / "export"))
    evals = records(matrix, 2, arch, "eval_cp", "eval-rank*.pt")
    held_out = [b for r in evals for b in r["batches"]]
    assert evals[0]["result"]["eval_loss"] == pytest.approx(hf_loss(trained, held_out), abs=ATOL)
    if arch in MOE + IMAGE_TEXT_MOE:
        return
    [fixed] = records(matrix, 2, arch, "full", "fixed.pt")
    final = event(read_metrics(full_dir), "final")
    assert final["fixed_batch_loss"] == pytest.approx(hf_loss(trained, [fixed["batch"]]), abs=ATOL)
    lora_dir = run_dir(matrix, 2, arch, "lora")
    adapted = PeftModel.from_pretrained(reference(matrix, arch), str(lora_dir / "export"))
    final = event(read_metrics(lora_dir), "final")
    assert final["fixed_batch_loss"] == pytest.approx(hf_loss(adapted, [fixed["batch"]]), abs=ATOL)


@pytest.mark.parametrize("arch", IMAGE_TEXT)
def test_an_image_text_release_trains_its_language_model_and_exports_the_whole_release(matrix, arch):
    """On text, the vision tower and projector stay frozen (no optimizer state) and come out bit for bit; the
    FULL export has the release's class, file names and image processor; LoRA leaves them without adapters."""
    release, full_dir = matrix["checkpoints"] / arch, run_dir(matrix, 2, arch, "full")
    before, after = reference(matrix, arch), reference(matrix, arch, str(full_dir / "export"))
    tower, projector = image_text.vision_parameters(before)
    assert tower and projector
    trained, exported = dict(before.named_parameters()), dict(after.named_parameters())
    for name in tower + projector:
        assert torch.equal(exported[name], trained[name]), name
    language = [name for name in trained if name not in tower + projector]
    assert all(not torch.equal(exported[name], trained[name]) for name in language if "norm" not in name)
    assert type(after) is type(before)
    assert safetensors_keys(full_dir / "export") == safetensors_keys(release)
    shipped = [name for name in image_text.PROCESSOR_FILES if (release / name).exists()]
    assert "preprocessor_config.json" in shipped or "processor_config.json" in shipped
    for name in shipped:
        assert (full_dir / "export" / name).read_bytes() == (release / name).read_bytes(), name
    # AdamW's two fp32 moments for the language model's parameters only, over both ranks
    metrics = read_metrics(full_dir)
    frozen = sum(trained[name].numel() for name in tower + projector)
    assert event(metrics, "model_ready")["trainable_params"] == before.num_parameters() - frozen
    states = event(metrics, "final")["state_bytes_per_rank"]
    assert sum(s["optimizer_bytes"] for s in states) == 8 * (before.num_parameters() - frozen)
    # A checkpoint holds only what trains: converting it is one line, not a release without its vision tower
    step2, converted = full_dir / "checkpoints" / "step-2", full_dir.parent / "converted"
    proc = launch.run("convert_to_hf.py", [str(step2), str(converted)], nproc=0, check=False)
    assert proc.returncode == 2 and "a run's checkpoint holds only the weights that train" in proc.stderr
    assert "Traceback" not in proc.stderr and not converted.exists()
    if arch not in IMAGE_TEXT_MOE:  # the MoE recipe trains no adapters
        with open(run_dir(matrix, 2, arch, "lora") / "export" / "adapter_config.json") as f:
            excluded = set(json.load(f)["exclude_modules"])
        assert excluded and excluded <= {name.rsplit(".", 1)[0] for name in tower + projector}


@pytest.mark.parametrize("arch", WITH_PROCESSOR)
def test_an_image_text_release_fine_tunes_on_image_records_exactly(matrix, arch):
    """TRL's records with images, rendered by the release's processor, one example per row: on 1 and 2 ranks,
    with the vision side frozen, trained and with LoRA, the training loss at step 1, evaluate(), the fixed
    batch and the start-up check are Transformers' own loss on the processed batches; the answers alone are
    trained; the vision side gets gradients only where the keys say."""
    model = reference(matrix, arch)
    tokenizer = transformers.AutoTokenizer.from_pretrained(matrix["checkpoints"] / arch)
    loss_of = lambda batches: hf_loss(model, batches, tokenizer.pad_token_id)  # noqa: E731
    tower, projector = image_text.vision_parameters(model)
    for run in ("images", "images_vision", "images_lora"):
        for nproc in (1, 2):
            where = f"{arch} {run} on {nproc} rank(s)"
            [ready] = records(matrix, nproc, arch, run, "ready.pt")
            assert_is_transformers_model(ready, model)
            step1 = records(matrix, nproc, arch, run, "step1-rank*.pt")
            batches = [b for r in step1 for b in r["batches"]]
            assert all(len(per_image(b["images"])) == len(b["input_ids"]) for b in batches), where
            assert step1[0]["result"]["loss"] == pytest.approx(loss_of(batches), abs=ATOL), where
            evals = records(matrix, nproc, arch, run, "eval-rank*.pt")
            held_out = [b for r in evals for b in r["batches"]]
            assert evals[0]["result"]["eval_loss"] == pytest.approx(loss_of(held_out), abs=ATOL), where
            [fixed] = records(matrix, nproc, arch, run, "fixed.pt")
            fixed_loss = loss_of([fixed["batch"]])
            tokens = int((fixed["batch"]["labels"] != -100).sum())
            assert fixed["loss_sum"] / tokens == pytest.approx(fixed_loss, abs=ATOL), where
            checked = event(read_metrics(run_dir(matrix, nproc, arch, run)), "model_ready")["loss_at_start"]
            assert checked["transformers"] == pytest.approx(fixed_loss, abs=ATOL), where
            assert checked["train"] == checked["eval"] == pytest.approx(fixed_loss, abs=ATOL), where
        one, two = (read_metrics(run_dir(matrix, n, arch, run)) for n in (1, 2))
        assert [r["loss"] for r in one if "step" in r and "loss" in r] == pytest.approx(
            [r["loss"] for r in two if "step" in r and "loss" in r], abs=ATOL
        )
        # The answer is the only target: "a red circle" and the end of the turn, never the image or question
        for batch in batches:
            for labels in batch["labels"]:
                answer = tokenizer.decode(labels[labels != -100])
                assert answer.startswith("a ") and answer.endswith("<|eos|>") and len(answer.split()) == 3
        trained = set(records(matrix, 2, arch, run, "step1-rank*.pt")[0]["grad_norms"])
        vision = {n for n in trained for v in tower + projector if n.replace(".base_layer", "") == v}
        if run == "images":
            assert not vision and trained, "a frozen vision side got gradients"
        elif run == "images_vision":  # all but what the release's forward leaves unused (SigLIP's head)
            assert set(projector) <= vision and {n for n in tower if ".head." not in n} == vision - set(
                projector
            )
        else:  # LoRA with the tower unfrozen: adapters in the vision tower, none in the frozen projector
            lora_tower = {n.split(".lora_")[0] for n in trained if "lora_" in n}
            assert any(n.startswith(tuple(t.rsplit(".", 2)[0] for t in tower)) for n in lora_tower)


@pytest.mark.parametrize("arch", WITH_PROCESSOR)
def test_streamed_image_records_train_exactly_on_each_ranks_part_of_the_stream(matrix, arch):
    """data.streaming=true on image-text records: the step-1 loss is Transformers' own on the batches the
    ranks streamed; on 2 ranks, rank r's images are records r, r + 2, ... of the 1-rank run's, in order."""
    model = reference(matrix, arch)
    pad_id = transformers.AutoTokenizer.from_pretrained(matrix["checkpoints"] / arch).pad_token_id
    images = {}
    for nproc in (1, 2):
        step1 = records(matrix, nproc, arch, "images_stream", "step1-rank*.pt")
        batches = [b for r in step1 for b in r["batches"]]
        assert step1[0]["result"]["loss"] == pytest.approx(hf_loss(model, batches, pad_id), abs=ATOL), nproc
        images[nproc] = [[image for b in r["batches"] for image in per_image(b["images"])] for r in step1]
    [alone] = images[1]
    assert len(alone) == 8 and len({image.sum().item() for image in alone}) == 8  # 8 different images
    for rank, mine in enumerate(images[2]):
        assert len(mine) == 4 and all(map(torch.equal, mine, alone[rank::2]))


@pytest.mark.parametrize("arch", WITH_PROCESSOR)
def test_an_image_text_export_reloads_with_its_processor_and_answers_an_image(matrix, arch):
    """Trained on images: the FULL export loads in AutoModelForImageTextToText and AutoProcessor and
    generates from an image and a prompt; what stayed frozen comes out bit for bit and what trained
    changed; PEFT loads the LoRA export on the release with the trained loss."""
    from PIL import Image

    release = reference(matrix, arch)
    tower, projector = image_text.vision_parameters(release)
    weights = dict(release.named_parameters())
    for run in ("images", "images_vision"):
        export = run_dir(matrix, 2, arch, run) / "export"
        changed = records(matrix, 2, arch, run, "step1-rank*.pt")[0]["grad_norms"]  # what trained
        trained = transformers.AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
        exported = dict(trained.named_parameters())
        for name in tower + projector:
            assert torch.equal(exported[name], weights[name]) == (name not in changed), name
        [fixed] = records(matrix, 2, arch, run, "fixed.pt")
        final = event(read_metrics(run_dir(matrix, 2, arch, run)), "final")
        pad_id = transformers.AutoTokenizer.from_pretrained(export).pad_token_id
        assert final["fixed_batch_loss"] == pytest.approx(
            hf_loss(trained, [fixed["batch"]], pad_id), abs=ATOL
        )
        with processor_without_torchvision():
            processor = transformers.AutoProcessor.from_pretrained(export)
        question = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        image = Image.new("RGB", (16, 16), (220, 30, 30))
        inputs = processor(text=[prompt], images=[[image]], return_tensors="pt")
        # 4 tokens whatever it learned: trained on 3-word answers, a release may end its turn sooner
        generated = trained.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert generated.shape[1] == inputs["input_ids"].shape[1] + 4
    lora_dir = run_dir(matrix, 2, arch, "images_lora")
    adapted = PeftModel.from_pretrained(release, str(lora_dir / "export"))
    [fixed] = records(matrix, 2, arch, "images_lora", "fixed.pt")
    final = event(read_metrics(lora_dir), "final")
    pad_id = transformers.AutoTokenizer.from_pretrained(matrix["checkpoints"] / arch).pad_token_id
    assert final["fixed_batch_loss"] == pytest.approx(hf_loss(adapted, [fixed["batch"]], pad_id), abs=ATOL)


def test_an_image_text_release_trains_under_cp_hsdp_and_tp_or_says_why_not(matrix, tmp_path):
    """The start-up check holds each layout's training loss to the release class's own before step 1 (under
    CP, over every cp rank's positions). Mistral 3's TP plan names its tied output layer, which Transformers
    cannot shard: one line on every rank."""
    tiny = os.path.join(launch.REPO, "configs", "debug_tiny.json")
    common = ["--config", tiny, "model.config={}", "data.dataset=arithmetic", "data.seq_len=64"]
    common += ["train.steps=1", "checkpoint.export=false"]
    hsdp = ("parallelism.dp_replicate_size=2", "parallelism.dp_shard_size=1")
    source = matrix["checkpoints"] / "qwen3_vl"
    for i, layout in enumerate([("parallelism.cp_size=2",), ("parallelism.tp_size=2",), hsdp]):
        args = [*common, f"model.name_or_path={source}", f"checkpoint.dir={tmp_path / str(i)}", *layout]
        launch.run("pretrain_fsdp.py", args, nproc=2)
        checked = event(read_metrics(tmp_path / str(i)), "model_ready")["loss_at_start"]
        assert checked["train"] == pytest.approx(checked["transformers"], abs=ATOL), layout
    # HSDP again, resumed from its step-1 checkpoint (which holds no frozen weight): the vision tower comes
    # from the release, and the SHARDED export converts to the whole release
    sharded = ("fsdp.state_dict_type=SHARDED_STATE_DICT", "checkpoint.export=true", "train.steps=2")
    args = [*common, f"model.name_or_path={source}", f"checkpoint.dir={tmp_path / '2'}", *hsdp, *sharded]
    launch.run("pretrain_fsdp.py", args, nproc=2)
    assert [r for r in read_metrics(tmp_path / "2") if r.get("event") == "model_ready"][-1]["resumed_from"]
    launch.run("convert_to_hf.py", [str(tmp_path / "2" / "export"), str(tmp_path / "hf")], nproc=0)
    release, converted = reference(matrix, "qwen3_vl"), reference(matrix, "qwen3_vl", str(tmp_path / "hf"))
    assert safetensors_keys(tmp_path / "hf") == safetensors_keys(source)
    tower, projector = image_text.vision_parameters(release)
    frozen, kept = dict(release.named_parameters()), dict(converted.named_parameters())
    assert all(torch.equal(kept[name], frozen[name]) for name in tower + projector)
    source = matrix["checkpoints"] / "mistral3"
    args = [
        *common,
        f"model.name_or_path={source}",
        f"checkpoint.dir={tmp_path / 'tp'}",
        "parallelism.tp_size=2",
    ]
    for rank, (code, stderr) in enumerate(each_rank("pretrain_fsdp.py", args)):
        lines = [line for line in stderr.splitlines() if "config error" in line]
        assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
        assert lines[0].startswith(f"[rank{rank}] config error: parallelism.tp_size is 2 but Transformers")
        assert "cannot apply the TP plan of model_type 'mistral3'" in lines[0]


def test_the_planner_plans_an_image_text_releases_text_rows_and_refuses_images_it_cannot_size(matrix):
    """Text rows never run the vision blocks' forward (the planner's patch of torch's tracker for such
    units); rank 0's state is checked against its count. Qwen-VL sizes each image's tokens by its grid,
    which fake tensors cannot hold: one line. Gemma 3's image rows: test_estimate_memory.py."""
    tiny = os.path.join(launch.REPO, "configs", "debug_tiny.json")
    source = matrix["checkpoints"] / "qwen3_vl"
    args = ["--config", tiny, "--world-size", "2", f"model.name_or_path={source}", "model.config={}"]
    report = launch.estimate(tiny, 2, *args[4:], quick=True)
    assert report["images_per_row"] == 0 and report["peak_gib_per_rank"] > 0
    assert report["state_bytes_per_rank"][0]["optimizer_bytes"] > 0
    proc = launch.run("estimate_memory.py", [*args, "--images-per-row", "1"], nproc=0, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (
        "--images-per-row is 1 but model_type 'qwen3_vl' sizes each image's tokens by the image"
        in proc.stderr
    )


LANGUAGE = ("model.language_model.", "lm_head.")


@pytest.mark.parametrize("arch", IMAGE_TEXT)
def test_the_vision_tower_and_projector_train_only_where_the_keys_say(arch):
    """model.freeze_vision_tower and model.freeze_multi_modal_projector, each alone: the language model and
    its output layer always train, and every other parameter is the tower's or the projector's."""
    config = tiny_image_text_config(arch)
    for tower_frozen, projector_frozen in [(True, True), (False, True), (True, False), (False, False)]:
        keys = ModelConfig(freeze_vision_tower=tower_frozen, freeze_multi_modal_projector=projector_frozen)
        model = build_meta_model(config, keys)
        trains = {name for name, p in model.named_parameters() if p.requires_grad}
        tower, projector = image_text.vision_parameters(model)
        assert tower and projector and not set(tower) & set(projector)
        assert set(tower).isdisjoint(trains) == tower_frozen, arch
        assert set(projector).isdisjoint(trains) == projector_frozen, arch
        language = {name for name, _ in model.named_parameters()} - set(tower) - set(projector)
        assert language <= trains and all(name.startswith(LANGUAGE) for name in language), arch


def safetensors_keys(directory) -> set[str]:
    keys = set()
    for path in glob.glob(str(directory / "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            keys |= set(f.keys())
    return keys


@pytest.mark.parametrize("arch", DENSE + [a for a in IMAGE_TEXT if a not in IMAGE_TEXT_MOE])
def test_lora_trains_on_the_same_base_and_every_adapter_gets_a_gradient(matrix, arch):
    """lora_B starts at zero: step 0's held-out loss is full fine-tuning's, and every lora_B gets a gradient
    at step 1 (every lora_A's is zero there, by the same zero)."""
    for nproc in (1, 2):
        full, lora = (read_metrics(run_dir(matrix, nproc, arch, run)) for run in ("full", "lora"))
        step0 = [
            next(r["eval_loss"] for r in m if r.get("event") == "eval" and r["step"] == 0)
            for m in (full, lora)
        ]
        assert step0[0] == step0[1]
        [step1] = records(matrix, nproc, arch, "lora", "step1-rank0.pt")
        norms = step1["grad_norms"]
        assert norms and all("lora_" in name for name in norms)
        lora_b = {name: norm for name, norm in norms.items() if "lora_B" in name}
        assert len(lora_b) == len(norms) // 2 and all(norm > 0 for norm in lora_b.values()), lora_b


def test_a_release_whose_own_forward_fails_on_text_is_one_line_on_every_rank(tmp_path):
    """Llama 4's image-text class in Transformers 5.24 reads image outputs its language model never returns,
    so the start-up check's first forward fails on every rank, in one line before step 1."""
    with open(os.path.join(launch.REPO, "configs", "debug_tiny.json")) as f:
        run = json.load(f)
    run["model"]["config"] = {"model_type": "llama4", **tiny_image_text_config("llama4").to_diff_dict()}
    (tmp_path / "llama4.json").write_text(json.dumps(run))
    args = ["--config", str(tmp_path / "llama4.json"), f"checkpoint.dir={tmp_path / 'run'}"]
    for rank, (code, stderr) in enumerate(each_rank("pretrain_fsdp.py", args)):
        lines = [line for line in stderr.splitlines() if "config error" in line]
        assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
        assert lines[0].startswith(f"[rank{rank}] config error: model_type 'llama4': its own forward in")
    assert not os.path.exists(tmp_path / "run" / "export")


def test_image_records_where_they_do_not_train_yet_are_one_line_on_every_rank(matrix, tmp_path):
    """Image records under CP or TP, in the MoE recipe or eval_cp.py, or given to a text model: one line
    naming the key and what to change, on every rank, before any work."""
    shapes = matrix["root"] / "shapes"
    release, text = matrix["checkpoints"] / "gemma3", matrix["checkpoints"] / "llama"
    tiny = os.path.join(launch.REPO, "configs", "debug_tiny.json")
    images = [
        "--config",
        tiny,
        "model.config={}",
        f"data.dataset={shapes / 'train.jsonl'}",
        "data.seq_len=64",
    ]
    cases = [
        ("pretrain_fsdp.py", [f"model.name_or_path={release}", "parallelism.cp_size=2"], "cp_size 2"),
        ("pretrain_fsdp.py", [f"model.name_or_path={release}", "parallelism.tp_size=2"], "tp_size 2"),
        ("finetune_moe_ep_fsdp.py", [f"model.name_or_path={release}"], "finetune_moe_ep_fsdp.py trains"),
        ("eval_cp.py", [f"model.name_or_path={release}"], "eval_cp.py scores text only"),
        ("pretrain_fsdp.py", [f"model.name_or_path={text}"], "no image processor"),
    ]
    for script, args, says in cases:
        run = tmp_path / script / says.replace(" ", "_")
        results = each_rank(script, [*images, *args, f"checkpoint.dir={run}"])
        for rank, (code, stderr) in enumerate(results):
            lines = [line for line in stderr.splitlines() if "config error" in line]
            assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, (script, says, stderr[-2000:])
            assert lines[0].startswith(f"[rank{rank}] config error: data.") and says in lines[0], lines[0]
        assert not (run / "export").exists()


def test_attention_follows_the_model_and_a_bad_value_is_one_line(tmp_path):
    """Unset: Transformers' choice (Gemma 2's soft-capped attention: eager). A value the model cannot use, and
    CP on a model whose attention SDPA cannot compute, are one line before any work."""
    gemma2 = ModelConfig(config={"model_type": "gemma2", **SIZES})
    model = build_meta_model(load_model_config(gemma2), gemma2)
    assert model.config._attn_implementation == "eager"
    llama = ModelConfig(config={"model_type": "llama", **SIZES})
    assert build_meta_model(load_model_config(llama), llama).config._attn_implementation == "sdpa"
    gemma2.attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match="'sdpa', which Gemma2ForCausalLM cannot use.*supports eager"):
        build_meta_model(load_model_config(gemma2), gemma2)
    config = tmp_path / "gemma2_cp.json"
    # full attention only: sliding windows are refused under CP for a reason of their own
    layers = {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2}
    config.write_text(json.dumps({"model": {"config": {**gemma2.config, **layers}}}))
    args = ["--config", str(config), "parallelism.cp_size=2"]
    for rank, (code, stderr) in enumerate(each_rank("pretrain_fsdp.py", args)):
        lines = [line for line in stderr.splitlines() if "config error" in line]
        assert code == 2 and len(lines) == 1, stderr[-2000:]
        assert lines[0].startswith(f"[rank{rank}] ") and "Gemma2ForCausalLM does not support sdpa" in lines[0]


@pytest.mark.parametrize(
    "model_type, says",
    [
        ("t5", "'t5' is an encoder-decoder model"),
        ("vit", "'vit' has no causal-LM head in Transformers"),
        ("bert", r"'bert' is an encoder \(its config's is_decoder is false\)"),
        ("roberta", "'roberta' is an encoder"),
        ("fuyu", r"'fuyu' is a multimodal model \(an image-text model in Transformers\).*'persimmon'"),
    ],
)
def test_models_the_recipes_do_not_train_are_refused_naming_what_is_missing(model_type, says):
    with pytest.raises(ConfigError, match=says):
        load_model_config(ModelConfig(config={"model_type": model_type}))


@pytest.mark.parametrize("model_type", ["dbrx", "mpt"])
def test_text_models_with_sub_configs_are_not_called_multimodal(model_type):
    """DBRX's and MPT's attn_config (and DBRX's ffn_config) are parts of a text model."""
    assert load_model_config(ModelConfig(config={"model_type": model_type})).model_type == model_type


def test_the_planner_plans_full_logits_for_a_model_that_transforms_them(tmp_path):
    """Granite divides its logits after the head: the planner runs the same check as training, so its peak
    is that of full logits whatever train.loss_chunk_tokens says, above chunked Llama at equal sizes."""
    peaks = {}
    for arch in ("llama", "granite"):
        config = tmp_path / f"{arch}.json"
        model = {k: v for k, v in SIZES.items() if "expert" not in k}
        run = {"model": {"config": {"model_type": arch, **model}}, "data": {"seq_len": 64}, "train": {}}
        config.write_text(json.dumps(run))
        for chunk in (32, 0):
            planned = estimate(str(config), 2, f"train.loss_chunk_tokens={chunk}", quick=True)
            peaks[arch, chunk] = planned["peak_gib_per_rank"]
    assert peaks["granite", 32] == peaks["granite", 0]
    assert peaks["llama", 32] < peaks["llama", 0] <= peaks["granite", 0]


@pytest.mark.parametrize("arch", ["gemma3_text", "gemma2", "phi3"])
def test_a_model_from_scratch_gets_the_buffers_its_construction_computes(arch):
    """model.config with a model_type: materialise gives every buffer (Gemma's embedding
    scale, per-layer-type RoPE frequencies) exactly as building the model for real does."""
    cfg = ModelConfig(config={"model_type": arch, **SIZES})
    hf_config = load_model_config(cfg)
    model = build_meta_model(hf_config, cfg)
    materialise(model, torch.device("cpu"))
    expected = dict(AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).named_buffers())
    buffers = dict(model.named_buffers())
    assert buffers.keys() == expected.keys() and len(buffers) >= 2
    for name, tensor in buffers.items():
        assert torch.equal(tensor, expected[name]), name
