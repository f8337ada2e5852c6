"""Test-only: plant, from the outside, a cause that makes the recipe's loss differ from the model's own, so
the start-up check (common/ops/loss_check.py) must see it.

    FSDP2_RECIPES_PLANT=bias python tests/with_planted.py scripts/pretrain_fsdp.py --config ...

FSDP2_RECIPES_PLANT is one of:
- bias: the chunked loss drops the output layer's bias (the recipes before they took it);
- transform: the model's logit transform is hidden from the structural probe on `meta` (returns_head_output),
  as a transform the probe cannot see would be;
- inplace: the output layer's result is scaled in place (a hook), which no structural probe sees;
- loss_function: the model's loss is not cross-entropy over its logits (label smoothing of its own);
- random: the model's forward draws new random numbers each time, in eval mode too (Reformer's LSH
  attention hashes with fresh random rotations): noise on the final norm's output.
Never imported by scripts/ or common/.
"""

from __future__ import annotations

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import loss  # noqa: E402

PLANT = os.environ["FSDP2_RECIPES_PLANT"]


def chunked_without_bias(apply):
    return lambda hidden, weight, bias, *rest: apply(hidden, weight, None, *rest)


def scaled_in_place(compute_loss_in_output_layer):
    def wrapper(model):
        compute_loss_in_output_layer(model)
        model.get_output_embeddings().register_forward_hook(lambda module, args, out: out.mul_(2.0))

    return wrapper


def smoothed(compute_loss_in_output_layer):
    def wrapper(model):
        compute_loss_in_output_layer(model)

        def loss_function(logits, labels, vocab_size, shift_labels=None, **kwargs):
            target = (labels if shift_labels is None else shift_labels).flatten()
            logits = logits.float().flatten(0, -2)
            return F.cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.1)

        type(model).loss_function = property(lambda self: loss_function)

    return wrapper


def noisy(compute_loss_in_output_layer):
    def wrapper(model):
        compute_loss_in_output_layer(model)
        model.get_decoder().norm.register_forward_hook(lambda module, args, out: out + torch.randn_like(out))

    return wrapper


if __name__ == "__main__":
    if PLANT == "bias":
        loss.ChunkedCrossEntropy.apply = chunked_without_bias(loss.ChunkedCrossEntropy.apply)
    elif PLANT == "transform":
        loss.returns_head_output = lambda model: True
    elif PLANT == "inplace":
        loss.compute_loss_in_output_layer = scaled_in_place(loss.compute_loss_in_output_layer)
    elif PLANT == "loss_function":
        loss.compute_loss_in_output_layer = smoothed(loss.compute_loss_in_output_layer)
    elif PLANT == "random":
        loss.compute_loss_in_output_layer = noisy(loss.compute_loss_in_output_layer)
    else:
        raise SystemExit(
            f"FSDP2_RECIPES_PLANT={PLANT!r}: use bias, transform, inplace, loss_function, random"
        )
    sys.argv = sys.argv[1:]  # the script to run, then its own arguments
    runpy.run_path(sys.argv[0], run_name="__main__")
