"""LoRA with FSDP2: adapters sharded with the frozen base, one-process parity on any layout, only the adapters
train and hold optimizer state, small checkpoints that resume exactly (also on another world size), and
exports that PEFT and plain Transformers load with the trained model's outputs."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from with_sample_log import read_sample_log

from common.data.train_batches import build_batches
from common.ops.config_sources import load_config
from launch import (
    REPO,
    TINY,
    each_rank,
    event,
    losses,
    pretrain,
    read_metrics,
    run,
    run_command,
    steps,
    torchrun,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A small pretrained model to fine-tune: debug_tiny after a few steps, exported in fp32."""
    run_dir = tmp_path_factory.mktemp("base")
    pretrain(run_dir, "train.steps=3", nproc=0)
    return str(run_dir / "export")


def lora_args(base: str, *more: str) -> list[str]:
    """The SFT task on `base` with rank-4 adapters on every linear layer of the decoder."""
    data = [
        f"model.name_or_path={base}",
        "model.config={}",
        f"data.tokenizer={base}",
        "data.dataset=arithmetic",
    ]
    return [*data, "lora.r=4", "lora.alpha=8", "train.steps=6", "checkpoint.interval=3", *more]


def adapters(checkpoint) -> dict:
    """The adapter tensors of a training checkpoint, read with DCP."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith("model.")
    }
    dcp.load(state, checkpoint_id=str(checkpoint))
    return state


def grad_norms(records: list[dict]) -> list[float]:
    return [r["grad_norm"] for r in steps(records)]


def assert_same_adapters(run_dir, ref_dir, step: int = 6) -> None:
    """The adapters of two runs' step checkpoints, within 1e-5 (reduction-order rounding)."""
    ours, theirs = (
        adapters(run_dir / "checkpoints" / f"step-{step}"),
        adapters(ref_dir / "checkpoints" / f"step-{step}"),
    )
    assert ours.keys() == theirs.keys() and ours and all(".lora_" in k for k in ours)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-5


def assert_export_is_the_checkpoint(run_dir, checkpoint: str) -> None:
    """The PEFT adapter export holds exactly the adapters of `checkpoint`, under PEFT's names."""
    exported = load_file(run_dir / "export" / "adapter_model.safetensors")
    peft_name = lambda k: "base_model.model." + k.removeprefix("model.").replace(".default", "")  # noqa: E731
    trained = {peft_name(k): v for k, v in adapters(run_dir / "checkpoints" / checkpoint).items()}
    assert exported.keys() == trained.keys() and trained
    assert all(torch.equal(exported[k], trained[k]) for k in exported)


HSDP = ["parallelism.dp_replicate_size=2", "parallelism.dp_shard_size=2"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, base):
    run_dir = tmp_path_factory.mktemp("lora1")
    return run_dir, pretrain(run_dir, *lora_args(base), nproc=0)


@pytest.fixture(scope="module")
def four_ranks_merged(tmp_path_factory, base):
    """4 ranks exporting the merged model: every rank's share of the adapters folded into the base."""
    run_dir = tmp_path_factory.mktemp("lora4")
    return run_dir, pretrain(run_dir, *lora_args(base, "lora.merge_on_export=true"), nproc=4)


@pytest.mark.parametrize(
    "nproc,overrides",
    [
        pytest.param(2, [], marks=pytest.mark.compat),
        (4, "merged"),
        (4, ["parallelism.cp_size=2"]),
        (4, [*HSDP, "fsdp.activation_checkpointing=true"]),
    ],
    ids=["2ranks", "4ranks-merged-export", "dp2xcp2", "hsdp2x2-ac"],
)
def test_lora_on_any_layout_equals_one_process(request, tmp_path, base, one_process, nproc, overrides):
    ref_dir, ref = one_process
    if overrides == "merged":
        tmp_path, records = request.getfixturevalue("four_ranks_merged")
    else:
        records = pretrain(tmp_path, *lora_args(base, *overrides), nproc=nproc)
    assert losses(records) == pytest.approx(losses(ref), abs=1e-5)
    assert grad_norms(records) == pytest.approx(grad_norms(ref), abs=1e-5)  # the adapters' gradients
    assert_same_adapters(tmp_path, ref_dir)
    if overrides == []:  # accelerate#4206: the adapter export of 2 ranks holds every rank's share, exactly
        assert_export_is_the_checkpoint(tmp_path, "step-6")


