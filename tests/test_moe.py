"""finetune_moe_ep_fsdp.py: EP x FSDP2 (x TP, x HSDP) parity, expert placement, exact resume, HF round trip,
fsdp keys, bad input, and a fine-tune that really learns."""

import json
import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MixtralConfig, Qwen3MoeConfig

from common.config import ConfigError, ParallelismConfig
from common.data.sft import arithmetic_examples, build_rows, tokenize_example
from common.model import build_meta_model, load_model_config
from common.ops.config_sources import load_config
from launch import (
    REPO,
    anonymous_rise,
    anonymous_rises,
    assert_same_weights,
    each_rank,
    event,
    host_memory_env,
    losses,
    read_metrics,
    run,
    save_release,
    steps,
)

MOE = os.path.join(REPO, "configs", "debug_moe.json")
TINY = dict(
    vocab_size=4096,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
SHORT = [
    "train.steps=6",
    "metrics.log_every=1",
    "eval.max_sequences=8",
    "checkpoint.resume=none",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
]
LAYOUTS = {  # (world size, overrides): the layouts, plus TP
    "fsdp4-ep1": (4, ["parallelism.fsdp_size=4"]),
    "fsdp4-ep2": (4, ["parallelism.fsdp_size=4", "parallelism.ep_size=2", "checkpoint.interval=3"]),
    "fsdp4-ep4": (
        4,
        ["parallelism.fsdp_size=4", "parallelism.ep_size=4", "fsdp.cpu_ram_efficient_loading=true"],
    ),
    "hsdp2x2-ep2": (
        4,
        ["parallelism.dp_replicate_size=2", "parallelism.fsdp_size=2", "parallelism.ep_size=2"],
    ),
    "fsdp2-tp2-ep2": (
        4,
        [
            "parallelism.fsdp_size=2",
            "parallelism.tp_size=2",
            "parallelism.ep_size=2",
        ],
    ),
}


def save_tiny(path, kind: str, experts: int = 8) -> str:
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(
            **TINY,
            intermediate_size=128,
            moe_intermediate_size=32,
            head_dim=16,
            num_experts=experts,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.01,
        )
    else:
        config = MixtralConfig(**TINY, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    return save_release(AutoModelForCausalLM.from_config(config), path)


def finetune(run_dir, model_dir, *overrides, nproc=4, **kwargs) -> list[dict]:
    args = [
        "--config",
        MOE,
        f"checkpoint.dir={run_dir}",
        f"model.name_or_path={model_dir}",
        "model.config={}",
        *SHORT,
    ]
    run("finetune_moe_ep_fsdp.py", [*args, *overrides], nproc=nproc, **kwargs)
    return read_metrics(run_dir)


def weights(run_dir) -> dict:
    return load_file(os.path.join(run_dir, "export", "model.safetensors"))


def assert_close_steps(got: list[dict], want: list[dict], tol: float) -> None:
    for key in ("loss", "grad_norm", "router_aux_loss"):
        a, b = [r[key] for r in steps(got)], [r[key] for r in steps(want)]
        assert len(a) == len(b) == 6 and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b)), (
            key,
            a,
            b,
        )


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, qwen):
    run_dir = tmp_path_factory.mktemp("moe_reference")
    return run_dir, finetune(run_dir, qwen, nproc=0)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, qwen):
    """Each layout run once, shared by the parity, placement, resume and export tests."""
    cache = {}

    def get(name):
        if name not in cache:
            nproc, overrides = LAYOUTS[name]
            run_dir = tmp_path_factory.mktemp(name)
            cache[name] = run_dir, finetune(run_dir, qwen, *overrides, nproc=nproc)
        return cache[name]

    return get


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.compat) if n == "fsdp4-ep2" else n for n in LAYOUTS]
)
def test_layout_matches_one_process_and_places_experts(name, reference, layouts):
    ref_dir, ref = reference
    run_dir, records = layouts(name)
    # Per-step loss, grad norm (catches an expert-gradient scaling error that AdamW would hide) and aux loss.
    assert_close_steps(records, ref, 1e-5)
    got, want = weights(run_dir), weights(ref_dir)
    assert got.keys() == want.keys()
    # After AdamW, which divides each update by its gradient's size: 1.5e-5 measured (fsdp2-tp2-ep2).
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 2e-5, worst
    layout = event(records, "model_ready")["expert_layout_per_rank"]
    ep = int(name.split("-ep")[1])
    if ep == 1:
        assert layout == [{}] * 4  # experts are ordinary layer parameters, FSDP-sharded over fsdp
        return
    efsdp = 4 // ep  # fsdp * tp / ep with fsdp * tp = 4 in every layout here
    for rank_layout in layout:
        assert rank_layout["mesh"] == (
            {"dp_replicate": 2, "efsdp": efsdp // 2, "ep": ep}
            if "hsdp" in name
            else {"efsdp": efsdp, "ep": ep}
        )
        assert rank_layout["placements"][-1] == "S(0)"  # whole experts split over ep: E/ep per rank...
        rows = rank_layout["global_shape"][0] // ep
        # ...then FSDP over efsdp
        assert rank_layout["local_shape"][0] == -(-rows // rank_layout["mesh"]["efsdp"])


def test_exact_resume_with_experts_on_their_own_mesh(tmp_path, qwen, layouts):
    straight_dir, straight = layouts("fsdp4-ep2")  # checkpoints at steps 3 and 6
    nproc, overrides = LAYOUTS["fsdp4-ep2"]
    first = finetune(tmp_path, qwen, *overrides, "train.stop_after=3")
    assert event(first, "stopped")["step"] == 3
    both = finetune(tmp_path, qwen, *overrides, "checkpoint.resume=auto")
    resumed = both[len(first) :]
    assert event(resumed, "model_ready")["start_step"] == 3
    assert losses(resumed) == losses(straight)[3:]
    a, b = weights(tmp_path), weights(straight_dir)
    assert all(torch.equal(a[k], b[k]) for k in b)


def fixed_batch_loss_in_transformers(export_dir: str, size: int = 2) -> tuple[float, dict]:
    """The script's fixed batch (first SFT rows), scored by plain Transformers from the export."""
    model, info = AutoModelForCausalLM.from_pretrained(
        export_dir, dtype=torch.float32, output_loading_info=True
    )
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    examples = [tokenize_example(tokenizer, e) for e in arithmetic_examples("train")[:200]]
    rows = torch.from_numpy(build_rows(examples, 64, True, tokenizer.pad_token_id)[:size]).long()
    with torch.no_grad():
        logits = model(input_ids=rows[:, 0], position_ids=rows[:, 2], use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1].flatten(), ignore_index=-100)
    return loss.item(), info


def test_full_export_loads_in_transformers_with_the_trained_logits(layouts):
    run_dir, records = layouts("fsdp4-ep2")
    loss, info = fixed_batch_loss_in_transformers(os.path.join(run_dir, "export"))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert abs(loss - event(records, "final")["fixed_batch_loss"]) < 1e-6
    on_disk = load_file(os.path.join(run_dir, "export", "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in on_disk  # per-expert tensors, the hub layout
    # The trained model itself is the last resume checkpoint (DCP, fused experts as trained): read it into a
    # plain model and compare logits with the export's, element by element.
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "export"), dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "export"), dtype=torch.float32)
    state = {"model": {k: torch.empty_like(v) for k, v in trained.state_dict().items()}}
    dcp.load(state, checkpoint_id=os.path.join(run_dir, "checkpoints", "step-6"))
    trained.load_state_dict(state["model"])
    ids = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=0, atol=1e-6
        )


