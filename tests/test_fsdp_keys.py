"""Each fsdp key does what the Transformers FSDP2 docs say, measured on real multi-rank runs."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from launch import event, losses, pretrain, steps

STEP = ["train.steps=3", "train.micro_batch_size=4", "checkpoint.export=false"]


@pytest.fixture(scope="module")
def default(tmp_path_factory) -> list[dict]:
    """STEP at the defaults (reshard_after_forward=true), counting collectives: what the keys change."""
    return pretrain(tmp_path_factory.mktemp("default"), *STEP, "metrics.comm_stats=true")


@pytest.mark.compat  # metrics.comm_stats counts other collectives on torch 2.11 (common/ops/metrics.py)
def test_reshard_after_forward_false_skips_the_backward_all_gather(tmp_path, default):
    on = default
    off = pretrain(tmp_path / "off", *STEP, "metrics.comm_stats=true", "fsdp.reshard_after_forward=false")
    assert losses(on) == losses(off)
    ready = event(on, "model_ready")
    param_bytes = ready["params"] * 4  # fp32, and these shapes need no padding over 2 ranks
    units_with_params = ready["fsdp_units"] - 1  # the Llama root owns no parameter of its own
    # Backward starts with the output layer and the last decoder layer: those stay all-gathered after forward.
    kept_units, kept_bytes = ready["units_kept_after_forward"], ready["params_kept_after_forward"] * 4
    assert kept_units == 2 and 0 < kept_bytes < param_bytes
    # Step 1 follows the start-up loss check's forwards, after which FSDP all-gathers one unit once more
    # (7 calls, not 6, measured; train.verify_loss_at_start=false gives 6): the steady steps are compared.
    for r in steps(on)[1:]:  # forward + backward all-gather of every other unit
        assert r["all_gather_calls"] == 2 * units_with_params - kept_units
        assert r["all_gather_bytes"] == 2 * param_bytes - kept_bytes
        assert r["reduce_scatter_bytes"] == param_bytes
    for r in steps(off)[1:]:  # parameters kept from forward to backward: one all-gather
        assert r["all_gather_calls"] == units_with_params
        assert r["all_gather_bytes"] == param_bytes
        assert r["reduce_scatter_bytes"] == param_bytes


def test_gradients_are_reduce_scattered_once_per_step_unless_sync_each_batch(tmp_path):
    two_micro = [
        "train.steps=3",
        "train.micro_batch_size=2",
        "checkpoint.export=false",
        "metrics.comm_stats=true",
    ]
    once = pretrain(tmp_path / "once", *two_micro)  # 8 sequences / 2 ranks / micro-batch 2: 2 micro-batches
    each = pretrain(tmp_path / "each", *two_micro, "train.sync_each_batch=true")
    assert losses(once) == pytest.approx(losses(each), abs=1e-6)
    ready = event(once, "model_ready")
    param_bytes, kept_bytes = ready["params"] * 4, ready["params_kept_after_forward"] * 4
    assert all(r["reduce_scatter_bytes"] == param_bytes for r in steps(once))
    assert all(r["reduce_scatter_bytes"] == 2 * param_bytes for r in steps(each))
    per_micro_batch = 2 * param_bytes - kept_bytes
    # After step 1, which follows the start-up loss check's forwards (test above)
    assert all(r["all_gather_bytes"] == 2 * per_micro_batch for r in steps(once)[1:] + steps(each)[1:])


BIG_ACTIVATIONS = [
    "model.config.hidden_size=256",
    "model.config.intermediate_size=1024",
    "model.config.num_hidden_layers=4",
    "data.seq_len=256",
    "train.steps=2",
    "train.global_batch_size=16",
    "train.micro_batch_size=16",
    "checkpoint.export=false",
]


def test_activation_checkpointing_same_loss_lower_peak_memory(tmp_path):
    # glibc keeps freed memory unless large blocks are mmapped, which hides the activation peak.
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    plain = pretrain(tmp_path / "plain", *BIG_ACTIVATIONS, nproc=0, extra_env=env)
    ac = pretrain(
        tmp_path / "ac", *BIG_ACTIVATIONS, "fsdp.activation_checkpointing=true", nproc=0, extra_env=env
    )
    assert losses(ac) == pytest.approx(losses(plain), abs=1e-6)
    plain_peak = steps(plain)[-1]["peak_mem_gib"]
    ac_peak = steps(ac)[-1]["peak_mem_gib"]
    assert ac_peak < plain_peak - 0.2, (ac_peak, plain_peak)  # measured here: 1.06 -> 0.69 GiB


def test_cpu_offload_matches_losses(tmp_path, default):
    offload = pretrain(tmp_path / "offload", *STEP, "fsdp.cpu_offload=true")
    assert losses(offload) == pytest.approx(losses(default), abs=1e-6)


def test_bf16_params_with_fp32_reduce_run_on_cpu(tmp_path):
    fp32 = pretrain(tmp_path / "fp32", "train.steps=8", "checkpoint.export=false")
    bf16 = pretrain(
        tmp_path / "bf16",
        "train.steps=8",
        'fsdp.mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"}',
    )
    assert event(bf16, "model_ready")["mixed_precision"] == {
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
    }
    assert losses(bf16) != losses(fp32)  # the policy really changed the compute dtype
    assert losses(bf16) == pytest.approx(losses(fp32), abs=0.05)
    assert losses(bf16)[-1] < losses(bf16)[0] - 0.3
    # The export is written in the parameter dtype, and its config says so (dtype="auto" loads it as such).
    export = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16" / "export", dtype="auto")
    assert export.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.slow
def test_per_layer_compile_matches_eager(tmp_path):
    eager = pretrain(tmp_path / "eager", *STEP, nproc=0)
    compiled = pretrain(tmp_path / "compiled", *STEP, "train.compile=true", nproc=0, timeout=600)
    assert event(compiled, "model_ready")["compiled_layers"] == 2  # debug_tiny has 2 decoder layers
    assert event(eager, "model_ready")["compiled_layers"] == 0
    assert losses(compiled) == pytest.approx(losses(eager), abs=1e-5)
    selective = ["train.compile=true", "fsdp.activation_checkpointing=true", "fsdp.ac_policy=op"]
    compiled_sac = pretrain(tmp_path / "compiled_sac", *STEP, *selective, nproc=0, timeout=600)
    assert event(compiled_sac, "model_ready")["compiled_layers"] == 2
    assert losses(compiled_sac) == pytest.approx(losses(eager), abs=1e-5)


def test_activation_checkpointing_offload_moves_each_checkpointed_layers_input_to_host_memory(monkeypatch):
    """fsdp.activation_checkpointing_offload, as Accelerate applies it: torch's offload_wrapper puts
    save_on_cpu around each checkpoint. On a CPU host and device memory are the same, so no peak can drop
    here; what can be counted is where the tensors the checkpoints keep for backward go. Without offload they
    stay on the device (counted by a saved-tensors hook around the forward); with it, exactly the layers'
    inputs leave for host memory (counted inside save_on_cpu), and the loss and every gradient stay
    bit-identical."""
    import copy

    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as ac
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.activation_checkpointing import checkpoint_layers

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    reference, input_ids = LlamaForCausalLM(config), torch.randint(0, 256, (2, 32))
    to_host = []

    class CountingSaveOnCpu(ac.save_on_cpu):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pack = self.pack_hook
            self.pack_hook = lambda t: (to_host.append(t.numel() * t.element_size()), pack(t))[1]

    monkeypatch.setattr(ac, "save_on_cpu", CountingSaveOnCpu)

    def train(offload: bool) -> tuple[float, int, list]:
        model, kept = copy.deepcopy(reference), []
        checkpoint_layers(model, {"LlamaDecoderLayer"}, "full", offload)
        assert sum(isinstance(m, ac.OffloadWrapper) for m in model.modules()) == (4 if offload else 0)
        keep = lambda t: (kept.append(t.numel() * t.element_size()), t)[1]  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return loss.item(), sum(kept), [p.grad for p in model.parameters()]

    loss, on_device, grads = train(offload=False)
    assert not to_host
    offloaded_loss, offloaded_on_device, offloaded_grads = train(offload=True)
    layer_inputs = 4 * input_ids.numel() * config.hidden_size * 4  # 4 layers' [2, 32, 64] fp32 hidden states
    assert sum(to_host) == layer_inputs  # 65,536 bytes
    assert on_device - offloaded_on_device == layer_inputs
    assert offloaded_loss == loss
    assert all(torch.equal(a, b) for a, b in zip(offloaded_grads, grads))