def test_only_the_adapters_train_and_hold_state_and_gradients(tmp_path, base, one_process):
    """The optimizer holds the adapters alone (2 AdamW moments x 4 bytes each), the reduce-scatters carry
    the adapters' gradients alone, and the checkpoint holds no frozen weight: 3 x the adapter bytes."""
    run_dir, records = one_process
    trainable = event(records, "model_ready")["trainable_params"]
    assert 0 < trainable < event(records, "model_ready")["params"] / 10
    assert (
        sum(r["optimizer_bytes"] for r in event(records, "final")["state_bytes_per_rank"])
        == 2 * 4 * trainable
    )
    two_ranks = pretrain(tmp_path, *lora_args(base, "train.steps=1", "metrics.comm_stats=true"), nproc=2)
    assert steps(two_ranks)[-1]["reduce_scatter_bytes"] == 4 * trainable  # fp32 gradients, adapters only
    metadata = (
        dcp.FileSystemReader(str(run_dir / "checkpoints" / "step-6")).read_metadata().state_dict_metadata
    )
    tensors = {
        k: m.size.numel() * m.properties.dtype.itemsize
        for k, m in metadata.items()
        if not k.startswith("rng.")
    }
    assert all(".lora_" in k for k in tensors)  # model.* and optim.*, adapters only
    steps_taken = {k: v for k, v in tensors.items() if k.endswith(".step")}  # AdamW's scalar step counts
    assert set(steps_taken.values()) == {4}
    assert sum(tensors.values()) - sum(steps_taken.values()) == 3 * 4 * trainable
    logged = [r for r in records if r.get("event") == "checkpoint"][-1]
    assert logged["bytes"] < 4 * event(records, "model_ready")["params"]  # smaller than the fp32 model


# Two training steps on 2 ranks with the recipe's own pieces; every rank checks its base and adapters.
ONLY_ADAPTERS = f"""
import os, sys
sys.path.insert(0, {REPO!r})
import torch, torch.distributed as dist
from common import lora
from common.config import Config, FsdpConfig, LoraConfig, ModelConfig
from common.mesh import build_dp_mesh
from common.model import build_meta_model, load_model_config, materialise
from common.ops.cli import end_process
from common.optim import build_optimizer
from common.load_weights import load_or_init_weights
from common.wrap import apply_fsdp
dist.init_process_group("gloo")
cfg = Config(model=ModelConfig(name_or_path=sys.argv[1]), lora=LoraConfig(r=4))
model = build_meta_model(load_model_config(cfg.model), cfg.model)
lora.add_adapters(model, cfg.lora, "cpu")
apply_fsdp(model, build_dp_mesh("cpu", 1, 2), FsdpConfig(), "cpu")
materialise(model, torch.device("cpu"))
load_or_init_weights(model, cfg)
before = {{n: p.detach().to_local().clone() for n, p in model.named_parameters() if not p.requires_grad}}
optimizer = build_optimizer(model, cfg, torch.device("cpu"))
ids = torch.randint(0, 4000, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
for _ in range(2):
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {{n: p.grad for n, p in model.named_parameters()}}
    optimizer.step()
    optimizer.zero_grad()
params = dict(model.named_parameters())
frozen_same = all(torch.equal(params[n].detach().to_local(), before[n]) for n in before)
adapters_learn = all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if ".lora_" in n)
no_frozen_grad = all(g is None for n, g in grads.items() if n in before)
in_optimizer = {{id(p) for group in optimizer.param_groups for p in group["params"]}}
only_adapters = in_optimizer == {{id(p) for n, p in model.named_parameters() if ".lora_" in n}}
verdicts = f"{{frozen_same}} {{adapters_learn}} {{no_frozen_grad}} {{only_adapters}}"
os.write(1, f"rank {{dist.get_rank()}}: {{verdicts}}\\n".encode())
dist.destroy_process_group()
end_process(0)  # DTensor's meshes keep gloo threads that can abort interpreter teardown (common/ops/cli.py)
"""


def test_the_base_stays_bit_identical_and_every_adapter_gets_a_gradient(tmp_path, base):
    script = tmp_path / "only_adapters.py"
    script.write_text(ONLY_ADAPTERS)
    proc = run_command([*torchrun(2), str(script), base], timeout=180)
    assert sorted(proc.stdout.split("\n")[:-1]) == [f"rank {r}: True True True True" for r in (0, 1)]


