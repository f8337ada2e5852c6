"""Weights a release stores joined, which Transformers splits as it loads: Sarvam-MoE's `query_key_value`
holds q_proj, k_proj and v_proj. Such a model loads whole, through from_pretrained (checkpoint_layout.py); its
export joins them back with Transformers' own reverse converter, the ranks taking turns to write them."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import revert_weight_conversion


def own_joined(model: nn.Module, state: dict, joined: dict[str, list[str]], dtypes: dict) -> dict:
    """{key: the joined tensor} of the keys this rank writes: every world-size-th key, so each rank holds
    about 1/world of the joined tensors, whole, until the export is written. Every rank gathers each weight:
    collective."""
    mine = {}
    for i, (key, names) in enumerate(joined.items()):
        whole = {n: state[n].full_tensor() if isinstance(state[n], DTensor) else state[n] for n in names}
        if i % dist.get_world_size() == dist.get_rank():
            mine[key] = revert_weight_conversion(model, whole)[key].to(dtypes[names[0]])
    return mine
