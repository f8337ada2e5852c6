"""Test-only: torch's ring-attention context parallelism on CPU, so eval_cp.py's `torch_cp` path runs here.

torch's context_parallel dispatches SDPA to ring attention through a table of CP kernels that lists the CUDA
kernels only; the CPU one (aten._scaled_dot_product_flash_attention_for_cpu) has no entry, so on CPU torch_cp
cannot run at all. This module adds that entry, forward only: the handler calls torch's own ring-attention
loop (_templated_ring_attention, the one the CUDA entries use) with the CPU kernel and returns the outputs
sharded on the sequence dimension like the CUDA entries do. It uses private torch APIs, checked against
torch 2.13.0 (requirements.txt); if they are missing it fails with one line naming the torch version.
Never imported by scripts/ or common/.

    torchrun --nproc_per_node 2 tests/cpu_ring_attention.py scripts/eval_cp.py ... eval.attention=torch_cp
"""

from __future__ import annotations

import runpy
import sys

import torch

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention,
        custom_ops,
    )
except ImportError as error:
    raise SystemExit(
        f"cpu_ring_attention: torch {torch.__version__} lacks the CP internals it needs ({error})"
    ) from None

CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _cpu_ring_attention(op_call, args: tuple, kwargs: dict) -> tuple[DTensor, DTensor]:
    query, key, value, *rest = args
    dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("ring attention takes is_causal, not a mask")
    mesh, placements = query.device_mesh, query.placements
    out, logsumexp = _templated_ring_attention(
        mesh.get_group(),
        2,  # sequence dimension of [batch, heads, sequence, head_dim]
        CPU_SDPA,
        query.to_local(),
        key.to_local(),
        value.to_local(),
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=kwargs.get("scale"),
    )
    return (
        DTensor.from_local(out, mesh, placements, run_check=False),
        DTensor.from_local(logsumexp, mesh, placements, run_check=False),
    )


custom_ops[CPU_SDPA] = _cpu_ring_attention


if __name__ == "__main__":
    sys.argv = sys.argv[1:]  # the script to run, then its own arguments
    runpy.run_path(sys.argv[0], run_name="__main__")
