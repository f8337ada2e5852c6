"""Every key acts or errors (docs/config.md: nothing is silently ignored). For each script and each key of
every config section, at a value other than its default, the table below says what happens, and the test
checks it:

- `Refused`: one line (a ConfigError naming the key) before any process group exists;
- `Acts`: a run differs from the same run at the default in what it writes (a metric, a file, a count) or in
  the model it builds; `context` names the keys it acts with (lora.alpha with lora.r > 0);
- `Named`: eval_cp.py evaluates a training run's config as it is, so a key only training reads is named in
  its one "do nothing" line;
- `ProvenBy`: a test elsewhere shows the effect with what one process here cannot do (several ranks, a
  killed rank, torch.compile, the XLA environment); it must exist and run, and it must give the key to a
  recipe it launches (or build the key's section with it, in-process): tests/keys_given.py, a plugin
  conftest.py registers, fails that test where it does not.

A key added without an entry fails `test_the_table_covers_every_key_of_every_section`. Each run is a recipe's
own main() on one process; all of them run in one subprocess (tests/every_key_runner.py), so one import of
torch and Transformers serves them all: about three minutes on 2 cores. The XLA recipe's runs go through the
same runner in the PyTorch/XLA environment, on XLA's CPU runtime with 4 devices, at the same time.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.config import Config  # noqa: E402
from launch import REPO, TINY, XLA_PYTHON, env, save_release, write_short_documents, xla_unavailable  # noqa: E402

MOE = os.path.join(REPO, "configs", "debug_moe.json")
EVAL = os.path.join(REPO, "configs", "debug_eval_cp.json")
TPU = os.path.join(REPO, "configs", "debug_tpu.json")
# Each script's base run: small, one process, with an export (eval_cp.py evaluates pretrain's).
BASE = {
    "pretrain_fsdp": [TINY, "train.steps=2"],
    "finetune_moe_ep_fsdp": [MOE, "train.steps=2", "eval.interval=2", "eval.max_sequences=8"],
    "eval_cp": [EVAL, "model.name_or_path={pretrain_export}", "parallelism.cp_size=1", "data.seq_len=64"],
    "tpu_xla_fsdp": [TPU, "train.steps=2"],
}
BASE["eval_cp"] += ["eval.max_sequences=4", "eval.loss_chunk_tokens=32"]


@dataclass(frozen=True)
class Refused:
    value: str  # or several key=value words
    context: tuple = ()


@dataclass(frozen=True)
class Acts:
    value: str | tuple
    probe: Callable[[dict, dict], bool]  # (the run at the default, the run with the value) -> it differs
    context: tuple = ()


@dataclass(frozen=True)
class Named:
    value: str | tuple


@dataclass(frozen=True)
class ProvenBy:
    test: str  # tests/test_x.py::test_name
    # The recipe that test runs, where it is not the table's own: the key goes through the same shared call
    # (init_distributed's timeout, load_hf_weights' broadcast, StopRules, the profiler), shown once.
    on: str | None = None


# What a run wrote, for the probes.
def steps(r: dict) -> list[dict]:
    return [x for x in r["records"] if "step" in x and "event" not in x]


def losses(r: dict) -> list[float]:
    return [x["loss"] for x in steps(r)]


def event(r: dict, name: str) -> dict:
    return next((x for x in r["records"] if x.get("event") == name), {})


def events(r: dict, name: str) -> list[dict]:
    return [x for x in r["records"] if x.get("event") == name]


def column(name: str) -> Callable[[dict], list]:
    return lambda r: [x.get(name) for x in steps(r)]


def differs(read: Callable[[dict], object]) -> Callable[[dict, dict], bool]:
    """The probe: what `read` takes from a run differs between the two runs (and the run succeeded)."""
    return lambda base, run: not run["error"] and read(base) != read(run)


def ready(field: str) -> Callable[[dict], object]:
    return lambda r: event(r, "model_ready").get(field)


def layout(field: str) -> Callable[[dict], object]:
    return lambda r: r["layout"].get(field)


def files(r: dict) -> list[str]:
    return r["files"]


def fails(base: dict, run: dict) -> bool:  # the default fails where the value runs (data.text_field)
    return bool(base["error"]) and not run["error"]


def exported_dtype(r: dict) -> str | None:
    with open(os.path.join(r["dir"], "export", "config.json")) as f:
        return json.load(f).get("dtype")


def result(field: str) -> Callable[[dict], object]:
    return lambda r: (r["results"] or {}).get(field)


LOSSES, TOKENS, LR = differs(losses), differs(column("tokens")), differs(column("lr"))
EVAL_RUNS = ("data.eval_dataset=embedded", "eval.interval=1", "eval.max_sequences=4")
LORA = ("lora.r=4",)
AC = ("fsdp.activation_checkpointing=true",)
SIZE_BASED = ("fsdp.auto_wrap_policy=SIZE_BASED_WRAP",)

# Keys whose effect needs what one process here cannot give; the tests that show it.
MULTI_RANK = {
    "parallelism.dp_replicate_size": ProvenBy(
        "tests/test_tp.py::test_tensor_parallel_layouts_equal_one_process"
    ),
    "parallelism.dp_shard_size": ProvenBy("tests/test_tp.py::test_tensor_parallel_layouts_equal_one_process"),
    "parallelism.tp_size": ProvenBy("tests/test_tp.py::test_tensor_parallel_layouts_equal_one_process"),
    "parallelism.timeout_minutes": ProvenBy(
        "tests/test_checkpoint.py::test_a_hung_rank_ends_the_job_within_the_collective_timeout",
        on="pretrain_fsdp",
    ),
}


PRETRAIN = {
    "model.name_or_path": Acts(("{pretrain_export}", "model.config={}"), differs(lambda r: losses(r)[:1])),
    "model.config": Acts("model.config.num_hidden_layers=1", differs(ready("params"))),
    "model.attn_implementation": Acts("eager", differs(layout("attn"))),
    "model.trust_remote_code": Acts("true", fails, ("model.name_or_path={remote_code}", "model.config={}")),
    "model.freeze_vision_tower": Refused("false"),  # a text model; image-text: test_architectures.py
    "model.freeze_multi_modal_projector": Refused("false"),
    "data.dataset": Acts("{documents}", LOSSES),
    "data.eval_dataset": Acts("embedded", differs(lambda r: len(events(r, "eval"))), EVAL_RUNS[1:]),
    "data.eval_split": Refused("validation"),  # a hub dataset's; the corpus and local files have one split
    "data.dataset_config": Refused("default"),
    "data.split": Refused("test"),
    "data.text_field": Acts("body", fails, ("data.dataset={body}",)),
    "data.streaming": Acts("true", LOSSES, ("data.dataset={documents}",)),
    "data.pack": Acts("false", TOKENS),
    "data.document_mask": Acts("true", LOSSES, ("data.dataset={documents}",)),
    "data.tokenizer": Acts("{tokenizer}", LOSSES),
    "data.seq_len": Acts("32", TOKENS),
    "data.embedded_max_bytes": Acts("800000", LOSSES),
    "data.embedded_vocab_size": Acts("2048", LOSSES),
    "data.cache_dir": Acts("{cache}", differs(lambda r: r["watched"])),
    "train.steps": Acts("3", differs(lambda r: len(steps(r)))),
    "train.global_batch_size": Acts("4", TOKENS),
    "train.micro_batch_size": Acts("4", differs(layout("forwards"))),
    "train.lr": Acts("0.01", LR),
    "train.min_lr_ratio": Acts("0.5", LR, ("train.steps=4",)),
    "train.warmup_steps": Acts("0", LR),
    "train.lr_schedule": Acts("wsd", LR, ("train.steps=6",)),
    "train.wsd_decay_ratio": Acts("0.5", LR, ("train.steps=6", "train.lr_schedule=wsd")),
    "train.weight_decay": Acts("0.5", LOSSES),
    "train.betas": Acts("[0.5, 0.6]", LOSSES, ("train.steps=3",)),
    "train.eps": Acts("0.001", LOSSES),
    "train.max_grad_norm": Acts("0.01", LOSSES, ("train.steps=3",)),
    "train.seed": Acts("1", LOSSES),
    "train.gradient_checkpointing": Acts("true", differs(layout("gradient_checkpointing"))),
    "train.compile": ProvenBy("tests/test_fsdp_keys.py::test_per_layer_compile_matches_eager"),
    "train.loss_chunk_tokens": ProvenBy(
        "tests/test_loss.py::test_the_chunked_head_takes_the_logits_out_of_the_peak"
    ),
    "train.sync_each_batch": ProvenBy(  # one rank reduce-scatters nothing
        "tests/test_fsdp_keys.py::test_gradients_are_reduce_scattered_once_per_step_unless_sync_each_batch"
    ),
    "train.verify_loss_at_start": Acts("false", differs(ready("loss_at_start"))),
    "train.device": Refused("cuda"),
    "train.stop_after": Acts("1", differs(lambda r: event(r, "stopped").get("step"))),
    "train.router_aux_loss_coef": Refused("0.01"),
    "fsdp.version": Refused("1"),
    "fsdp.reshard_after_forward": Acts("false", differs(ready("units_kept_after_forward"))),
    "fsdp.cpu_offload": Acts("true", differs(layout("offload"))),
    "fsdp.auto_wrap_policy": Acts("NO_WRAP", differs(ready("fsdp_units"))),
    "fsdp.transformer_layer_cls_to_wrap": Acts(
        '["LlamaMLP", "LlamaAttention"]', differs(ready("fsdp_units"))
    ),
    "fsdp.min_num_params": Acts("100000", differs(ready("fsdp_units")), SIZE_BASED),
    "fsdp.state_dict_type": Acts(
        "SHARDED_STATE_DICT", differs(lambda r: [f for f in files(r) if "export" in f])
    ),
    "fsdp.cpu_ram_efficient_loading": ProvenBy(
        "tests/test_export.py::test_a_checkpoint_loaded_through_from_pretrained_is_read_by_rank0_alone_with_cpu_ram_efficient_loading",
        on="finetune_moe_ep_fsdp",
    ),
    "fsdp.activation_checkpointing": Acts("true", differs(layout("checkpointed"))),
    "fsdp.activation_checkpointing_offload": Acts("true", differs(ready("offloaded_layers")), AC),
    "fsdp.ac_policy": Acts("2", differs(layout("checkpointed")), AC),
    "fsdp.mixed_precision": Acts("bf16", LOSSES),
    "fsdp.xla": Refused("true"),
    "fsdp.xla_fsdp_settings": Refused('{"compute_dtype": "bfloat16"}'),
    "fsdp.xla_fsdp_grad_ckpt": Refused("true"),
    "fsdp.xla_fsdp_v2": Refused("false"),
    **MULTI_RANK,
    "parallelism.fsdp_size": Refused("1"),
    "parallelism.ep_size": Refused("2"),
    "parallelism.cp_size": ProvenBy(
        "tests/test_parity.py::test_document_mask_under_cp_trains_like_one_process"
    ),
    "parallelism.sp_size": Refused("2"),
    "parallelism.cp_comm_strategy": Refused("alltoall", ("parallelism.cp_size=1",)),
    "checkpoint.dir": Acts("{elsewhere}", differs(lambda r: r["watched"])),
    "checkpoint.interval": Acts("1", differs(lambda r: len(events(r, "checkpoint")))),
    "checkpoint.keep_latest": Acts(
        "1",
        differs(lambda r: sorted({f.split("/")[1] for f in files(r) if f.startswith("checkpoints/step-")})),
        ("checkpoint.interval=1",),
    ),
    "checkpoint.resume": Acts(  # in a copy of the base run's directory: auto resumes at its last step
        "none", differs(lambda r: events(r, "model_ready")[-1]["start_step"]), ("copy base",)
    ),
    "checkpoint.export": Acts("false", differs(lambda r: [f for f in files(r) if f.startswith("export")])),
    "checkpoint.max_shard_size": Acts(
        "1MB", differs(lambda r: [f for f in files(r) if f.startswith("export")])
    ),
    "checkpoint.export_dtype": Acts("bfloat16", differs(exported_dtype)),
    # The same bytes on a POSIX disk; only on a filesystem that keeps one writer's copy does it tell
    "checkpoint.export_writers": ProvenBy(
        "tests/test_export.py::"
        "test_one_writer_per_file_exports_whole_through_a_filesystem_that_keeps_only_the_last_writers_copy"
    ),
    "checkpoint.async_save": Acts(
        "true", differs(lambda r: [e.get("async") for e in events(r, "checkpoint")])
    ),
    # A copy of the base run's export with one byte of its weights flipped: its manifest's checksum fails.
    "checkpoint.verify_checksums": Acts("false", fails, ("model.name_or_path={damaged}", "model.config={}")),
    "checkpoint.load_best_model_at_end": ProvenBy(
        "tests/test_finetune.py::test_early_stopping_stops_where_patience_says_and_exports_the_best_step"
    ),
    "metrics.log_every": Acts("2", differs(lambda r: [x["step"] for x in steps(r)]), ("train.steps=4",)),
    "metrics.comm_stats": Acts("true", differs(column("all_gather_calls"))),
    "metrics.tensorboard": Acts(
        "true", differs(lambda r: [f for f in files(r) if f.startswith("tensorboard")])
    ),
    "metrics.peak_flops": Acts("1e12", differs(column("mfu"))),
    "metrics.profile_steps": ProvenBy(
        "tests/test_profiling.py::test_profile_steps_write_a_trace_per_rank_with_every_all_gather_and_reduce_scatter",
        on="pretrain_fsdp",
    ),
    "metrics.memory_snapshot": Refused("true"),  # on a CPU; on CUDA, tests/test_profiling.py
    "eval.interval": Acts("1", differs(lambda r: len(events(r, "eval"))), ("data.eval_dataset=embedded",)),
    "eval.early_stopping_patience": ProvenBy(
        "tests/test_finetune.py::test_early_stopping_stops_where_patience_says_and_exports_the_best_step",
        on="pretrain_fsdp",
    ),
    "eval.early_stopping_threshold": Acts(
        "10",
        differs(lambda r: event(r, "stopped").get("reason")),
        (*EVAL_RUNS, "train.steps=3", "eval.early_stopping_patience=1"),
    ),
    "eval.max_sequences": Acts("2", differs(lambda r: [e["tokens"] for e in events(r, "eval")]), EVAL_RUNS),
    "eval.batch_size": Acts(
        "2", differs(lambda r: [e.get("eval_loss") for e in events(r, "eval")]), EVAL_RUNS
    ),
    "eval.load_balance": Refused("false"),
    "eval.loss_chunk_tokens": Acts(
        "0", differs(lambda r: [e.get("eval_loss") for e in events(r, "eval")]), EVAL_RUNS
    ),
    "eval.attention": Refused("allgather"),
    "lora.r": Acts("4", differs(ready("trainable_params"))),
    "lora.alpha": Acts("64", LOSSES, LORA),
    "lora.dropout": Acts("0.5", LOSSES, LORA),
    "lora.target_modules": Acts('["q_proj"]', differs(ready("trainable_params")), LORA),
    "lora.base_dtype": Acts("bfloat16", differs(layout("param_dtypes")), LORA),
    "lora.merge_on_export": Acts(
        "true", differs(lambda r: [f for f in files(r) if f.startswith("export")]), LORA
    ),
}


# The MoE recipe: pretrain's keys act the same through the same code, except where noted.
MOE_TABLE = {
    **PRETRAIN,
    "model.name_or_path": Acts(("{moe_export}", "model.config={}"), differs(lambda r: losses(r)[:1])),
    "model.config": Acts("model.config.num_hidden_layers=1", differs(ready("params"))),
    "data.dataset": Acts("{sft}", LOSSES),
    "data.eval_dataset": Acts("{sft}", differs(lambda r: [e["eval_loss"] for e in events(r, "eval")])),
    # The checkpoint's own code runs (without the key, its config cannot be read); its model is dense, which
    # the recipe then refuses by name, so the run ends there either way, with another error.
    "model.trust_remote_code": Acts(
        "true",
        lambda base, run: "custom code" in base["error"] and "is a RemoteForCausalLM" in run["error"],
        ("model.name_or_path={remote_code}", "model.config={}"),
    ),
    "model.freeze_vision_tower": Refused("false"),  # a text model; image-text: test_architectures.py
    "model.freeze_multi_modal_projector": Refused("false"),
    "checkpoint.export_writers": ProvenBy(  # its experts, split back, written by one rank each
        "tests/test_moe.py::test_fewer_local_experts_than_ranks_to_shard_them_over_still_split_evenly"
    ),
    # "arithmetic": its train part, or the held-out tenth under any other split; no configs.
    "data.split": Acts("test", LOSSES),
    "data.eval_split": Acts("train", differs(lambda r: [e["eval_loss"] for e in events(r, "eval")])),
    "data.text_field": Refused("body"),
    "data.streaming": Refused("true"),
    "data.document_mask": Refused("true"),
    "data.embedded_max_bytes": Acts("800000", LOSSES),  # the embedded tokenizer is trained on that slice
    "train.micro_batch_size": Acts("2", differs(layout("forwards"))),
    "train.steps": Acts("3", differs(lambda r: [x["step"] for x in steps(r)])),
    "train.sync_each_batch": ProvenBy(
        "tests/test_moe.py::test_sync_each_batch_reduce_scatters_every_micro_batch_with_the_same_losses"
    ),
    "train.min_lr_ratio": Acts("0.5", LR, ("train.steps=4", "train.warmup_steps=0")),  # its config warms up 5
    "train.compile": Refused("true"),
    "train.loss_chunk_tokens": ProvenBy(
        "tests/test_loss.py::test_moe_fine_tuning_with_the_chunked_head_equals_the_plain_head"
    ),
    "train.verify_loss_at_start": Acts("false", differs(ready("loss_at_start"))),
    "train.router_aux_loss_coef": Acts("0.5", LOSSES),
    "fsdp.transformer_layer_cls_to_wrap": Acts(
        '["Qwen3MoeAttention", "Qwen3MoeSparseMoeBlock"]', differs(ready("fsdp_units"))
    ),
    "fsdp.xla_fsdp_v2": Refused("false"),
    "parallelism.dp_replicate_size": ProvenBy(
        "tests/test_moe.py::test_layout_matches_one_process_and_places_experts"
    ),
    "parallelism.dp_shard_size": Refused("1"),
    "parallelism.fsdp_size": ProvenBy(
        "tests/test_moe.py::test_layout_matches_one_process_and_places_experts"
    ),
    "parallelism.ep_size": ProvenBy("tests/test_moe.py::test_layout_matches_one_process_and_places_experts"),
    "parallelism.tp_size": ProvenBy("tests/test_moe.py::test_layout_matches_one_process_and_places_experts"),
    "parallelism.cp_size": Refused("2"),
    "checkpoint.load_best_model_at_end": Acts(  # a learning rate that overshoots: the best step is earlier
        "true",
        differs(lambda r: event(r, "final").get("fixed_batch_loss")),
        ("eval.interval=1", "checkpoint.interval=1", "train.steps=3", "train.lr=0.3", "train.warmup_steps=0"),
    ),
    "metrics.peak_flops": Refused("1e12"),
    "eval.interval": Acts("1", differs(lambda r: len(events(r, "eval")))),
    "eval.early_stopping_threshold": Acts(
        "10",
        differs(lambda r: event(r, "stopped").get("reason")),
        ("eval.interval=1", "train.steps=3", "eval.early_stopping_patience=1"),
    ),
    "eval.max_sequences": Acts("4", differs(lambda r: [e["tokens"] for e in events(r, "eval")])),
    "eval.batch_size": Acts("2", differs(layout("forwards"))),
    "eval.load_balance": Refused("false"),
    "eval.loss_chunk_tokens": ProvenBy(
        "tests/test_loss.py::test_moe_fine_tuning_with_the_chunked_head_equals_the_plain_head"
    ),
    "eval.attention": Refused("allgather"),
    "lora.r": Refused("4"),
    **{
        f"lora.{key}": Refused(value)
        for key, value in [("alpha", "64"), ("dropout", "0.5"), ("target_modules", '["q_proj"]')]
        + [("base_dtype", "bfloat16"), ("merge_on_export", "true")]
    },
}

# eval_cp.py evaluates pretrain_fsdp.py's export; what only training reads is named in one line.
EVAL_TABLE = {
    "model.name_or_path": Acts("{moe_export}", differs(result("eval_loss"))),
    "model.config": Refused("model.config.num_hidden_layers=1"),
    "model.attn_implementation": Acts("eager", differs(layout("attn"))),
    "model.trust_remote_code": Acts("true", fails, ("model.name_or_path={remote_code}",)),
    "model.freeze_vision_tower": Refused("false"),  # a text model; image-text: test_architectures.py
    "model.freeze_multi_modal_projector": Refused("false"),
    "data.dataset": Acts("{documents}", differs(result("eval_loss"))),
    "data.eval_dataset": Acts("{documents}", differs(result("eval_loss"))),
    "data.eval_split": PRETRAIN["data.eval_split"],
    "data.dataset_config": PRETRAIN["data.dataset_config"],
    "data.split": PRETRAIN["data.split"],
    "data.text_field": Acts("body", fails, ("data.dataset={body}",)),
    "data.streaming": Refused("true"),
    "data.pack": Acts("false", differs(result("tokens"))),
    "data.document_mask": Acts("true", differs(result("eval_loss")), ("data.dataset={documents}",)),
    "data.tokenizer": Acts("{tokenizer}", differs(result("eval_loss"))),
    "data.seq_len": Acts("32", differs(result("tokens"))),
    "data.embedded_max_bytes": Acts(  # where the held-out files start
        "800000", differs(result("eval_loss")), ("data.eval_dataset=embedded",)
    ),
    "data.cache_dir": PRETRAIN["data.cache_dir"],
    "fsdp.version": Refused("1"),
    "fsdp.reshard_after_forward": Acts("false", differs(layout("reshard"))),
    "fsdp.cpu_offload": Acts("true", differs(layout("offload"))),
    "fsdp.auto_wrap_policy": Acts("NO_WRAP", differs(layout("fsdp_units"))),
    "fsdp.transformer_layer_cls_to_wrap": Acts(
        '["LlamaMLP", "LlamaAttention"]', differs(layout("fsdp_units"))
    ),
    "fsdp.min_num_params": Acts("100000", differs(layout("fsdp_units")), SIZE_BASED),
    "fsdp.cpu_ram_efficient_loading": PRETRAIN["fsdp.cpu_ram_efficient_loading"],
    "fsdp.mixed_precision": Acts("bf16", differs(result("eval_loss"))),
    **{
        key: PRETRAIN[key]
        for key in ("fsdp.xla", "fsdp.xla_fsdp_settings", "fsdp.xla_fsdp_grad_ckpt", "fsdp.xla_fsdp_v2")
    },
    "parallelism.dp_replicate_size": Refused("2"),
    "parallelism.dp_shard_size": Refused("2"),
    "parallelism.fsdp_size": Refused("1"),
    "parallelism.ep_size": Refused("2"),
    "parallelism.tp_size": Refused("2"),
    "parallelism.cp_size": ProvenBy(
        "tests/test_eval_cp.py::test_every_layout_gives_the_cp1_result_and_counts_each_token_once"
    ),
    "parallelism.sp_size": Refused("2"),
    "parallelism.cp_comm_strategy": Refused("alltoall", ("parallelism.cp_size=1",)),
    "parallelism.timeout_minutes": MULTI_RANK["parallelism.timeout_minutes"],
    "checkpoint.dir": PRETRAIN["checkpoint.dir"],
    "checkpoint.verify_checksums": Acts("false", fails, ("model.name_or_path={damaged}",)),
    "metrics.profile_steps": Refused("[1, 1]"),
    "metrics.memory_snapshot": Refused("true"),
    "eval.max_sequences": Acts("2", differs(result("tokens"))),
    "eval.batch_size": Acts("2", differs(layout("forwards"))),
    "eval.load_balance": Refused("false"),  # at cp_size 1; at 2, tests/test_eval_cp.py runs it
    "eval.loss_chunk_tokens": ProvenBy(
        "tests/test_eval_cp.py::test_chunked_head_keeps_full_vocabulary_logits_out_of_memory"
    ),
    "eval.attention": Refused("torch_cp"),  # on a CPU
    "lora.r": Refused("4"),
    "train.verify_loss_at_start": Acts("false", differs(result("loss_at_start"))),
}
# Training keys, at a value other than the default: eval_cp.py names them in one line.
TRAINING_ONLY = {
    "train.steps": "3",
    "train.global_batch_size": "4",
    "train.micro_batch_size": "2",
    "train.lr": "0.01",
    "train.min_lr_ratio": "0.5",
    "train.warmup_steps": "0",
    "train.lr_schedule": "wsd",
    "train.wsd_decay_ratio": "0.5",
    "train.weight_decay": "0.5",
    "train.betas": "[0.5, 0.6]",
    "train.eps": "0.001",
    "train.max_grad_norm": "0.5",
    "train.seed": "1",
    "train.gradient_checkpointing": "true",
    "train.compile": "true",
    "train.loss_chunk_tokens": "0",
    "train.sync_each_batch": "true",
    "train.stop_after": "1",
    "train.router_aux_loss_coef": "0.01",
    "fsdp.state_dict_type": "SHARDED_STATE_DICT",
    "fsdp.activation_checkpointing": "true",
    "checkpoint.interval": "1",
    "checkpoint.keep_latest": "1",
    "checkpoint.resume": "none",
    "checkpoint.export": "false",
    "checkpoint.max_shard_size": "1MB",
    "checkpoint.export_dtype": "bfloat16",
    "checkpoint.export_writers": "one",
    "checkpoint.async_save": "true",
    "checkpoint.load_best_model_at_end": (
        "checkpoint.load_best_model_at_end=true",
        *EVAL_RUNS,
        "checkpoint.interval=1",
    ),
    "metrics.log_every": "2",
    "metrics.comm_stats": "true",
    "metrics.tensorboard": "false",
    "metrics.peak_flops": "1e12",
    "eval.interval": ("eval.interval=1", "data.eval_dataset=embedded"),
    "eval.early_stopping_patience": ("eval.early_stopping_patience=1", *EVAL_RUNS),
    "eval.early_stopping_threshold": "0.5",
    "lora.alpha": "64",
    "lora.dropout": "0.5",
    "lora.target_modules": '["q_proj"]',
    "lora.base_dtype": "bfloat16",
    "lora.merge_on_export": "true",
    "data.embedded_vocab_size": "2048",  # the export's own tokenizer is used
    "fsdp.activation_checkpointing_offload": (*AC, "fsdp.activation_checkpointing_offload=true"),
    "fsdp.ac_policy": (*AC, "fsdp.ac_policy=2"),
}
EVAL_TABLE.update({key: Named(value) for key, value in TRAINING_ONLY.items()})
EVAL_TABLE["train.device"] = Refused("cuda")


XLA_WRAP = ProvenBy(
    "tests/test_xla.py::test_wrap_plan_follows_auto_wrap_policy_and_grad_ckpt_takes_the_layers"
)
# The XLA recipe's runs go through the same shared code as pretrain_fsdp.py's, at the same values.
XLA_AS_PRETRAIN = (
    "model.config",
    "model.trust_remote_code",
    *(f"data.{key}" for key in ("dataset", "pack", "tokenizer", "seq_len", "cache_dir", "text_field")),
    *(f"data.{key}" for key in ("streaming", "embedded_max_bytes", "embedded_vocab_size")),
    *(f"train.{key}" for key in ("steps", "global_batch_size", "min_lr_ratio", "warmup_steps")),
    *(f"train.{key}" for key in ("lr_schedule", "wsd_decay_ratio", "lr", "weight_decay", "betas", "eps")),
    *(f"train.{key}" for key in ("max_grad_norm", "seed", "stop_after")),
    *(f"checkpoint.{key}" for key in ("dir", "interval", "keep_latest", "resume", "export")),
    *(f"checkpoint.{key}" for key in ("verify_checksums", "max_shard_size", "export_dtype")),
    *(f"metrics.{key}" for key in ("log_every", "tensorboard", "peak_flops")),
)
TPU_TABLE = {
    **{key: PRETRAIN[key] for key in XLA_AS_PRETRAIN},
    "model.name_or_path": Acts(("{xla_export}", "model.config={}"), differs(lambda r: losses(r)[:1])),
    "model.attn_implementation": Refused("flash_attention_2"),
    "model.freeze_vision_tower": Refused("false"),  # a text model; image-text: test_architectures.py
    "model.freeze_multi_modal_projector": Refused("false"),
    "data.eval_dataset": Refused("embedded"),
    "data.eval_split": PRETRAIN["data.eval_split"],
    "data.dataset_config": PRETRAIN["data.dataset_config"],
    "data.split": PRETRAIN["data.split"],
    "data.document_mask": Refused("true"),
    "train.micro_batch_size": Acts("8", differs(layout("forwards"))),  # its config's is 4 (x 4 devices)
    "train.gradient_checkpointing": Refused("true"),
    "train.compile": Refused("true"),
    "train.loss_chunk_tokens": Refused("0"),
    "train.sync_each_batch": Refused("true"),
    "train.verify_loss_at_start": Refused("false"),
    "train.device": Refused("cpu"),
    "train.router_aux_loss_coef": Refused("0.01"),
    "fsdp.version": Refused("1"),
    "fsdp.reshard_after_forward": Refused("false"),
    "fsdp.cpu_offload": Refused("true"),
    "fsdp.auto_wrap_policy": XLA_WRAP,
    "fsdp.transformer_layer_cls_to_wrap": XLA_WRAP,
    "fsdp.min_num_params": XLA_WRAP,
    "fsdp.state_dict_type": ProvenBy(
        "tests/test_xla.py::test_grad_ckpt_keeps_the_losses_and_resume_continues_exactly"
    ),
    "fsdp.cpu_ram_efficient_loading": Refused("true"),
    "fsdp.activation_checkpointing": Refused("true"),
    "fsdp.activation_checkpointing_offload": Refused("true"),
    "fsdp.ac_policy": Refused("2"),
    "fsdp.mixed_precision": Refused("bf16"),
    "fsdp.xla": Refused("false"),
    "fsdp.xla_fsdp_settings": ProvenBy(
        "tests/test_xla.py::test_bf16_compute_dtype_autocasts_and_exports_bf16"
    ),
    "fsdp.xla_fsdp_grad_ckpt": ProvenBy(
        "tests/test_xla.py::test_grad_ckpt_keeps_the_losses_and_resume_continues_exactly"
    ),
    "fsdp.xla_fsdp_v2": Refused("false"),
    **{
        f"parallelism.{key}": Refused("2")
        for key in ("dp_replicate_size", "ep_size", "tp_size", "cp_size", "sp_size")
    },
    "parallelism.dp_shard_size": Refused("2"),
    "parallelism.fsdp_size": Refused("2"),
    "parallelism.cp_comm_strategy": Refused("alltoall"),
    "parallelism.timeout_minutes": Refused("1"),
    "checkpoint.export_writers": Refused("one"),
    "checkpoint.async_save": Refused("true"),
    "checkpoint.load_best_model_at_end": Refused("true"),
    "metrics.comm_stats": Refused("true"),
    "metrics.profile_steps": Refused("[1, 1]"),
    "metrics.memory_snapshot": Refused("true"),
    "eval.interval": Refused("1", ("data.eval_dataset=embedded",)),
    "eval.early_stopping_patience": Refused("1"),
    **{
        f"eval.{key}": Refused(value)
        for key, value in [("early_stopping_threshold", "0.5"), ("max_sequences", "2"), ("batch_size", "2")]
        + [("load_balance", "false"), ("loss_chunk_tokens", "0"), ("attention", "allgather")]
    },
    "lora.r": Refused("4"),
    **{
        key: Refused(entry.value)
        for key, entry in MOE_TABLE.items()
        if key.startswith("lora.") and key != "lora.r"
    },
}
# Keys whose value a library parses or opens (a size, a dtype, a class or module name, a path): a bad value is
# one line before step 1, not a traceback after training (checkpoint.max_shard_size "5GiB" once failed only
# in the export). Every key that takes a string, other than a Literal (common/config.py checks those as it
# loads), needs one here, so a new one checked only late fails test_a_bad_value_is_one_line_before_step_1.
BAD_VALUES = {
    "model.name_or_path": ("{missing}", "model.config={}"),
    "model.attn_implementation": "flash_attention_9",
    "data.dataset": "{missing}.jsonl",
    "data.eval_dataset": ("{missing}.jsonl", "eval.interval=1"),
    "data.eval_split": ("nope", "data.eval_dataset=embedded", "eval.interval=1"),
    "data.dataset_config": "nope",
    "data.split": "nope",
    "data.text_field": ("nope", "data.dataset={documents}"),
    "data.tokenizer": "{missing}",
    "data.cache_dir": "{documents}/cache",
    "fsdp.transformer_layer_cls_to_wrap": "NoSuchLayer",
    "fsdp.mixed_precision": "bf17",
    "checkpoint.dir": "{documents}/run",
    "checkpoint.resume": "{missing}",
    "checkpoint.max_shard_size": ("5GiB", "fsdp.state_dict_type=FULL_STATE_DICT"),
    "lora.target_modules": ('["nope"]', "lora.r=4"),
}


TABLES = {
    "pretrain_fsdp": PRETRAIN,
    "finetune_moe_ep_fsdp": MOE_TABLE,
    "eval_cp": EVAL_TABLE,
    "tpu_xla_fsdp": TPU_TABLE,
}


def every_key() -> list[str]:
    config = Config()
    return [
        f"{section.name}.{field.name}"
        for section in dataclasses.fields(config)
        for field in dataclasses.fields(getattr(config, section.name))
    ]


def overrides(key: str, value: str | tuple) -> list[str]:
    """An entry's value as key=value words; a word that already names a key is taken as it is."""
    words = value if isinstance(value, tuple) else (value,)
    return [w if re.match(r"[a-z_]+\.[a-z_.]+=", w) else f"{key}={w}" for w in words]