def test_lora_stop_and_resume_is_bit_identical(tmp_path, base, one_process):
    ref_dir, ref = one_process
    first = pretrain(tmp_path, *lora_args(base, "train.stop_after=3"), nproc=2)
    resumed = pretrain(tmp_path, *lora_args(base), nproc=2)[len(first) :]
    assert event(resumed, "model_ready")["start_step"] == 3
    assert losses(resumed) == pytest.approx(losses(ref)[3:], abs=1e-5)
    straight = pretrain(tmp_path / "straight", *lora_args(base), nproc=2)
    assert losses(resumed) == losses(straight)[3:]  # exactly, the same world size
    ours, theirs = (
        load_file(tmp_path / "export" / "adapter_model.safetensors"),
        load_file(tmp_path / "straight" / "export" / "adapter_model.safetensors"),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_lora_resumes_on_fewer_ranks_without_repeating_or_skipping_a_sample(tmp_path, base, one_process):
    """3 steps on 4 ranks, then 3 more on 2: the same samples, the same losses, gradient norms and final
    adapters as one process (within reduction-order rounding)."""
    ref_dir, ref = one_process
    logged = dict(wrapper="with_sample_log.py", extra_env={"SAMPLE_LOG": str(tmp_path / "samples")})
    pretrain(tmp_path, *lora_args(base, "train.stop_after=3"), nproc=4, **logged)
    records = pretrain(tmp_path, *lora_args(base), nproc=2, **logged)
    resumed = [r for r in records if r.get("event") == "model_ready"]
    assert (resumed[-1]["world_size"], resumed[-1]["start_step"]) == (2, 3)
    consumed = read_sample_log(str(tmp_path / "samples"))
    assert sorted(consumed) == [step * 8 for step in range(6)]
    assert all(sorted(samples) == list(range(first, first + 8)) for first, samples in consumed.items())
    assert [r["step"] for r in steps(records)] == list(range(1, 7))
    assert losses(records) == pytest.approx(losses(ref), abs=1e-5)
    assert grad_norms(records) == pytest.approx(grad_norms(ref), abs=1e-5)
    assert_same_adapters(tmp_path, ref_dir)


def fixed_batch(base: str):
    cfg = load_config(TINY, [f"data.tokenizer={base}", "data.dataset=arithmetic"])
    return build_batches(cfg.data, cfg.train, 0, 1, is_main=True)[1].fixed_batch(cfg.train.micro_batch_size)


def batch_logits(model, batch) -> torch.Tensor:
    with torch.no_grad():  # no KV cache: it would switch off Transformers' packed-sequence masks
        return model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits


def batch_loss(model, batch) -> float:
    logits = batch_logits(model, batch)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).item()


