"""Wrap policies, offload and mixed precision applied to a real model in a one-rank gloo group."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig

from common.config import ConfigError, FsdpConfig, ModelConfig
from common.mesh import build_dp_mesh
from common.model import build_meta_model, init_weights, load_model_config, materialise
from common.wrap import apply_fsdp, reshard, resolve_layer_classes

LAYERS = 3


@pytest.fixture(scope="module", autouse=True)
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny_llama(tie: bool = False) -> nn.Module:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        use_cache=False,  # as the scripts set it: a cache filled in forward would change the recompute
    )
    return build_meta_model(config, ModelConfig())


def shard(model: nn.Module, training: bool = True, **fsdp_keys) -> nn.Module:
    apply_fsdp(model, build_dp_mesh("cpu", 1, 1), FsdpConfig(**fsdp_keys), "cpu", training=training)
    return model


def all_gathered_after_a_forward(model: nn.Module) -> list[str]:
    """Names of the parameters left unsharded by a forward under no_grad (no backward to free them)."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    return sorted(name for name, param in model.named_parameters() if not isinstance(param, DTensor))


def test_the_units_backward_needs_first_stay_all_gathered_until_resharded():
    model = shard(tiny_llama())
    kept = all_gathered_after_a_forward(model)
    last = f"model.layers.{LAYERS - 1}."
    assert kept and all(name.startswith((last, "model.norm.", "lm_head.")) for name in kept)
    assert {"lm_head.weight", "model.norm.weight", f"{last}mlp.up_proj.weight"} <= set(kept)
    reshard(model)  # what the scripts do after an evaluation: DCP and exports must see sharded parameters
    assert all(isinstance(param, DTensor) for param in model.parameters())
    # Forward-only runs (eval_cp.py) and reshard_after_forward=false follow the key for every unit.
    assert all_gathered_after_a_forward(shard(tiny_llama(), training=False)) == []
    assert len(all_gathered_after_a_forward(shard(tiny_llama(), reshard_after_forward=False))) == len(
        list(tiny_llama().parameters())
    )


def units(model: nn.Module) -> list[list[str]]:
    """FSDP units as lists of module names; modules sharded together share one state."""
    groups: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            groups.setdefault(id(module._get_fsdp_state()), []).append(name or "<root>")
    return list(groups.values())


def test_transformer_based_wrap_gives_layers_embedding_norm_head_and_root():
    found = units(shard(tiny_llama(), auto_wrap_policy="TRANSFORMER_BASED_WRAP"))
    assert sorted(found) == sorted(
        [[f"model.layers.{i}"] for i in range(LAYERS)]
        + [["model.embed_tokens"], ["model.norm", "lm_head"], ["<root>"]]
    )


def test_empty_layer_list_means_no_split_modules_and_explicit_list_is_used():
    default = units(shard(tiny_llama(), transformer_layer_cls_to_wrap=[]))
    explicit = units(shard(tiny_llama(), transformer_layer_cls_to_wrap=["LlamaMLP"]))
    assert ["model.layers.0"] in default
    assert ["model.layers.0.mlp"] in explicit and ["model.layers.0"] not in explicit


def test_tied_embeddings_stay_in_one_unit():
    model = shard(tiny_llama(tie=True))
    found = units(model)
    root = next(u for u in found if "<root>" in u)
    assert ["model.embed_tokens"] not in found and ["model.norm", "lm_head"] not in found
    assert root == ["<root>"] and len(found) == LAYERS + 1
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_size_based_wrap_respects_min_num_params_and_never_wraps_a_module_list():
    model = tiny_llama()
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    mlp_params = sum(p.numel() for p in model.model.layers[0].mlp.parameters())
    # Threshold above an MLP but below a layer: each layer is wrapped, its children are not.
    found = units(shard(tiny_llama(), auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=mlp_params + 1))
    names = {n for unit in found for n in unit}
    assert {f"model.layers.{i}" for i in range(LAYERS)} <= names
    assert "model.layers" not in names and not any(".mlp" in n for n in names)
    assert layer_params >= mlp_params + 1
    # Smaller threshold: MLPs become units first; a ModuleList is never one even when it qualifies.
    small = units(shard(tiny_llama(), auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=mlp_params))
    small_names = {n for unit in small for n in unit}
    assert "model.layers.0.mlp" in small_names and "model.layers" not in small_names


