"""Context parallelism on any device (torch's context_parallel needs CUDA SDPA): each cp rank holds some
positions of every sequence, and attention all-gathers K and V and masks by global position."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:  # torch 2.13's names; torch 2.11 has only all_gather_tensor(_autograd), which 2.13 deprecates
    from torch.distributed._functional_collectives import all_gather_single as all_gather
    from torch.distributed._functional_collectives import all_gather_single_autograd as all_gather_autograd
except ImportError:
    from torch.distributed._functional_collectives import all_gather_tensor as all_gather
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as all_gather_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from common import architectures
from common.config import ConfigError

ATTENTION = "cp_allgather"
TORCH_ATTENTION = "cp_torch"
# Queries per attention call: bounds a materialised (CPU) mask (docs/performance.md, "CP attention").
QUERY_BLOCK = 1024


class CpState:
    """This rank's share of every sequence, from build_cp_state(). The model's attention reads it from the
    forward keyword `cp` (Transformers passes extra keywords down to the attention function). A plain class,
    not a dataclass: FSDP's mixed precision casts the floating tensors inside a dataclass forward argument,
    and the causal biases must stay as they are."""

    def __init__(
        self, mesh: DeviceMesh, positions: torch.Tensor, query_blocks: list, key_order, documents=False
    ):
        self.mesh, self.size, self.group = mesh, mesh["cp"].size(), mesh.get_group("cp")  # mesh: (dp, cp)
        self.dp_rank = mesh.get_local_rank("dp")
        self.positions = positions  # this rank's positions of each sequence, on the device
        self.query_blocks = query_blocks  # (first local row, first position, end, causal bias) per call
        self.key_order = key_order  # sorts the gathered head-tail shards into sequence order
        self.document_mask = documents  # position ids restart per document; attention stays inside it

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a [batch, sequence] tensor."""
        return tensor[:, self.positions.to(tensor.device)]

    def shard_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
        """The model's keyword inputs for this rank's positions. Given position ids restart per packed
        document or SFT example, and attention then stays inside each one."""
        if position_ids is None:
            return dict(
                input_ids=self.shard(input_ids),
                position_ids=self.positions.expand(len(input_ids), -1),
                cp=self,
            )
        documents = CpState(self.mesh, self.positions, self.query_blocks, self.key_order, documents=True)
        return dict(input_ids=self.shard(input_ids), position_ids=self.shard(position_ids), cp=documents)


def use_cp_attention(hf_config: PretrainedConfig, torch_cp: bool = False) -> str:
    """Register the CP attention functions with Transformers (before the model is built: it checks its
    attn_implementation) and return the name to use: the all-gather one, or torch's ring attention's. Both
    compute with SDPA, so a model that does not support sdpa is refused (remote code is not checked)."""
    model_class = architectures.model_class(hf_config)
    if model_class is not None and not model_class._supports_sdpa:
        supported = architectures.supported_attention(model_class)
        raise ConfigError(
            f"parallelism.cp_size > 1 needs attention that SDPA computes, and {model_class.__name__} does "
            f"not support sdpa (only {', '.join(supported)}, e.g. for soft-capped attention scores); set "
            f"parallelism.cp_size=1"
        )
    AttentionInterface.register(ATTENTION, allgather_kv_attention)
    AttentionInterface.register(TORCH_ATTENTION, torch_cp_attention)
    return TORCH_ATTENTION if torch_cp else ATTENTION


def _whole_sequence(local: torch.Tensor, dim: int, cp: CpState, gather=all_gather) -> torch.Tensor:
    if cp.size == 1:
        return local
    full = gather(local.contiguous(), gather_dim=dim, group=cp.group)
    return full if cp.key_order is None else full.index_select(dim, cp.key_order)


