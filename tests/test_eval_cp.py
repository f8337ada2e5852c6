"""eval_cp.py: the same eval loss, perplexity and accuracy for every cp / dp layout, each token once."""

import json
import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import DataConfig
from common.data.batches import LocalBatches, document_positions, prepare_local_data
from launch import REPO, TINY, run, write_short_documents

EVAL = os.path.join(REPO, "configs", "debug_eval_cp.json")
SEQ = ["data.seq_len=256", "eval.max_sequences=8"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained")
    run("pretrain_fsdp.py", ["--config", TINY, f"checkpoint.dir={run_dir}", "train.steps=3"], nproc=0)
    return str(run_dir / "export")


def evaluate(export, tmp_path, *overrides, nproc=1) -> dict:
    run(
        "eval_cp.py",
        ["--config", EVAL, f"model.name_or_path={export}", f"checkpoint.dir={tmp_path}", *overrides],
        nproc=nproc,
    )
    with open(tmp_path / "eval_results.json") as f:
        return json.load(f)


def reference_batch(export, seq_len=256, num=8, pack=True):
    cfg = DataConfig(seq_len=seq_len, tokenizer=export, pack=pack)
    return LocalBatches(prepare_local_data(cfg, is_main=True), 0, 0, 1, 1, 0, 1).fixed_batch(num)


@pytest.fixture(scope="module")
def cp1(export, tmp_path_factory):
    return evaluate(export, tmp_path_factory.mktemp("cp1"), *SEQ, "parallelism.cp_size=1")


@pytest.mark.compat
def test_cp1_equals_plain_transformers(export, cp1):
    batch = reference_batch(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")
    tokens = int((batch.labels != -100).sum())
    accuracy = ((logits.argmax(-1) == batch.labels) & (batch.labels != -100)).sum().item() / tokens
    assert cp1["tokens"] == tokens == 8 * 256
    assert cp1["eval_loss"] == pytest.approx(loss.item() / tokens, abs=1e-5)
    assert cp1["perplexity"] == pytest.approx(np.exp(loss.item() / tokens), rel=1e-5)
    assert cp1["accuracy"] == pytest.approx(accuracy, abs=1e-9)


@pytest.mark.parametrize(
    "nproc,overrides,source",
    [
        pytest.param(2, ["parallelism.cp_size=2"], "export", marks=pytest.mark.compat),
        (2, ["parallelism.cp_size=2", "eval.load_balance=false"], "export"),
        (4, ["parallelism.cp_size=4"], "export"),
        (4, ["parallelism.cp_size=2"], "export"),  # dp 2 x cp 2
        # The training checkpoint checkpoints/step-3 (DCP of model + optimizer, config and tokenizer beside
        # it) is read directly, resharded to cp 2, and scores what its export scores.
        (2, ["parallelism.cp_size=2"], "step-3"),
    ],
    ids=["cp2", "cp2-no-load-balance", "cp4", "dp2xcp2", "cp2-training-checkpoint"],
)
def test_every_layout_gives_the_cp1_result_and_counts_each_token_once(
    export, cp1, tmp_path, nproc, overrides, source
):
    if source != "export":
        export = os.path.join(os.path.dirname(export), "checkpoints", source)
    result = evaluate(export, tmp_path, *SEQ, *overrides, nproc=nproc)
    assert result["cp_size"] * result["dp_size"] == nproc
    assert result["tokens"] == cp1["tokens"]  # never multiplied by cp
    assert result["eval_loss"] == pytest.approx(cp1["eval_loss"], abs=1e-5)
    assert result["perplexity"] == pytest.approx(cp1["perplexity"], rel=1e-5)
    assert result["accuracy"] == pytest.approx(cp1["accuracy"], abs=1e-9)


# torch's own ring attention (eval.attention=torch_cp) on CPU, through the test-only CP kernel entry.
CPU_RING = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
SHIM = os.path.join(REPO, "tests", "cpu_ring_attention.py")


@pytest.mark.parametrize(
    "nproc,overrides",
    [
        (2, ["parallelism.cp_size=2"]),
        (4, ["parallelism.cp_size=4"]),
        # Each key once, together: their own code paths do not depend on each other.
        (4, ["parallelism.cp_size=4", "parallelism.cp_comm_strategy=alltoall", "eval.load_balance=false"]),
        (4, ["parallelism.cp_size=2"]),  # dp 2 x cp 2
    ],
    ids=["cp2", "cp4", "cp4-alltoall-no-load-balance", "dp2xcp2"],
)
def test_torch_context_parallel_on_cpu_gives_the_allgather_result(export, cp1, tmp_path, nproc, overrides):
    args = ["--config", EVAL, f"model.name_or_path={export}", f"checkpoint.dir={tmp_path}", *SEQ, *overrides]
    run(
        "eval_cp.py",
        [*args, "eval.attention=torch_cp"],
        launcher=[*CPU_RING, f"--nproc_per_node={nproc}", SHIM],
    )
    with open(tmp_path / "eval_results.json") as f:
        result = json.load(f)
    assert result["attention"] == "torch_cp" and result["cp_size"] * result["dp_size"] == nproc
    assert result["tokens"] == cp1["tokens"]
    assert result["eval_loss"] == pytest.approx(cp1["eval_loss"], abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="torch's context_parallel needs 2 CUDA devices")
@pytest.mark.parametrize("strategy", ["allgather", "alltoall"])
def test_torch_context_parallel_gives_the_allgather_result_on_cuda(export, tmp_path, strategy):
    common = [*SEQ, "parallelism.cp_size=2", "train.device=cuda"]
    ours = evaluate(export, tmp_path / "ours", *common, "eval.attention=allgather", nproc=2)
    torch_cp = evaluate(
        export,
        tmp_path / "torch",
        *common,
        "eval.attention=torch_cp",
        f"parallelism.cp_comm_strategy={strategy}",
        nproc=2,
    )
    assert torch_cp["attention"] == "torch_cp" and torch_cp["tokens"] == ours["tokens"]
    assert torch_cp["eval_loss"] == pytest.approx(ours["eval_loss"], abs=1e-4)  # different fp32 kernels


def test_document_mask_keeps_attention_inside_each_document_at_every_cp(export, tmp_path):
    corpus = write_short_documents(tmp_path / "short.jsonl")
    common = [f"data.dataset={corpus}", "data.seq_len=256", "eval.max_sequences=4", "data.document_mask=true"]
    cfg = DataConfig(dataset=corpus, seq_len=256, tokenizer=export)
    batch = LocalBatches(prepare_local_data(cfg, is_main=True), 0, 0, 1, 1, 0, 1).fixed_batch(4)
    eos = AutoTokenizer.from_pretrained(export).eos_token_id
    position_ids = document_positions(batch.input_ids, eos)
    assert (position_ids == 0).sum() > 4 * 5  # several documents per row
    model = AutoModelForCausalLM.from_pretrained(export, attn_implementation="sdpa").eval()
    with torch.no_grad():  # Transformers' own packed-sequence mask, built from position ids that restart
        masked, plain = (
            model(input_ids=batch.input_ids, position_ids=ids, use_cache=False).logits
            for ids in (position_ids, None)
        )
    tokens = int((batch.labels != -100).sum())
    losses = [
        torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch.labels.flatten(), reduction="sum"
        ).item()
        / tokens
        for logits in (masked, plain)
    ]
    assert abs(losses[0] - losses[1]) > 1e-3  # the mask matters on this data (tolerance below: 1e-5)
    for nproc, cp_size in [(1, 1), (4, 4)]:
        result = evaluate(
            export, tmp_path / f"cp{cp_size}", *common, f"parallelism.cp_size={cp_size}", nproc=nproc
        )
        assert result["tokens"] == tokens
        assert result["eval_loss"] == pytest.approx(losses[0], abs=1e-5)


def test_padding_and_an_uneven_last_batch_are_not_counted(export, tmp_path):
    common = ["data.seq_len=256", "data.pack=false", "eval.max_sequences=7"]
    single = evaluate(export, tmp_path / "a", *common, "parallelism.cp_size=1")
    # 7 sequences over dp=2
    layout = evaluate(export, tmp_path / "b", *common, "parallelism.cp_size=2", nproc=4)
    valid = int((reference_batch(export, num=7, pack=False).labels != -100).sum())
    assert valid < 7 * 256  # the documents really are padded
    assert single["tokens"] == layout["tokens"] == valid
    assert layout["eval_loss"] == pytest.approx(single["eval_loss"], abs=1e-5)


def test_chunked_head_keeps_full_vocabulary_logits_out_of_memory(tmp_path):
    big_vocab = tmp_path / "big_vocab"
    run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={big_vocab}", "train.steps=1", "model.config.vocab_size=65536"],
        nproc=0,
    )
    common = ["data.seq_len=1024", "eval.max_sequences=2", "parallelism.cp_size=1"]
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    full = run_eval_env(
        big_vocab / "export", tmp_path / "full", [*common, "eval.loss_chunk_tokens=1000000"], env
    )
    chunked = run_eval_env(
        big_vocab / "export", tmp_path / "chunked", [*common, "eval.loss_chunk_tokens=128"], env
    )
    logits_gib = 1024 * 65536 * 4 / 2**30  # one sequence's full-vocabulary fp32 logits: 0.25 GiB
    assert chunked["eval_loss"] == pytest.approx(full["eval_loss"], abs=1e-5)
    assert chunked["peak_mem_gib_per_rank"][0] < full["peak_mem_gib_per_rank"][0] - 0.5 * logits_gib