def test_no_wrap_is_exactly_one_unit():
    assert units(shard(tiny_llama(), auto_wrap_policy="NO_WRAP")) == [["<root>"]]


def test_unknown_layer_class_lists_the_model_classes():
    with pytest.raises(ConfigError, match=r"LlamaDecoderLayr.*LlamaAttention.*LlamaDecoderLayer"):
        shard(tiny_llama(), transformer_layer_cls_to_wrap=["LlamaDecoderLayr"])


def test_cpu_offload_and_mixed_precision_reach_every_parameter():
    model = shard(
        tiny_llama(), cpu_offload=True, mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    )
    model.to_empty(device="cpu")
    fsdp_params = list(
        {
            id(fp): fp
            for m in model.modules()
            if isinstance(m, FSDPModule)
            for group in m._get_fsdp_state()._fsdp_param_groups
            for fp in group.fsdp_params
        }.values()
    )
    assert len(fsdp_params) == len(list(model.parameters()))
    for fsdp_param in fsdp_params:
        assert fsdp_param.offload_to_cpu
        policy = fsdp_param.mp_policy
        assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_activation_checkpointing_wraps_each_layer_before_sharding():
    model = shard(tiny_llama(), activation_checkpointing=True)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)]
    assert wrapped == [f"model.layers.{i}" for i in range(LAYERS)]
    assert all(isinstance(model.model.layers[i], FSDPModule) for i in range(LAYERS))
    assert len(units(model)) == LAYERS + 3  # the wrapper is the unit, not also the layer inside it


@pytest.mark.parametrize(
    "policy, wrapped_layers", [("full", [0, 1, 2]), ("op", [0, 1, 2]), (2, [1]), (3, [0])]
)
def test_each_ac_policy_wraps_its_layers_and_gives_the_gradients_of_no_checkpointing(policy, wrapped_layers):
    """Every Nth layer counts back from the last, which is never recomputed unless N is 1."""

    def step(**keys) -> tuple[nn.Module, float, dict]:
        model = shard(tiny_llama(), **keys)
        materialise(model, torch.device("cpu"))
        init_weights(model, seed=0, std=0.02)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {
            name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()
        }
        return model, loss.item(), grads

    _, plain_loss, plain = step()
    model, loss, checkpointed = step(activation_checkpointing=True, ac_policy=policy)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)]
    assert wrapped == [f"model.layers.{i}" for i in wrapped_layers]
    assert loss == pytest.approx(plain_loss, abs=1e-6)
    assert checkpointed.keys() == plain.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name].full_tensor(), grad.full_tensor(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "model_type, layer", [("biogpt", "BioGptDecoderLayer"), ("ctrl", "EncoderLayer"), ("openai-gpt", "Block")]
)
def test_a_decoder_without_no_split_modules_wraps_its_layer_stack(model_type, layer):
    """BioGPT, CTRL and OpenAI-GPT name no _no_split_modules: the class of their layer stack is wrapped, not
    refused; a list given without JSON's quotes names its classes."""
    cfg = ModelConfig(config={"model_type": model_type, "num_hidden_layers": 2, "n_layer": 2})
    model = build_meta_model(load_model_config(cfg), cfg)
    assert resolve_layer_classes(model, FsdpConfig()) == {layer}
    given = FsdpConfig(transformer_layer_cls_to_wrap=f"[{layer}]")
    assert resolve_layer_classes(model, given) == {layer}


def test_a_layer_class_inside_another_is_sharded_first_and_the_model_runs():
    """Mamba names its block and the mixer inside it: fully_shard takes the mixer first (a parent sharded
    first would own the mixer's parameters, and its forward would meet them sharded)."""
    cfg = ModelConfig(
        config={"model_type": "mamba", "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 64}
    )
    model = shard(build_meta_model(load_model_config(cfg), cfg))
    assert {"backbone.layers.0", "backbone.layers.0.mixer"} <= {u[0] for u in units(model)}
    model.to_empty(device="cpu")
    loss = model(
        input_ids=torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)
    ).loss
    loss.backward()