def allgather_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Each query block [start, end) attends to the keys before `end` with a lower-right causal bias, which
    CUDA applies without materialising a mask. HF's attention_mask describes the local shard: ignored."""
    cp: CpState = kwargs["cp"]
    # The autograd all-gather's backward is a reduce-scatter; torch.distributed.nn's all_gather gave wrong
    # K/V gradients on gloo (docs/performance.md, "CP attention").
    key = _whole_sequence(key, 2, cp, all_gather_autograd)
    value = _whole_sequence(value, 2, cp, all_gather_autograd)
    if cp.document_mask:
        documents = (_whole_sequence(kwargs["position_ids"], 1, cp) == 0).cumsum(dim=1)  # [batch, seq]
        query_documents = documents[:, cp.positions]
    blocks = []
    for local, start, end, mask in cp.query_blocks:
        rows = slice(local, local + end - start)
        if cp.document_mask:
            keys = torch.arange(end, device=query.device)
            causal = torch.arange(start, end, device=query.device)[:, None] >= keys
            mask = (causal & (query_documents[:, rows, None] == documents[:, None, :end])).unsqueeze(1)
        blocks.append(
            F.scaled_dot_product_attention(
                query[:, :, rows],
                key[:, :, :end],
                value[:, :, :end],
                attn_mask=mask,
                scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )
        )
    return torch.cat(blocks, dim=2).transpose(1, 2).contiguous(), None


def torch_cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Inside torch's context_parallel SDPA becomes ring attention, which needs is_causal and no mask."""
    return sdpa_attention_forward(module, query, key, value, None, dropout, scaling, is_causal=True)


def score_with_torch_cp(score, input_ids: torch.Tensor, labels: torch.Tensor, cp_state: CpState):
    """`score` (common/evaluate.py) under torch's ring attention: torch shards the three buffers in place."""
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).repeat(len(input_ids), 1)
    buffers = [input_ids, labels, position_ids]
    with context_parallel(
        cp_state.mesh["cp"], buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)
    ):
        return score(labels, input_ids=input_ids, position_ids=position_ids)


def shard_positions(seq_len: int, cp_size: int, cp_rank: int, load_balance: bool) -> torch.Tensor:
    """Chunk r, or chunks r and 2cp-1-r (head-tail) to balance causal work."""
    if not load_balance:
        return torch.arange(seq_len).chunk(cp_size)[cp_rank]
    chunks = torch.arange(seq_len).chunk(2 * cp_size)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])


def check_cp(
    seq_len: int, cp_size: int, load_balance: bool, hf_config: PretrainedConfig | None = None
) -> None:
    multiple = 2 * cp_size if load_balance else cp_size
    if seq_len % multiple:
        lower = seq_len // multiple * multiple
        nearest = f"{lower} or {lower + multiple}" if lower else str(multiple)
        raise ConfigError(
            f"data.seq_len={seq_len} is not divisible by {multiple} (cp_size={cp_size}"
            f"{', x2 for load balancing' if load_balance else ''}); use {nearest}"
        )
    window = getattr(hf_config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(hf_config, "layer_types", None) or []) or (
        window is not None and getattr(hf_config, "use_sliding_window", True) and window < seq_len
    )
    if cp_size > 1 and sliding:
        raise ConfigError(
            f"parallelism.cp_size={cp_size} but this model uses sliding-window attention (window "
            f"{window}), which the CP attention here (full causal over global positions) would get "
            f"wrong; evaluate it with cp_size=1"
        )


def build_cp_state(seq_len: int, cp_size: int, load_balance: bool, device: torch.device) -> CpState:
    """This rank's layout. The (dp, cp) mesh keeps a data-parallel rank's cp ranks adjacent, so
    build_dp_mesh(dp_shard x cp) over the same ranks shards over dp x cp."""
    mesh = init_device_mesh(
        device.type, (dist.get_world_size() // cp_size, cp_size), mesh_dim_names=("dp", "cp")
    )
    positions = shard_positions(seq_len, cp_size, mesh.get_local_rank("cp"), load_balance)
    every_rank = torch.cat([shard_positions(seq_len, cp_size, r, load_balance) for r in range(cp_size)])
    runs = torch.tensor_split(positions, (torch.nonzero(positions.diff() != 1).flatten() + 1).tolist())
    blocks, local = [], 0
    for run in runs:
        for start in range(int(run[0]), int(run[-1]) + 1, QUERY_BLOCK):
            end = min(start + QUERY_BLOCK, int(run[-1]) + 1)
            # Built here, not in attention: a tensor subclass cannot be created under a dispatch mode
            # (selective activation checkpointing's, fake tensors').
            blocks.append((local, start, end, causal_lower_right(end - start, end)))
            local += end - start
    in_order = bool((every_rank.diff() == 1).all())  # head-tail shards arrive out of order: sort them
    return CpState(mesh, positions.to(device), blocks, None if in_order else every_rank.argsort().to(device))
