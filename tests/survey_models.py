"""Test-only: the survey of every model type in Transformers' MODEL_FOR_CAUSAL_LM_MAPPING (docs/features.md,
"Which models"). Not part of the suite: it takes about an hour on 2 CPU cores.

    python tests/survey_models.py OUT [model_type ...]     # default: every type in the mapping
    python tests/survey_models.py --table OUT              # the table of every type surveyed into OUT

Each type, in a process of its own (a timeout, and no state carried to the next): built tiny with
Transformers' AutoModelForCausalLM.from_config (the matrix's sizes, tests/test_architectures.py; an image-text
release as AutoModelForImageTextToText, its towers small too), every bias non-zero, saved with a tokenizer of
its own (tests/launch.py:save_release); fine-tuned 2 steps on 1 rank by pretrain_fsdp.py's main() (the
start-up loss check on, the checkpoint's tokenizer by default); then its FULL export loaded by Transformers,
which must load every key and give the run's own final fixed-batch loss.
Each type ends with one outcome in OUT/<type>/result.json, and OUT/table.md counts them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
# Sizes a config checks against its layer count, at the matrix's 2 layers
SURVEY_SIZES = {"gpt_neo": dict(attention_types=[[["global", "local"], 1]]), "mamba2": dict(num_heads=8)}
# Layer patterns the configs check against (or default beyond) their 2 layers, and settings per layer type
SURVEY_SIZES |= {
    "zamba": dict(layers_block_type=["linear_attention", "hybrid"]),  # Mamba, then Mamba + shared attention
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"]),  # (layer_types is mapped too late)
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # the last layer reuses the first's KV cache; the per-layer inputs as small as the rest
    "gemma3n_text": dict(num_kv_shared_layers=1, vocab_size_per_layer_input=4096)
    | dict(hidden_size_per_layer_input=16, laurel_rank=8),
    # RoPE per layer type, none by default; the M-RoPE sections add up to half a 16-wide head
    "cohere_compass_text": dict(
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e4, mrope_section=[4, 2, 2])}
    ),
    # a sliding-window layer, then a global one; Inkling2-Loop runs the 2nd twice (an attention-residual block
    # per layer, as the loop's bounds must be multiples of it)
    "inkling2_text": dict(layer_types=["hybrid_sliding", "hybrid"]),
    "inkling2_loop_text": dict(layer_types=["hybrid_sliding", "hybrid"], n_layers_per_attn_res_block=1)
    | dict(loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8),
}
# Sizes the configs hold under other keys than the matrix's, or in sub-configs left at full size
SMALL = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128)
INKLING2 = dict(unpadded_vocab_size=4096, swa_num_attention_heads=4, swa_num_key_value_heads=2)
SURVEY_SIZES |= {
    # DbrxAttention reads rope_theta and clip_qkv from attn_config, as DBRX's checkpoints store them; the
    # experts take d_model before hidden_size is mapped onto it
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0), d_model=64)
    | dict(ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)),
    # MLA sizes on construction (its checks and RoPE fraction are computed there): a KV head per query head,
    # head_dim = nope + rope, the DSA indexer as small as a head
    "dots3_note_text": dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16)
    | dict(v_head_dim=16, head_dim=32, num_key_value_heads=4, index_head_dim=16, index_n_heads=4)
    | dict(n_routed_experts=4, shared_experts_intermediate_size=32),
    # its text config takes the top-level sizes; the towers' adapters must match them (the recipes refuse it)
    "dots3_note": dict(num_key_value_heads=4, vision_config=dict(adapter_out_dim=64))
    | dict(audio_config=dict(adapter_out_dim=64)),
    "inkling2_text": INKLING2 | SURVEY_SIZES["inkling2_text"],
    "inkling2_loop_text": INKLING2 | SURVEY_SIZES["inkling2_loop_text"],
    "xlnet": dict(d_head=16),
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=16),  # top-1 routing only
    "xlstm": dict(num_heads=4),
    "whisper": dict(num_key_value_heads=4, decoder_attention_heads=4, decoder_layers=2)
    | dict(encoder_ffn_dim=128, decoder_ffn_dim=128),
    # the entropy patcher, byte encoder and decoder, and global transformer; the patcher, encoder and decoder
    # over the matrix's vocabulary (the survey's tokenizer), not bytes
    "blt": dict(
        patcher_config=dict(SMALL, num_hidden_layers=2, vocab_size=4096),
        encoder_config=dict(SMALL, hidden_size_global=64, vocab_size=4096),
        decoder_config=dict(SMALL, hidden_size_global=64, num_hidden_layers=2, vocab_size=4096),
        global_config=dict(SMALL, num_hidden_layers=2),
        encoder_hash_byte_group_vocab=1024,
    ),
}
# Settings a forward needs: Xmod's language adapters, Reformer's causal-LM head (is_decoder, as its causal
# checkpoint ships) with axial positions over the 64-token sequence
SURVEY_SIZES |= {
    "xmod": dict(default_language="en_XX"),
    "reformer": dict(is_decoder=True, attn_layers=["local", "lsh"], attention_head_size=16)
    | dict(feed_forward_size=128, axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 48], num_buckets=4)
    | dict(local_attn_chunk_length=16, lsh_attn_chunk_length=16),
}
ATOL = 1e-5


def main() -> None:
    if sys.argv[1] == "--one":
        return survey_one(*sys.argv[2:4])
    if sys.argv[1] == "--table":  # after several surveys into one OUT (each taking part of the types)
        out = sys.argv[2]
        return write_table(out, sorted(t for t in os.listdir(out) if os.path.isdir(os.path.join(out, t))))
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out, types = sys.argv[1], sys.argv[2:] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    os.makedirs(out, exist_ok=True)
    for model_type in types:
        where = os.path.join(out, model_type)
        os.makedirs(where, exist_ok=True)
        command = [sys.executable, __file__, "--one", out, model_type]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            log, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as timeout:
            log, code = f"{timeout.stdout or ''}{timeout.stderr or ''}", None
            write_result(where, "traceback", "timed out after 600 s")
        with open(os.path.join(where, "log.txt"), "w") as f:
            f.write(log if isinstance(log, str) else log.decode(errors="replace"))
        if not os.path.exists(os.path.join(where, "result.json")):
            write_result(where, "traceback", f"the process died (exit {code}): {last_line(log)}")
        print(model_type, read_result(where), flush=True)
    write_table(out, types)


def last_line(log) -> str:
    lines = [line for line in str(log).splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def write_result(where: str, outcome: str, detail: str, **numbers) -> None:
    with open(os.path.join(where, "result.json"), "w") as f:
        json.dump({"outcome": outcome, "detail": detail, **numbers}, f)


def read_result(where: str) -> dict:
    with open(os.path.join(where, "result.json")) as f:
        return json.load(f)


def survey_one(out: str, model_type: str) -> None:
    import torch

    sys.path.insert(0, HERE)
    from arch_matrix import COMMON, load_script, observe
    from test_architectures import tiny_image_text_config

    from common.architectures import auto_class, check_causal_lm, is_image_text
    from common.config import ConfigError
    from launch import plant_trained_biases, read_metrics, save_release

    where = os.path.join(out, model_type)
    checkpoint, run_dir = os.path.join(where, "checkpoint"), os.path.join(where, "run")
    try:
        torch.manual_seed(0)
        config = survey_config(model_type)
        if is_image_text(config) and "text_config" in config.sub_configs:  # its towers small too (not GIT's)
            config = tiny_image_text_config(model_type)
        try:
            check_causal_lm(config)  # before any weight (other configs are judged as their class saves them)
        except ConfigError as error:
            if "multimodal" in str(error):
                return write_result(where, "one line", str(error))
        model = auto_class(config).from_config(config, dtype=torch.float32)
        plant_trained_biases(model)
        with torch.no_grad():  # Transformers' own forward runs at these sizes
            model.eval()(
                input_ids=torch.arange(3, 11)[None], labels=torch.arange(3, 11)[None], use_cache=False
            )
        save_release(model, checkpoint)
    except Exception as error:
        return write_result(where, "not built tiny by Transformers", one_line(error))
    script = load_script("pretrain_fsdp")
    observe(script, run_dir)
    config = os.path.join(os.path.dirname(HERE), "configs", "debug_tiny.json")
    try:
        script.main(
            ["--config", config, f"model.name_or_path={checkpoint}", *COMMON, f"checkpoint.dir={run_dir}"]
        )
    except ConfigError as error:
        return write_result(where, "one line", str(error))
    except SystemExit as stop:
        return write_result(where, "one line", str(stop.code))
    except Exception as error:
        return write_result(where, "traceback", f"{one_line(error)} ({where_raised(error)})")
    records = read_metrics(run_dir)
    ready = next(r for r in records if r.get("event") == "model_ready")
    trained = next(r for r in records if r.get("event") == "final")["fixed_batch_loss"]
    export = os.path.join(run_dir, "export")
    reloaded, info = auto_class(model.config).from_pretrained(
        export, dtype=torch.float32, output_loading_info=True
    )
    reloaded.eval()
    batch = torch.load(os.path.join(run_dir, "fixed.pt"))["batch"]
    labels = batch["labels"]
    with torch.no_grad():
        logits = reloaded(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
    theirs = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))
    numbers = dict(loss_at_start=ready.get("loss_at_start"), trained=trained, export_in_transformers=theirs)
    unloaded = sorted(info["missing_keys"]) + sorted(info["unexpected_keys"])
    if unloaded:
        return write_result(
            where, "silently wrong", f"the export's keys do not load: {unloaded[:4]}", **numbers
        )
    if abs(theirs - trained) > ATOL * max(1.0, abs(trained)):
        return write_result(
            where, "silently wrong", f"export {theirs:.6f} vs trained {trained:.6f}", **numbers
        )
    write_result(where, "exact", "", **numbers)


def survey_config(model_type: str):
    """The type's config at the matrix's sizes, SURVEY_SIZES's overrides and the MLA/EXPERTS sizes."""
    from test_architectures import EXPERTS, MLA, PER_ARCH, tiny_config

    PER_ARCH.update(SURVEY_SIZES)
    config = tiny_config(model_type)

    def stored(key: str) -> bool:  # not a size the config computes itself (xLSTM's v_head_dim, a property)
        return hasattr(config, key) and not isinstance(getattr(type(config), key, None), property)

    # MLA configs set head_dim to the RoPE part on construction, for their rotary embedding: kept so below
    rope_head = (
        hasattr(config, "qk_rope_head_dim") and getattr(config, "head_dim", None) == config.qk_rope_head_dim
    )
    # DeepSeek-like latent attention and routing at the matrix's sizes, where the config has them
    config.update({k: v for k, v in {**MLA, **EXPERTS}.items() if stored(k)})
    if hasattr(config, "kv_lora_rank"):  # a KV head per query head
        config.num_key_value_heads = config.num_attention_heads
    if stored("qk_head_dim"):  # stored, not computed, in MiniCPM3's and LongCat's configs
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if rope_head:
        config.head_dim = config.qk_rope_head_dim
    return config


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:240] if text else ''}"


def where_raised(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/scripts/" in f.filename or "/common/" in f.filename]
    frame = (ours or frames)[-1]
    return f"{os.path.relpath(frame.filename, os.path.dirname(HERE))}:{frame.lineno}"


def write_table(out: str, types: list[str]) -> None:
    """OUT/table.md: the types per outcome, then what each type that is not exact ends with."""
    rows = [(t, read_result(os.path.join(out, t))) for t in types]
    outcomes: dict[str, list[str]] = {}
    for model_type, result in rows:
        outcomes.setdefault(result["outcome"], []).append(model_type)
    lines = ["| outcome | types | model types |", "|---|---|---|"]
    for outcome, names in sorted(outcomes.items(), key=lambda item: -len(item[1])):
        lines.append(f"| {outcome} | {len(names)} | {', '.join(f'`{n}`' for n in names)} |")
    lines += ["", "| model type | outcome | what it ends with |", "|---|---|---|"]
    for model_type, result in rows:
        if result["outcome"] != "exact":
            detail = result["detail"].replace("|", "/").replace("\n", " ")[:240]
            lines.append(f"| `{model_type}` | {result['outcome']} | {detail} |")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
