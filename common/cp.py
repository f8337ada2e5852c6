"""Context parallelism on any device: each cp rank holds some positions of every sequence, and attention
all-gathers K and V over the cp group and masks by global position.

torch's context_parallel needs CUDA SDPA kernels (on CPU it has no sharding strategy for
_scaled_dot_product_flash_attention_for_cpu). This path works everywhere, and in backward too. eval_cp.py and
pretrain_fsdp.py (long-context training) share it, so eval uses the same CP as training by construction.

The all-gather is torch's functional `all_gather_tensor_autograd` (backward: reduce-scatter). The older
`torch.distributed.nn.functional.all_gather` gave wrong K/V gradients on gloo here (grad norm 0.871 instead
of the one-process 0.947 on the first step of debug_tiny at cp=2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_tensor_autograd
from transformers import AttentionInterface, PretrainedConfig

from common.config import ConfigError

# The cp group and the global positions of this rank's queries and of all keys, set by setup(). The attention
# function is called by the model's own layers, so it can only read them from here.
CP: dict = {}
ATTENTION = "cp_allgather"


def allgather_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention over a sequence sharded across the cp group: gather K and V, mask by global position."""
    if CP["size"] > 1:
        key = all_gather_tensor_autograd(key.contiguous(), gather_dim=2, group=CP["group"])
        value = all_gather_tensor_autograd(value.contiguous(), gather_dim=2, group=CP["group"])
    mask = CP["query_positions"][:, None] >= CP["key_positions"][None, :]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, allgather_kv_attention)


def shard_positions(seq_len: int, cp_size: int, cp_rank: int, load_balance: bool) -> torch.Tensor:
    """The positions a cp rank holds: chunk r, or chunks r and 2cp-1-r (head-tail) to balance causal work."""
    if not load_balance:
        return torch.arange(seq_len).chunk(cp_size)[cp_rank]
    chunks = torch.arange(seq_len).chunk(2 * cp_size)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])


def check_cp(seq_len: int, cp_size: int, load_balance: bool, hf_config: PretrainedConfig | None = None) -> None:
    """A length the shards cannot split evenly, or attention the mask here does not express, fails up front."""
    multiple = 2 * cp_size if load_balance else cp_size
    if seq_len % multiple:
        lower, upper = seq_len // multiple * multiple, (seq_len // multiple + 1) * multiple
        nearest = f"{lower} or {upper}" if lower else str(upper)
        raise ConfigError(f"data.seq_len={seq_len} is not divisible by {multiple} (cp_size={cp_size}"
                          f"{', x2 for load balancing' if load_balance else ''}); use {nearest}")
    window = getattr(hf_config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(hf_config, "layer_types", None) or []) or (
        window is not None and getattr(hf_config, "use_sliding_window", True) and window < seq_len)
    if cp_size > 1 and sliding:
        raise ConfigError(f"parallelism.cp_size={cp_size} but this model uses sliding-window attention (window "
                          f"{window}), which the CP attention here (full causal over global positions) would get "
                          f"wrong; evaluate it with cp_size=1")


def setup(seq_len: int, cp_size: int, cp_rank: int, group, load_balance: bool, device: torch.device) -> torch.Tensor:
    """Set this rank's CP state; returns the positions it holds (index inputs, labels and position ids with it)."""
    positions = shard_positions(seq_len, cp_size, cp_rank, load_balance)
    every_rank = [shard_positions(seq_len, cp_size, r, load_balance) for r in range(cp_size)]
    CP.update(size=cp_size, group=group, query_positions=positions.to(device),
              key_positions=torch.cat(every_rank).to(device))
    return positions