def test_peft_and_transformers_load_the_exports_with_the_trained_outputs(
    base, one_process, four_ranks_merged
):
    """The adapter export (trained on 1 process) through PeftModel.from_pretrained, and the merged export
    (trained on 4 ranks: every rank's share of the adapters) through plain from_pretrained, give the trained
    model's fixed-batch loss, and not the base's."""
    run_dir, records = one_process
    merged_dir, merged_records = four_ranks_merged
    batch = fixed_batch(base)
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), str(run_dir / "export")
    )
    saved = load_file(run_dir / "export" / "adapter_model.safetensors")
    wanted = get_peft_model_state_dict(peft_model)  # every adapter key PEFT expects, no other
    assert set(saved) == set(wanted) and wanted
    assert not os.path.exists(run_dir / "export" / "model.safetensors")  # adapters only
    merged, info = AutoModelForCausalLM.from_pretrained(merged_dir / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    trained = event(records, "final")["fixed_batch_loss"]
    assert batch_loss(peft_model.eval(), batch) == pytest.approx(trained, abs=1e-5)
    assert batch_loss(merged.eval(), batch) == pytest.approx(
        event(merged_records, "final")["fixed_batch_loss"], abs=1e-5
    )
    assert batch_loss(merged.eval(), batch) == pytest.approx(trained, abs=1e-5)
    torch.testing.assert_close(
        batch_logits(peft_model, batch), batch_logits(merged, batch), rtol=0, atol=1e-5
    )
    assert abs(batch_loss(AutoModelForCausalLM.from_pretrained(base).eval(), batch) - trained) > 1e-3


def test_the_cuda_default_a_bf16_base_composes_with_mixed_precision_ac_hsdp_and_compile(tmp_path, base):
    """As on a GPU: the frozen base in bf16 beside fp32 adapters in the same FSDP units, bf16 compute,
    activation checkpointing, HSDP 2 x 2 and compiled layers. The base is stored in bf16 (2 bytes a
    weight), the adapters and their AdamW state in fp32, the export holds the last checkpoint's adapters
    exactly, and PEFT's load of it scores nearer the trained model than the base does."""
    bf16 = ['fsdp.mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"}']
    bf16 += ["lora.base_dtype=bfloat16", "fsdp.activation_checkpointing=true", "train.compile=true", *HSDP]
    records = pretrain(tmp_path, *lora_args(base, *bf16, "train.steps=3"), nproc=4, timeout=600)
    ready, final = event(records, "model_ready"), event(records, "final")
    trainable, frozen = ready["trainable_params"], ready["params"] - ready["trainable_params"]
    for state in final["state_bytes_per_rank"]:  # sharded over dp_shard 2
        assert state["param_bytes"] == (2 * frozen + 4 * trainable) // 2
        assert state["optimizer_bytes"] == 2 * 4 * trainable // 2
    assert all(b < a for a, b in zip(losses(records), losses(records)[1:]))  # it learns
    assert_export_is_the_checkpoint(tmp_path, "step-3")  # fp32 adapters gathered from 2 x 2 ranks
    batch, trained = fixed_batch(base), final["fixed_batch_loss"]
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), str(tmp_path / "export")
    )
    loaded = batch_loss(peft_model.eval(), batch)
    untrained = batch_loss(AutoModelForCausalLM.from_pretrained(base).eval(), batch)
    # fp32 here against bf16 compute in training: near the trained loss, and nearer than the base
    assert abs(loaded - trained) < 0.05 and abs(loaded - trained) < abs(untrained - trained), (
        loaded,
        trained,
        untrained,
    )


def test_bad_lora_input_is_one_line_and_exit_2(tmp_path, base):
    """One line per rank, before any process group or memory."""
    nope = lora_args(base, 'lora.target_modules=["nope"]')
    for code, stderr in each_rank(
        "pretrain_fsdp.py", ["--config", TINY, f"checkpoint.dir={tmp_path}", *nope]
    ):
        lines = [line for line in stderr.splitlines() if "config error" in line]
        assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
        assert (
            "lora.target_modules ['nope'] match no module of this model; its linear modules are: " in lines[0]
        )
        assert "q_proj" in lines[0] and "down_proj" in lines[0]
    one = run(
        "pretrain_fsdp.py", ["--config", TINY, f"checkpoint.dir={tmp_path}", *nope], nproc=0, check=False
    )
    assert one.returncode == 2 and len(one.stderr.strip().splitlines()) == 1
    negative = ["--config", TINY, f"checkpoint.dir={tmp_path}", "lora.r=-1"]
    proc = run("pretrain_fsdp.py", negative, nproc=0, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "config error: lora.r is -1; it must be >= 0"
    ]
    assert not os.listdir(tmp_path)


def test_lora_without_a_pretrained_model_warns_once(tmp_path):
    proc = run(
        "pretrain_fsdp.py",
        ["--config", TINY, f"checkpoint.dir={tmp_path}", "lora.r=4", "train.steps=1"],
        nproc=2,
    )
    assert proc.stderr.count("the adapters train on a randomly initialised, frozen base") == 1
    assert read_metrics(tmp_path)[-1]["event"] == "exported"


def test_debug_lora_without_the_quickstart_export_says_to_run_the_quickstart_first(tmp_path):
    missing = tmp_path / "runs" / "debug_llama" / "export"
    args = [
        "--config",
        os.path.join(REPO, "configs", "debug_lora.json"),
        f"checkpoint.dir={tmp_path / 'run'}",
    ]
    proc = run(
        "pretrain_fsdp.py",
        [*args, f"model.name_or_path={missing}", f"data.tokenizer={missing}"],
        nproc=0,
        check=False,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "it is the export of a run not trained here yet" in lines[0] and "quickstart command" in lines[0]
