"""Fine-tuning like the Trainer: evaluation during training that scripts/eval_cp.py reproduces (also under CP,
document masks and EP), a held-out set that is held out, the best model exported, early stopping that
survives a restart, and dense SFT on answer tokens only."""

import json
import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import DataConfig
from common.data.batches import load_tokenizer
from common.data.embedded import embedded_files
from common.data.sft import SftBatches, arithmetic_examples, sft_rows_path
from common.ops.config_sources import load_config
from launch import REPO, TINY, event, losses, pretrain, read_metrics, run, steps, write_short_documents

MOE = os.path.join(REPO, "configs", "debug_moe.json")
SFT = os.path.join(REPO, "configs", "debug_sft.json")
HELD_OUT = ["data.eval_dataset=embedded", "eval.max_sequences=6", "eval.batch_size=2"]
EVALUATED = [
    "train.steps=5",  # not a multiple of eval.interval: the last step is evaluated too
    "eval.interval=2",
    "checkpoint.interval=2",
    "checkpoint.keep_latest=3",
    *HELD_OUT,
]


def evals(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if r.get("event") == "eval"}


def eval_cp(model_dir, out_dir, *overrides, config=TINY) -> dict:
    """scripts/eval_cp.py at cp 1 on one process, with the training run's data.* and eval.* values."""
    args = [
        "--config",
        config,
        f"model.name_or_path={model_dir}",
        "model.config={}",
        f"checkpoint.dir={out_dir}",
    ]
    run("eval_cp.py", [*args, *overrides], nproc=0)
    with open(os.path.join(out_dir, "eval_results.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Short documents, so packed rows hold several and a document mask matters: training and held-out."""
    root = tmp_path_factory.mktemp("documents")
    return write_short_documents(root / "train.jsonl"), write_short_documents(root / "held_out.jsonl", seed=1)


@pytest.mark.parametrize(
    "nproc,overrides",
    [
        (0, []),
        pytest.param(2, [], marks=pytest.mark.compat),
        (4, ["parallelism.cp_size=2"]),
        (2, ["parallelism.cp_size=2", "data.document_mask=true"]),
    ],
    ids=["1rank", "2ranks", "dp2xcp2", "cp2-document-mask"],
)
def test_the_eval_loss_logged_in_training_is_what_eval_cp_measures(tmp_path, documents, nproc, overrides):
    data = list(HELD_OUT)
    if "data.document_mask=true" in overrides:
        data = [f"data.dataset={documents[0]}", f"data.eval_dataset={documents[1]}", *data[1:]]
        data.append("data.document_mask=true")
    records = pretrain(tmp_path, *EVALUATED, *data, *overrides, nproc=nproc)
    logged = evals(records)
    assert sorted(logged) == [0, 2, 4, 5]  # before training, every eval.interval steps, the last step
    assert logged[5]["eval_loss"] < logged[0]["eval_loss"]
    for step in (2, 5):
        measured = eval_cp(tmp_path / "checkpoints" / f"step-{step}", tmp_path / f"eval{step}", *data)
        assert measured["tokens"] == logged[step]["tokens"]  # counted once, whatever the cp size
        assert measured["eval_loss"] == pytest.approx(logged[step]["eval_loss"], abs=1e-5)


# A run evaluated at every step, whose held-out loss falls all the way: by less and less after step 4.
EVERY_STEP = ["train.steps=8", "eval.interval=1", *HELD_OUT, "checkpoint.export=false"]


@pytest.fixture(scope="module")
def evaluated_every_step(tmp_path_factory) -> list[dict]:
    return pretrain(tmp_path_factory.mktemp("every_step"), *EVERY_STEP)


def test_evaluating_changes_nothing_in_training(tmp_path, evaluated_every_step):
    plain = pretrain(tmp_path / "plain", "train.steps=8", "checkpoint.export=false")
    evaluated = evaluated_every_step
    assert len(evals(evaluated)) == 9
    assert losses(evaluated) == losses(plain)  # exactly
    assert [r["grad_norm"] for r in steps(evaluated)] == [r["grad_norm"] for r in steps(plain)]


def test_the_moe_recipe_logs_what_eval_cp_measures_at_ep_2(tmp_path):
    overrides = ["train.steps=4", "eval.interval=2", "eval.max_sequences=8", "parallelism.ep_size=2"]
    run("finetune_moe_ep_fsdp.py", ["--config", MOE, f"checkpoint.dir={tmp_path}", *overrides], nproc=2)
    logged = evals(read_metrics(tmp_path))
    assert sorted(logged) == [0, 2, 4]
    measured = eval_cp(
        tmp_path / "checkpoints" / "step-4", tmp_path / "eval", "eval.max_sequences=8", config=MOE
    )
    assert measured["tokens"] == logged[4]["tokens"]
    assert measured["eval_loss"] == pytest.approx(logged[4]["eval_loss"], abs=1e-5)


def test_the_embedded_held_out_set_is_never_in_the_training_slice():
    cfg = load_config(TINY)
    training = {path for path, _ in embedded_files(cfg.data.embedded_max_bytes)}
    held_out = {path for path, _ in embedded_files(cfg.data.embedded_max_bytes, held_out=True)}
    assert training and held_out and not training & held_out
    assert len(held_out) > 20  # enough files for eval.max_sequences rows at the shipped sizes


# Early stopping: a run whose held-out loss must rise. It learns a small set of word salad fast, at a high
# learning rate, and is evaluated on Python source (the embedded held-out files).
RISING = [
    "train.steps=40",
    "train.lr=0.01",
    "train.warmup_steps=0",
    "eval.interval=2",
    "checkpoint.interval=2",
    "checkpoint.keep_latest=1",
    "checkpoint.load_best_model_at_end=true",
    "eval.early_stopping_patience=3",
    *HELD_OUT,
]


@pytest.fixture(scope="module")
def early_stopped(tmp_path_factory, documents):
    run_dir = tmp_path_factory.mktemp("early_stopped")
    return run_dir, pretrain(run_dir, *RISING, f"data.dataset={documents[0]}")


def predicted_stop(
    losses_by_step: dict[int, float], patience: int, threshold: float = 0.0, last: int = 0
) -> tuple[int | None, int]:
    """(the step early stopping stops at, or None; the step with the lowest eval_loss up to there), by the
    Trainer's rule (EarlyStoppingCallback): an evaluation improves if it is below the lowest so far by more
    than the threshold. At the `last` step the run ends anyway."""
    best, best_step, without = None, None, 0
    for step, loss in sorted(losses_by_step.items()):
        if step == 0:
            continue
        without = 0 if best is None or best - loss > threshold else without + 1
        if best is None or loss < best:
            best, best_step = loss, step
        if without >= patience and step != last:
            return step, best_step
    return None, best_step


def test_early_stopping_stops_where_patience_says_and_exports_the_best_step(tmp_path, early_stopped):
    run_dir, records = early_stopped
    logged = {step: r["eval_loss"] for step, r in evals(records).items()}
    stop_step, best_step = predicted_stop(logged, patience=3)
    assert stop_step, f"the held-out loss never stopped improving: {logged}"
    stopped = event(records, "stopped")
    assert (stopped["step"], stopped["reason"]) == (stop_step, "early stopping")
    assert stopped["best"]["step"] == best_step and best_step < stop_step
    assert steps(records)[-1]["step"] == stop_step
    # keep_latest=1 keeps the newest checkpoint and the best one.
    assert sorted(os.listdir(run_dir / "checkpoints")) == [f"step-{best_step}", f"step-{stop_step}"]
    with open(run_dir / "checkpoints" / f"step-{stop_step}" / "train_state.json") as f:
        assert json.load(f)["best"] == {
            "step": best_step,
            "eval_loss": logged[best_step],
            "lowest_eval_loss": logged[best_step],
            "evals_without_improvement": 3,
        }
    # The export holds the best step's weights, bit for bit, and scores its eval_loss.
    exported = load_file(run_dir / "export" / "model.safetensors")
    best = {f"model.{name}": torch.empty_like(tensor) for name, tensor in exported.items()}
    dcp.load(best, checkpoint_id=str(run_dir / "checkpoints" / f"step-{best_step}"))
    assert all(torch.equal(exported[name], best[f"model.{name}"]) for name in exported)
    measured = eval_cp(run_dir / "export", tmp_path / "eval", *HELD_OUT)
    assert measured["eval_loss"] == pytest.approx(logged[best_step], abs=1e-5)


def improvements(losses_by_step: dict[int, float]) -> list[float]:
    """By how much each evaluation after the first went below the lowest before it (step 0 is a baseline)."""
    out, lowest = [], None
    for step, loss in sorted(losses_by_step.items()):
        if step == 0:
            continue
        if lowest is not None and loss < lowest:
            out.append(lowest - loss)
        lowest = loss if lowest is None else min(lowest, loss)
    return sorted(out)


def threshold_that_stops(losses_by_step: dict[int, float], patience: int, last: int) -> float:
    """The smallest threshold, halfway between two of the run's improvements (no float near a boundary),
    that stops it before its last step: the improvements below it count against the patience."""
    found = improvements(losses_by_step)
    for low, high in zip(found, [*found[1:], 2 * found[-1]]):
        if predicted_stop(losses_by_step, patience, (low + high) / 2, last)[0]:
            return (low + high) / 2
    raise AssertionError(f"no threshold stops this run early: {losses_by_step}")


def predicted_best(losses_by_step: dict[int, float], checkpoint_interval: int, last: int, end: int) -> int:
    """The step load_best_model_at_end exports, by the Trainer's rule: of the steps it checkpoints at (the
    multiples of checkpoint.interval and the last step), the last whose eval_loss was below every earlier
    evaluation's; with none, the weights it ends with (at `end`)."""
    lowest, best = None, None
    for step, loss in sorted(losses_by_step.items()):
        if step == 0 or step > end:
            continue
        if (lowest is None or loss < lowest) and (step % checkpoint_interval == 0 or step == last):
            best = step
        lowest = loss if lowest is None else min(lowest, loss)
    return end if best is None else best


@pytest.fixture(scope="module")
def thresholded(tmp_path_factory, evaluated_every_step):
    """The run evaluated at every step again, with early stopping on a threshold above its smallest
    improvements, and the best model on checkpoints that, as the Trainer allows, come only every few
    evaluations and miss the one with the lowest eval_loss: (run dir, records, the straight run's eval
    losses, the threshold, checkpoint.interval)."""
    logged = {step: r["eval_loss"] for step, r in evals(evaluated_every_step).items()}
    threshold = threshold_that_stops(logged, patience=2, last=8)
    lowest_step = predicted_stop(logged, patience=2, threshold=threshold, last=8)[1]
    interval = next(n for n in range(2, 9) if lowest_step % n)  # a multiple of eval.interval, 1
    run_dir = tmp_path_factory.mktemp("thresholded")
    early = ["eval.early_stopping_patience=2", f"eval.early_stopping_threshold={threshold!r}"]
    best = [
        f"checkpoint.interval={interval}",
        "checkpoint.keep_latest=1",
        "checkpoint.load_best_model_at_end=true",
    ]
    records = pretrain(run_dir, *EVERY_STEP, *early, *best, "checkpoint.export=true")
    return run_dir, records, logged, threshold, interval


def test_an_improvement_within_the_threshold_counts_against_the_patience(thresholded):
    """A run whose held-out loss falls at every step never stops early on patience alone; with
    eval.early_stopping_threshold above its smallest improvements it stops where the Trainer's rule with
    the threshold says, having evaluated what the straight run did up to there."""
    _, records, logged, threshold, _ = thresholded
    assert predicted_stop(logged, patience=2, last=8)[0] is None, logged
    stop_step, _ = predicted_stop(logged, patience=2, threshold=threshold, last=8)
    stopped = event(records, "stopped")
    assert (stopped["step"], stopped["reason"]) == (stop_step, "early stopping")
    assert {step: r["eval_loss"] for step, r in evals(records).items()} == {
        step: loss for step, loss in logged.items() if step <= stop_step
    }


def test_with_fewer_checkpoints_than_evaluations_the_best_model_is_the_trainers(thresholded):
    """checkpoint.interval a multiple of eval.interval, as the Trainer asks of save_steps and eval_steps,
    and the lowest eval_loss off them (at the step early stopping stops at, whose checkpoint the Trainer does
    not write): the export is the checkpoint the Trainer's load_best_model_at_end loads, bit for bit, and
    keep_latest=1 keeps it beside the last."""
    run_dir, records, logged, threshold, interval = thresholded
    stop_step, lowest_step = predicted_stop(logged, patience=2, threshold=threshold, last=8)
    best_step = predicted_best(logged, interval, last=8, end=stop_step)
    assert lowest_step % interval and best_step != lowest_step  # the case a simpler rule gets wrong
    best = event(records, "stopped")["best"]
    assert (best["step"], best["eval_loss"], best["lowest_eval_loss"]) == (
        best_step,
        logged[best_step],
        logged[lowest_step],
    )
    assert sorted(os.listdir(run_dir / "checkpoints")) == sorted({f"step-{best_step}", f"step-{stop_step}"})
    exported = load_file(run_dir / "export" / "model.safetensors")
    weights = {f"model.{name}": torch.empty_like(tensor) for name, tensor in exported.items()}
    dcp.load(weights, checkpoint_id=str(run_dir / "checkpoints" / f"step-{best_step}"))
    assert all(torch.equal(exported[name], weights[f"model.{name}"]) for name in exported)


def test_early_stopping_killed_mid_patience_stops_at_the_same_step_with_the_same_export(
    tmp_path, documents, early_stopped
):
    """Killed (SIGKILL on rank 1) after the checkpoint that follows the best step's evaluation, with
    patience partly spent; torchrun restarts it, it resumes there and stops where the straight run did."""
    ref_dir, ref = early_stopped
    stop_step = event(ref, "stopped")["step"]
    killed_at = stop_step - 3  # odd: the last checkpoint is at killed_at - 1, one evaluation after the best
    assert event(ref, "stopped")["best"]["step"] < killed_at - 1
    run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", *RISING, f"data.dataset={documents[0]}"],
        nproc=2,
        launcher=[
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc_per_node=2",
            "--max_restarts=1",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0",
            "--rdzv_id=patience-test",
        ],
        extra_env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FSDP2_RECIPES_FAULT": f"kill@{killed_at}:1"},
        wrapper="with_faults.py",
    )
    records = read_metrics(tmp_path)
    assert [r["start_step"] for r in records if r.get("event") == "model_ready"] == [0, killed_at - 1]
    assert event(records, "stopped")["step"] == stop_step
    assert event(records, "stopped")["best"] == event(ref, "stopped")["best"]
    ours, theirs = (
        load_file(tmp_path / "export" / "model.safetensors"),
        load_file(ref_dir / "export" / "model.safetensors"),
    )
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


SFT_SHORT = [
    "train.steps=4",
    "eval.interval=0",
    "eval.early_stopping_patience=0",
    "checkpoint.load_best_model_at_end=false",
]


@pytest.fixture(scope="module")
def sft_one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sft1")
    return run_dir, pretrain(run_dir, *SFT_SHORT, "checkpoint.export=false", nproc=0, config=SFT)


@pytest.mark.parametrize(
    "nproc,overrides", [(2, []), (4, ["parallelism.cp_size=2"])], ids=["2ranks", "dp2xcp2"]
)
def test_dense_sft_on_any_layout_equals_one_process(tmp_path, sft_one_process, nproc, overrides):
    records = pretrain(tmp_path, *SFT_SHORT, "checkpoint.export=false", *overrides, nproc=nproc, config=SFT)
    assert losses(records) == pytest.approx(losses(sft_one_process[1]), abs=1e-5)


def test_dense_sft_counts_answer_tokens_only(sft_one_process):
    """The step's token count is the answer tokens of its rows (labels -100 on prompts and padding)."""
    _, records = sft_one_process
    cfg = load_config(SFT)
    path = sft_rows_path(cfg.data, load_tokenizer(cfg.data), cfg.data.dataset, cfg.data.split, is_main=True)
    t = cfg.train
    batches = SftBatches(path, 0, t.seed, t.global_batch_size, t.micro_batch_size, 0, 1).micro_batches(0)
    answers = sum(int((b.labels != -100).sum()) for b in batches)
    real = sum(int(b.token_mask.sum()) for b in batches)
    assert steps(records)[0]["tokens"] == answers < real  # prompts are real tokens but no targets
    rows = np.load(path)
    prompt = rows[0, 1][rows[0, 3] == 1]
    assert (prompt == -100).any() and (prompt != -100).any()


def test_debug_vlm_config_learns_the_held_out_shapes_and_exports_a_release(tmp_path):
    """The shipped image-text config (a Gemma 3 from scratch, the built-in shapes task made on the fly): the
    held-out loss falls below a quarter of its step-0 value, and the export loads in AutoProcessor and
    AutoModelForImageTextToText and answers a held-out image in the task's form."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from common.data.image_records import COLOURS, shape_records

    config = os.path.join(REPO, "configs", "debug_vlm.json")
    run("pretrain_fsdp.py", ["--config", config, f"checkpoint.dir={tmp_path / 'run'}"], nproc=2, timeout=600)
    logged = {step: r["eval_loss"] for step, r in evals(read_metrics(tmp_path / "run")).items()}
    assert logged[max(logged)] < 0.25 * logged[0], logged
    export = tmp_path / "run" / "export"
    processor, model = (
        AutoProcessor.from_pretrained(export),
        AutoModelForImageTextToText.from_pretrained(export),
    )
    record = shape_records("test")[0]  # held out: the test split is drawn apart from the training one
    prompt = processor.apply_chat_template(record["messages"][:1], add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[record["images"]], return_tensors="pt")
    answer = model.generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    words = processor.tokenizer.decode(answer, skip_special_tokens=True).split()
    assert len(words) == 3 and words[0] == "a" and words[1] in COLOURS, words


def test_an_image_text_release_trains_on_text_with_accumulation_in_bf16(tmp_path):
    """Text rows never run the vision blocks' forward. With gradient accumulation and an fp32 reduce dtype,
    torch's FSDP2 still reads each unit's unsharded parameter after backward, which fails for a unit never
    gathered: materialise gathers the vision units once (common/image_text.py)."""
    config = os.path.join(REPO, "configs", "debug_vlm.json")  # its vision tower and projector trained
    mixed = '{"param_dtype": "bfloat16", "reduce_dtype": "float32"}'
    args = ["--config", config, "data.dataset=embedded", "eval.interval=0", "train.steps=2"]
    args += ["train.global_batch_size=8", "train.micro_batch_size=2", f"fsdp.mixed_precision={mixed}"]
    run("pretrain_fsdp.py", [*args, "checkpoint.export=false", f"checkpoint.dir={tmp_path}"], nproc=2)
    logged = steps(read_metrics(tmp_path))
    assert [r["step"] for r in logged] == [1, 2] and all(np.isfinite(r["loss"]) for r in logged), logged


def test_debug_sft_config_learns_the_held_out_task_and_exports_a_chat_model(tmp_path):
    """The shipped config, fine-tuning with a chat template: the held-out loss falls below half its
    step-0 value, and the export keeps the template and answers a held-out prompt with generate()."""
    template_dir = tmp_path / "tokenizer"
    tokenizer = load_tokenizer(DataConfig())
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}"
        "{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer.save_pretrained(template_dir)
    run(
        "pretrain_fsdp.py",
        ["--config", SFT, f"checkpoint.dir={tmp_path / 'run'}", f"data.tokenizer={template_dir}"],
        nproc=2,
        timeout=600,
    )
    logged = {step: r["eval_loss"] for step, r in evals(read_metrics(tmp_path / "run")).items()}
    assert min(loss for step, loss in logged.items() if step) < 0.5 * logged[0], logged
    export = tmp_path / "run" / "export"
    exported = AutoTokenizer.from_pretrained(export)
    assert exported.chat_template == tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(export)
    question = arithmetic_examples("test")[0]["prompt"]  # held out: never trained on
    assert question not in {example["prompt"] for example in arithmetic_examples("train")}
    prompt = exported.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    answer = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :]
    text = exported.decode(answer, skip_special_tokens=True).strip()
    assert text and text.removeprefix("-").isdigit(), text  # an answer, in the task's form