def test_a_checkpoint_converts_to_the_runs_full_export_bit_for_bit(tmp_path, layouts):
    """scripts/convert_to_hf.py, one process, on the ep-2 run's last checkpoint: the fused experts split back
    per expert by Transformers' converter, the run's own FULL export's files, index and tensors."""
    run_dir, _ = layouts("fsdp4-ep2")
    run("convert_to_hf.py", [str(run_dir / "checkpoints" / "step-6"), str(tmp_path / "hf")], nproc=0)
    assert assert_same_weights(tmp_path / "hf", run_dir / "export") == 1


def test_mixtral_trains_with_ep_and_round_trips(tmp_path):
    model_dir = save_tiny(tmp_path / "mixtral", "mixtral")
    records = finetune(
        tmp_path / "run", model_dir, "parallelism.ep_size=2", "train.router_aux_loss_coef=0.02", nproc=2
    )
    assert event(records, "model_ready")["router_aux_loss_coef"] == 0.02
    assert all(r["loss"] > 0 and r["router_aux_loss"] > 0 for r in steps(records))
    loss, info = fixed_batch_loss_in_transformers(str(tmp_path / "run" / "export"))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert abs(loss - event(records, "final")["fixed_batch_loss"]) < 1e-6


def test_each_rank_reads_and_writes_only_its_experts(tmp_path):
    """A checkpoint of per-expert tensors, which Transformers fuses as it loads: each rank reads only its own
    experts' and fuses them with Transformers' converter, so loading raises no rank's anonymous memory by more
    than its share of the fp32 weights plus one fused weight plus 16 MiB. The FULL export splits them back,
    each rank writing its own experts (no rank rises by more than its share plus one output file), bit for
    bit the export rank 0 gathers and saves alone (which holds the whole model: the contrast), and
    Transformers reads it back with the loss the run measured."""
    torch.manual_seed(0)
    sizes = dict(TINY, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    config = Qwen3MoeConfig(
        **sizes, head_dim=64, moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2
    )
    model = AutoModelForCausalLM.from_config(config)
    numel, fused = model.num_parameters(), model.model.layers[0].mlp.experts.gate_up_proj.numel()
    save_release(model, tmp_path / "moe", max_shard_size="50MB")
    share_mib, fused_mib, file_mib = numel * 4 / 2 / 2**20, fused * 4 / 2**20, 50e6 / 2**20
    out = tmp_path / "mem"
    records = finetune(
        tmp_path / "run",
        tmp_path / "moe",
        "train.steps=0",
        "parallelism.ep_size=2",
        "checkpoint.max_shard_size=50MB",
        nproc=2,
        extra_env=host_memory_env(out, rank0_copy=tmp_path / "export-on-rank0"),
        wrapper="with_host_memory.py",
    )
    for rise in anonymous_rises(out, "load"):
        assert share_mib * 0.9 < rise <= share_mib + fused_mib + 16, rise
    for rise in anonymous_rises(out, "export"):
        assert rise <= share_mib + file_mib + 16, rise
    assert anonymous_rise(f"{out}.export_on_rank0.rank0.json") > 2 * share_mib
    assert assert_same_weights(tmp_path / "run" / "export", tmp_path / "export-on-rank0") == 7
    loss, info = fixed_batch_loss_in_transformers(str(tmp_path / "run" / "export"))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loss == pytest.approx(event(records, "final")["fixed_batch_loss"], abs=1e-5)


def test_fewer_local_experts_than_ranks_to_shard_them_over_still_split_evenly(tmp_path):
    """2 experts at ep 2 on 4 ranks: one expert per rank, FSDP over 2 ranks (Mixtral's 8 at ep 8 on 16 GPUs).
    Splitting dim 0 would leave one rank of each pair with every expert weight and the other with none."""
    model_dir = save_tiny(tmp_path / "two_experts", "qwen3_moe", experts=2)
    reference = finetune(tmp_path / "one", model_dir, nproc=0)
    records = finetune(tmp_path / "ep2", model_dir, "parallelism.ep_size=2")
    assert_close_steps(records, reference, 1e-5)
    got, want = weights(tmp_path / "ep2"), weights(tmp_path / "one")  # the FULL export gathers them right
    assert got.keys() == want.keys() and max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5
    layout = event(records, "model_ready")["expert_layout_per_rank"]
    assert {r["placements"][0] for r in layout} == {"S(1)"}  # efsdp splits a weight dim, not the experts
    assert [r["local_shape"] for r in layout] == [[1, 32, 64]] * 4  # gate_up [1, 64, 64], halved
    held = [s["param_bytes"] for s in event(records, "final")["state_bytes_per_rank"]]
    # The same share on every rank, up to FSDP's padding of the 2-row routers (512 bytes); dim 0 would
    # have put 49 kB of expert weights on one rank of each pair and none on the other.
    assert max(held) - min(held) <= 512, held
    # checkpoint.export_writers=one: each expert, written by one rank from its holder's copy, the same bytes
    finetune(tmp_path / "one_writer", model_dir, "parallelism.ep_size=2", "checkpoint.export_writers=one")
    assert assert_same_weights(tmp_path / "one_writer" / "export", tmp_path / "ep2" / "export") == 1
    ours, theirs = (tmp_path / name / "export" / "model.safetensors" for name in ("one_writer", "ep2"))
    assert ours.read_bytes() == theirs.read_bytes()


def test_fsdp_keys_keep_the_math_and_sharded_export_reloads(tmp_path, qwen, reference):
    """Selective AC (fsdp.ac_policy=op: the experts' all-to-all is recomputed in backward), SIZE_BASED_WRAP,
    no reshard and CPU offload on EP: same losses; the SHARDED export reloads."""
    keys = [
        "fsdp.activation_checkpointing=true",
        "fsdp.ac_policy=op",
        "fsdp.auto_wrap_policy=SIZE_BASED_WRAP",
        "fsdp.min_num_params=20000",
        "fsdp.reshard_after_forward=false",
        "fsdp.cpu_offload=true",
        "fsdp.state_dict_type=SHARDED_STATE_DICT",
    ]
    records = finetune(tmp_path / "run", qwen, "parallelism.ep_size=2", *keys, nproc=2)
    assert_close_steps(records, reference[1], 1e-5)
    export = tmp_path / "run" / "export"
    assert sorted(f for f in os.listdir(export) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    reloaded = finetune(tmp_path / "reload", str(export), "train.steps=0", nproc=0)
    assert event(reloaded, "final")["fixed_batch_loss"] == pytest.approx(
        event(records, "final")["fixed_batch_loss"], abs=1e-6
    )


def test_sync_each_batch_reduce_scatters_every_micro_batch_with_the_same_losses(tmp_path, qwen):
    """8 sequences / 2 data-parallel ranks / micro-batch 2: 2 micro-batches a step. train.sync_each_batch
    reduce-scatters after each, twice the calls and bytes of once per step, to the same gradients."""
    two_micro = ["parallelism.ep_size=2", "train.steps=2", "metrics.comm_stats=true"]
    two_micro.append("checkpoint.export=false")
    once = finetune(tmp_path / "once", qwen, *two_micro, nproc=2)
    each = finetune(tmp_path / "each", qwen, *two_micro, "train.sync_each_batch=true", nproc=2)
    assert [r["loss"] for r in steps(each)] == pytest.approx([r["loss"] for r in steps(once)], abs=1e-6)
    for key in ("reduce_scatter_calls", "reduce_scatter_bytes"):
        assert [r[key] for r in steps(each)] == [2 * r[key] for r in steps(once)], key


def test_bf16_mixed_precision_and_no_wrap(tmp_path, qwen, reference):
    records = finetune(
        tmp_path,
        qwen,
        "parallelism.ep_size=2",
        "fsdp.mixed_precision=bf16",
        "fsdp.auto_wrap_policy=NO_WRAP",
        nproc=2,
    )
    assert event(records, "model_ready")["fsdp_units"] == 3  # two expert units on the expert mesh + the root
    got, want = losses(records), losses(reference[1])
    assert all(abs(a - b) < 0.05 * b for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize(
    "sizes,world,message",
    [
        (dict(ep_size=2), 1, "parallelism.ep_size (2) does not divide fsdp_size x tp_size (1 x 1)"),
        (dict(ep_size=3, fsdp_size=3), 3, "parallelism.ep_size (3) does not divide the model's 8 experts"),
        (dict(tp_size=2, fsdp_size=1), 2, "parallelism.ep_size (1) is not a multiple of tp_size (2)"),
        (dict(fsdp_size=3), 4, "does not cover the world size 4"),
        (dict(dp_shard_size=2), 2, "set parallelism.fsdp_size instead"),
    ],
)
def test_layout_errors_name_the_key_and_the_fix(sizes, world, message):
    """The recipe's own check_config, on debug_moe.json's 8-expert model, before any process group."""
    cfg = load_config(MOE)
    cfg.parallelism = ParallelismConfig(**sizes)
    model = build_meta_model(load_model_config(cfg.model), cfg.model)
    with pytest.raises(ConfigError, match=re.escape(message)):
        moe_script().check_config(cfg, world, model)


def test_lora_is_refused_with_the_reason():
    cfg = load_config(MOE, ["lora.r=4"])
    model = build_meta_model(load_model_config(cfg.model), cfg.model)
    with pytest.raises(ConfigError, match="finetune_moe_ep_fsdp.py does not train adapters: PEFT's layers"):
        moe_script().check_config(cfg, 1, model)


def test_a_dense_model_is_refused():
    cfg = load_config(MOE)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, intermediate_size=128))
    with pytest.raises(ConfigError, match="is a LlamaForCausalLM, not a mixture-of-experts model"):
        moe_script().check_config(cfg, 1, model)


def moe_script():
    """scripts/finetune_moe_ep_fsdp.py as a module, for its check_config."""
    import importlib.util

    path = os.path.join(REPO, "scripts", "finetune_moe_ep_fsdp.py")
    spec = importlib.util.spec_from_file_location("finetune_moe_ep_fsdp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bad_input_is_one_line_on_every_rank_before_anything_is_written(tmp_path):
    args = [
        "--config",
        MOE,
        f"checkpoint.dir={tmp_path / 'run'}",
        "model.config.num_experts=3",
        "parallelism.ep_size=2",
    ]
    for code, stderr in each_rank("finetune_moe_ep_fsdp.py", args, timeout=120):
        errors = [line for line in stderr.splitlines() if "config error:" in line]
        assert code == 2 and len(errors) == 1, stderr[-2000:]
        assert "parallelism.ep_size (2) does not divide the model's 3 experts" in errors[0]
    assert not os.path.exists(tmp_path / "run")


def test_qwen3_moe_json_offline_fails_with_a_clear_message():
    proc = run(
        "finetune_moe_ep_fsdp.py",
        ["--config", os.path.join(REPO, "configs", "qwen3_moe.json")],
        nproc=0,
        check=False,
        extra_env={"HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("config error: model.name_or_path 'Qwen/"), (
        proc.stderr[-999:]
    )


def test_debug_config_learns_arithmetic_and_logs_router_metrics(tmp_path):
    """The shipped config as is: a tiny Qwen3-MoE from scratch on the generated task; held-out loss falls."""
    run("finetune_moe_ep_fsdp.py", ["--config", MOE, f"checkpoint.dir={tmp_path}"], nproc=0, timeout=300)
    records = read_metrics(tmp_path)
    evals = [r for r in records if r.get("event") == "eval"]  # eval.interval: before training and at its end
    assert [r["step"] for r in evals] == [0, 60]
    before, after = evals[0]["eval_loss"], evals[-1]["eval_loss"]
    assert after < 0.4 * before, (before, after)
    last = steps(records)[-1]
    assert last["router_aux_loss"] > 0
    # Every real token goes to top_k=2 of 8 experts in each of the 2 layers.
    assert len(last["tokens_per_expert_max"]) == len(last["tokens_per_expert_mean"]) == 2
    assert all(m * 8 == pytest.approx(2 * last["tokens_processed"]) for m in last["tokens_per_expert_mean"])
    assert all(mx >= m for mx, m in zip(last["tokens_per_expert_max"], last["tokens_per_expert_mean"]))
    with open(tmp_path / "run_config.json") as f:
        assert json.load(f)["data"]["dataset"] == "arithmetic"