def run_eval_env(export, tmp_path, overrides, env) -> dict:
    run(
        "eval_cp.py",
        ["--config", EVAL, f"model.name_or_path={export}", f"checkpoint.dir={tmp_path}", *overrides],
        nproc=1,
        extra_env=env,
    )
    with open(tmp_path / "eval_results.json") as f:
        return json.load(f)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["parallelism.cp_size=2", "parallelism.sp_size=2"], "pick one"),
        (["data.seq_len=250", "parallelism.cp_size=2"], "use 248 or 252"),
        (
            ["model.name_or_path=/nonexistent/model", "parallelism.cp_size=1"],
            "model.name_or_path '/nonexistent/model'",
        ),
        (["eval.attention=torch_cp", "train.device=cpu", "parallelism.cp_size=1"], "needs CUDA SDPA kernels"),
        (
            ["eval.attention=torch_cp", "data.document_mask=true", "parallelism.cp_size=1"],
            "plain causal attention only",
        ),
        (["metrics.profile_steps=[1, 2]", "parallelism.cp_size=1"], "which eval_cp.py has none of"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, overrides, message):
    proc = run(
        "eval_cp.py", ["--config", EVAL, f"checkpoint.dir={tmp_path}", *overrides], nproc=0, check=False
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_sliding_window_models_are_refused_under_cp():
    from transformers import MistralConfig

    from common.config import ConfigError
    from common.cp import check_cp

    check_cp(256, 2, True, MistralConfig(sliding_window=None))  # full attention: fine
    with pytest.raises(ConfigError, match="sliding-window attention"):
        check_cp(256, 2, True, MistralConfig(sliding_window=128))
