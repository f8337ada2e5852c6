"""What makes torch's FSDPMemTracker and fake tensors run these models, for scripts/estimate_memory.py:
patches of private torch and Transformers code (pinned versions), each saying why no public way exists, one
of the recipes' own, and a public call in the tracker's way."""

from __future__ import annotations

import math
from collections.abc import Callable
from unittest import mock

import torch
from torch import _meta_registrations as meta_registrations
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from transformers.distributed.expert_parallel import AllToAllEP

from common import wrap


def isolate_sharding_propagation() -> None:
    """DTensor computes an op's output shapes by running it on global-shape fake tensors, in the active fake
    mode if there is one. Outside fake mode FSDPMemTracker ignores those (they run in a fresh mode); here
    they ran in ours and were counted, e.g. fused AdamW's full-size parameters, gradients and states as
    ~17x the real optimizer state. Running the propagation in a fresh mode restores what a real run sees.
    (Private torch API, pinned torch; there is no public switch.)"""
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def in_fresh_fake_mode(self, op_schema):
        with unset_fake_temporarily():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = in_fresh_fake_mode


def route_tokens_evenly() -> None:
    """Expert parallelism reads its all-to-all split sizes on the host (.tolist() on per-expert token
    counts), and fake tensors have no values. Plan for even routing, which the load-balancing loss aims
    for: each rank sends the same share of its (token, expert) pairs to every rank of its EP group, and
    receives as many. (Transformers' AllToAllEP, pinned Transformers: there is no hook for the sizes.)"""
    original = AllToAllEP._dispatch_tokens

    def evenly(self, hidden_states, top_k_index, top_k_weights):
        # This rank's rows after TP peers split their shared batch, times top-k.
        pairs = math.ceil(hidden_states.shape[0] / self.tp_mesh.size()) * top_k_index.shape[-1]
        ep = self.ep_mesh.size()
        split = [pairs // ep + (rank < pairs % ep) for rank in range(ep)]
        with mock.patch.object(FakeTensor, "tolist", lambda counts: [split, split]):
            return original(self, hidden_states, top_k_index, top_k_weights)

    AllToAllEP._dispatch_tokens = evenly


def unpinned_offload() -> None:
    """fsdp.cpu_offload pins its host memory where CUDA is present (common/wrap.py), and fake tensors cannot
    be pinned (NYI: aten._pin_memory, seen on a GPU machine). Pinned or not, the bytes are the same."""
    wrap.CPUOffloadPolicy = lambda pin_memory=False: CPUOffloadPolicy(pin_memory=False)


def grouped_mm_in_float32() -> None:
    """torch's shape function for grouped_mm (the experts' matmul) copies the CUDA kernel's bf16-only check;
    the CPU kernel, which a real --device cpu run uses, also takes float32. Give float32 the same output.
    (Private torch API, pinned torch.)"""
    original = meta_registrations._meta_grouped_mm_common

    def any_float(
        mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, **kw
    ):
        if scale_a is None and mat_a.dtype == mat_b.dtype == torch.float32:
            return meta_registrations._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return original(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, **kw)

    meta_registrations._meta_grouped_mm_common = any_float


def label_accumulated_gradients(tracker: FSDPMemTracker):
    """With accumulation and no gradient sync, FSDP2 keeps each parameter's unsharded gradient in the
    reduce dtype until the last micro-batch. FSDPMemTracker only labels `.grad`, so it counted these (the
    whole model in fp32 on every rank, 30 GiB at 8B) as backward temporaries. Label each one a gradient
    as FSDP2 creates it, in backward, so that a peak inside backward is split right too. (Private FSDP and
    tracker state, pinned torch: there is no public accessor.)"""
    original = FSDPParam.to_accumulated_grad_if_needed

    def labelled(fsdp_param):
        original(fsdp_param)
        if fsdp_param.unsharded_accumulated_grad is not None:
            tracker._update_and_maybe_create_winfos(
                fsdp_param.unsharded_accumulated_grad, _FSDPRefType.UNSHARDED_GRAD
            )

    return mock.patch.object(FSDPParam, "to_accumulated_grad_if_needed", labelled)


def track_the_global_peak_only(tracker: FSDPMemTracker) -> None:
    """After every op FSDPMemTracker also updates the peak of each module on the stack, walking a weak
    dictionary of every module: about 40% of an 8B estimate's time. The planner reads only the global peak.
    (Private tracker state, pinned torch: there is no switch.)"""
    update_peaks = tracker._update_peak_stats

    def global_only(peak_state) -> None:
        modules, tracker.memory_tracking = tracker.memory_tracking, {}
        try:
            update_peaks(peak_state)
        finally:
            tracker.memory_tracking = modules

    tracker._update_peak_stats = global_only


def pass_over_units_no_forward_ran(tracker: FSDPMemTracker) -> None:
    """An image-text release trained on text never runs its vision blocks' forward, so the tracker holds no
    statistics for them, and its post-backward wrapper then fails looking them up (KeyError). Such a unit
    holds no gradient: run FSDP's own post-backward for it untracked. (Private tracker state, pinned torch:
    there is no switch.)"""
    wrap_post_backward = tracker._fsdp_param_group_post_backward

    def unless_never_run(fsdp_mod, post_backward):
        tracked = wrap_post_backward(fsdp_mod, post_backward)

        def post_backward_of(*args, **kwargs):
            return (tracked if fsdp_mod in tracker.memory_tracking else post_backward)(*args, **kwargs)

        return post_backward_of

    tracker._fsdp_param_group_post_backward = unless_never_run


def forget_module_stats_before(tracker: FSDPMemTracker, loss: Callable) -> Callable:
    """FSDPMemTracker refuses a root module's second forward before its backward has ended (it takes it for
    a second step), which accumulation runs when the backward leaves its module hooks unfinished, as
    Qwen3-VL's does. Clearing its per-module statistics before each micro-batch lets it run; the planner
    reads only the global peak, which this keeps."""

    def cleared_first() -> torch.Tensor:
        tracker.reset_mod_stats()
        return loss()

    return cleared_first