def runs_of(script: str, key: str, entry) -> tuple[tuple | None, tuple | None]:
    """(the base run's words, the run's words) an entry needs: its context, then its value."""
    if isinstance(entry, (Refused, Named)):
        context = getattr(entry, "context", ())
        return None, (*context, *overrides(key, entry.value))
    if isinstance(entry, Acts):
        return entry.context, (*entry.context, *overrides(key, entry.value))
    return None, None


def test_the_table_covers_every_key_of_every_section():
    for script, table in TABLES.items():
        assert sorted(table) == sorted(every_key()), (
            script,
            f"missing: {sorted(set(every_key()) - set(table))}",
            f"not keys: {sorted(set(table) - set(every_key()))}",
        )


def takes_a_string(key: str) -> bool:
    section, name = key.split(".")
    kind = next(f.type for f in dataclasses.fields(getattr(Config(), section)) if f.name == name)
    return "str" in str(kind) and "Literal" not in str(kind)


def test_every_key_that_takes_a_string_has_a_bad_value():
    assert sorted(BAD_VALUES) == sorted(key for key in every_key() if takes_a_string(key))


def _files(tmp, name: str) -> dict:
    """The data the table's placeholders name: text documents, records with another text field, SFT
    records, a tokenizer other than the embedded one, and a cache seeded with the embedded tokenizers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp / name
    root.mkdir()
    documents = write_short_documents(root / "documents.jsonl")
    with open(documents) as f, open(root / "body.jsonl", "w") as out:
        for line in f:
            out.write(json.dumps({"body": json.loads(line)["text"]}) + "\n")
    with open(root / "sft.jsonl", "w") as out:
        for a in range(200):
            out.write(json.dumps({"prompt": f"{a} plus {a % 7} is", "completion": f" {a + a % 7}"}) + "\n")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"])
    with open(documents) as f:
        tokenizer.train_from_iterator((json.loads(line)["text"] for line in f), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(root / "tokenizer")
    return {
        "{documents}": documents,
        "{body}": str(root / "body.jsonl"),
        "{sft}": str(root / "sft.jsonl"),
        "{tokenizer}": str(root / "tokenizer"),
        "{remote_code}": remote_code_checkpoint(root / "remote_code"),
    }


def remote_code_checkpoint(path) -> str:
    """A checkpoint that ships its own code, as trust_remote_code models do (config.json's auto_map): a tiny
    Llama under a model_type Transformers does not know, with debug_tiny's sizes and vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir()
    (path / "configuration_remote.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass RemoteConfig(LlamaConfig):\n"
        '    model_type = "remote_llama"\n'
    )
    (path / "modeling_remote.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_remote import RemoteConfig\n\n\n"
        "class RemoteForCausalLM(LlamaForCausalLM):\n    config_class = RemoteConfig\n"
    )
    with open(TINY) as f:
        sizes = json.load(f)["model"]["config"]
    torch.manual_seed(0)
    save_release(LlamaForCausalLM(LlamaConfig(**sizes)), path)
    with open(path / "config.json") as f:
        config = json.load(f)
    config.update(model_type="remote_llama", architectures=["RemoteForCausalLM"])
    config["auto_map"] = {
        "AutoConfig": "configuration_remote.RemoteConfig",
        "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
    }
    with open(path / "config.json", "w") as f:
        json.dump(config, f)
    return str(path)


def plan_runs(tmp) -> tuple[list[dict], dict]:
    """(every run the table needs, in order, each once; for each (script, key), its base run and run)."""
    subs = _files(tmp, "data")
    dirs, plan = {}, []
    subs["{pretrain_export}"] = str(tmp / "0" / "export")
    subs["{moe_export}"] = str(tmp / "1" / "export")
    subs["{xla_export}"] = str(tmp / "3" / "export")  # the XLA recipe's own base run's, in its runner
    subs["{missing}"] = str(tmp / "missing")
    cached = glob.glob(os.path.join(os.path.expanduser(Config().data.cache_dir), "tokenizer-*"))

    def add(script: str, words: tuple, until_group: bool = False) -> str:
        """A run; `until_group`: only as far as the process group, for what is refused or named before."""
        run_id = f"{script}|{' '.join(words)}{' (checked)' if until_group else ''}"
        if run_id in dirs:
            return run_id
        run_dir = str(tmp / str(len(dirs)))
        dirs[run_id] = run_dir
        copy = "copy base" in words
        words = [w for w in words if w != "copy base"]
        item = {"id": run_id, "script": script, "dir": run_dir, "until_group": until_group}
        item["copy_from"] = f"{script}|" if copy else None
        local = {"{cache}": f"{run_dir}-cache", "{elsewhere}": f"{run_dir}-elsewhere"}
        local["{damaged}"] = f"{run_dir}-damaged"  # a copy of the script's base run's export, one byte off
        source = "pretrain_fsdp" if script == "eval_cp" else script  # eval_cp.py evaluates pretrain's
        damaged = "{damaged}" in " ".join(words)
        item["damage"] = [os.path.join(dirs[f"{source}|"], "export"), local["{damaged}"]] if damaged else None
        item["xla"] = script == "tpu_xla_fsdp" and not until_group
        item["watch"] = next((path for name, path in local.items() if any(name in w for w in words)), None)
        if "{cache}" in " ".join(words):
            for tokenizer_dir in cached:  # the embedded tokenizers, so this run does not train them again
                shutil.copytree(
                    tokenizer_dir, os.path.join(local["{cache}"], os.path.basename(tokenizer_dir))
                )
        argv = [*BASE[script], *words]
        for name, value in {**subs, **local}.items():
            argv = [a.replace(name, value) for a in argv]
        item["argv"] = argv
        plan.append(item)
        return run_id

    for script in BASE:  # pretrain's export first: eval_cp.py evaluates it
        add(script, ())
    needed = {}
    for script, table in TABLES.items():
        for key, entry in table.items():
            base, run = runs_of(script, key, entry)
            needed[script, key] = (
                add(script, base) if base is not None else None,
                add(script, run, not isinstance(entry, Acts)) if run is not None else None,
            )
    for key, value in BAD_VALUES.items():  # as far as it goes: a bad dataset is found after the group
        words = (value,) if isinstance(value, str) else value
        needed["bad", key] = (None, add("pretrain_fsdp", (*words[1:], *overrides(key, words[0]))))
    return plan, needed


def run_plan(tmp, plan: list[dict], needed: dict) -> dict:
    """The runs, in two subprocesses at once: the XLA recipe's own runs in the PyTorch/XLA environment (4 XLA
    CPU devices), the rest here; for each (script, key), what its base run and its run wrote."""
    runner = os.path.join(REPO, "tests", "every_key_runner.py")
    xla = [item for item in plan if item["xla"]]
    for name, items in [("plan", [item for item in plan if not item["xla"]]), ("xla_plan", xla)]:
        with open(tmp / f"{name}.json", "w") as f:
            json.dump(items, f)
    with open(tmp / "xla.log", "w") as log:
        started = None
        if os.path.exists(XLA_PYTHON):
            cmd = [XLA_PYTHON, runner, str(tmp / "xla_plan.json"), str(tmp / "xla_out.json")]
            xla_env = env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
            started = subprocess.Popen(cmd, cwd=REPO, env=xla_env, stdout=log, stderr=log)
        try:
            cmd = [sys.executable, runner, str(tmp / "plan.json"), str(tmp / "out.json")]
            proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=1800)
            assert proc.returncode == 0 and os.path.exists(tmp / "out.json"), proc.stderr[-5000:]
            xla_code = started.wait(timeout=1800) if started else None
        finally:
            if started and started.poll() is None:
                started.kill()
    with open(tmp / "out.json") as f:
        ran = json.load(f)
    if started is None:  # the XLA runs are skipped, with the reason (as tests/test_xla.py's are)
        ran |= {item["id"]: {"skipped": xla_unavailable()} for item in xla}
    else:
        assert xla_code == 0 and os.path.exists(tmp / "xla_out.json"), (tmp / "xla.log").read_text()[-5000:]
        with open(tmp / "xla_out.json") as f:
            ran |= json.load(f)
    return {pair: tuple(ran[run_id] if run_id else None for run_id in ids) for pair, ids in needed.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("every_key")
    return run_plan(tmp, *plan_runs(tmp))


def _show(run: dict | None) -> str:
    if run is None:
        return "no run"
    return f"error: {run['error']}\n...{run['out'][-1500:]}"


def _test_source(test: str) -> str:
    path, name = test.split("::")
    with open(os.path.join(REPO, path)) as f:
        text = f.read()
    node = next(
        (n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == name), None
    )
    assert node is not None, f"{test} does not exist"
    start = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
    return "\n".join(text.splitlines()[start - 1 : node.end_lineno])  # with its decorators


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
def test_a_bad_value_is_one_line_before_step_1(key, results):
    run = results["bad", key][1]
    assert run["error"] and run["error"].startswith("config error:") and "\n" not in run["error"], _show(run)
    assert key.split(".")[-1] in run["error"], run["error"]
    assert not steps(run), f"refused only after training: {run['error']}"


CASES = [(script, key) for script in TABLES for key in every_key()]


@pytest.mark.parametrize("script,key", CASES, ids=[f"{s}-{k}" for s, k in CASES])
def test_every_key_acts_or_errors(script, key, results):
    entry = TABLES[script][key]
    base, run = results.get((script, key), (None, None))
    if skipped := (run or {}).get("skipped") or (base or {}).get("skipped"):
        pytest.skip(skipped)
    if isinstance(entry, ProvenBy):  # and tests/keys_given.py fails that test if it never gives the key
        assert entry.on in (None, *TABLES), entry.on
        source = _test_source(entry.test)
        assert not re.search(r"pytest\.mark\.(skip|xfail)", source), f"{entry.test} does not run"
    elif isinstance(entry, Refused):
        named = key.split(".")[-1] in run["error"] if run["error"] else False  # "fsdp.a / b are set" names b
        refused = named and run["error"].startswith("config error:")
        assert refused, _show(run)
        assert run["before_group"], f"refused only after the process group was up: {run['error']}"
        assert "\n" not in run["error"], run["error"]
    elif isinstance(entry, Named):
        lines = [line for line in run["out"].splitlines() if "these training keys do nothing" in line]
        assert not run["error"] and len(lines) == 1 and key in lines[0], _show(run)
    else:
        assert entry.probe(base, run), (
            f"no difference from the default\nbase: {_show(base)}\nrun: {_show(run)}"
        )
