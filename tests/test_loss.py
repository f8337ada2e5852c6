"""The chunked output layer and loss (common/loss.py, train.loss_chunk_tokens): the plain path's loss and
gradients, one all-gather of the head per micro-batch, and the logits' memory gone from the peak."""

import glob
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from common.loss import ChunkedCrossEntropy
from launch import REPO, TINY, event, pretrain, read_metrics, run, steps, torchrun

PLAIN, CHUNKED = "train.loss_chunk_tokens=0", "train.loss_chunk_tokens=48"  # 128 tokens: 3 uneven chunks
RUN = ["train.steps=3", "metrics.comm_stats=true"]


def plain_and_chunked(hidden, weight, labels, dtype, bias=None):
    """Loss and (hidden, weight[, bias]) gradients, plain and chunked, from the same leaves."""
    out = []
    for chunked in (False, True):
        leaves = [t.clone().to(dtype).requires_grad_() for t in (hidden, weight, bias) if t is not None]
        h, w, b = (*leaves, None)[:3]
        if chunked:
            loss, _correct = ChunkedCrossEntropy.apply(h, w, b, labels, 64, True)
        else:
            loss = F.cross_entropy(F.linear(h, w, b).float(), labels, ignore_index=-100, reduction="sum")
        loss.backward()
        out.append((loss.double(), *(leaf.grad.double() for leaf in leaves)))
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_chunked_loss_and_gradients_equal_the_plain_path():
    torch.manual_seed(0)
    hidden, weight = torch.randn(300, 64), torch.randn(1000, 64) * 0.1
    labels = torch.randint(0, 1000, (300,))
    labels[::7] = -100  # ignored tokens take no loss and give no gradient
    (plain, chunked) = plain_and_chunked(hidden, weight, labels, torch.float32)
    assert all(relative(c, p) <= 1e-6 for c, p in zip(chunked, plain))
    # A head with a bias (Phi, GPT-J, CodeGen): the bias takes part in the loss and gets its gradient.
    (plain, chunked) = plain_and_chunked(hidden, weight, labels, torch.float32, bias=torch.randn(1000))
    assert len(chunked) == 4 and all(relative(c, p) <= 1e-6 for c, p in zip(chunked, plain))
    # bf16: each error against fp64 within 2x the plain path's (measured 1.0x and 1.3x).
    (truth,) = [plain_and_chunked(hidden, weight, labels, torch.float64)[0]]
    plain, chunked = plain_and_chunked(hidden, weight, labels, torch.bfloat16)
    for c, p, t in zip(chunked[1:], plain[1:], truth[1:]):
        assert relative(c, t) <= 2 * relative(p, t)


def weights(run_dir) -> dict:
    return load_file(os.path.join(run_dir, "export", "model.safetensors"))


@pytest.mark.parametrize(
    "name, nproc, overrides",
    [
        ("one process", 0, []),
        ("2 ranks", 2, []),
        ("cp 2", 2, ["parallelism.cp_size=2"]),
        ("tied embeddings", 2, ["model.config.tie_word_embeddings=true"]),
    ],
)
def test_training_with_the_chunked_head_equals_the_plain_head(tmp_path, name, nproc, overrides):
    plain = pretrain(tmp_path / "plain", *RUN, PLAIN, *overrides, nproc=nproc)
    chunked = pretrain(tmp_path / "chunked", *RUN, CHUNKED, *overrides, nproc=nproc)
    for key in ("loss", "grad_norm"):
        got, want = [r[key] for r in steps(chunked)], [r[key] for r in steps(plain)]
        assert all(abs(g - w) <= 1e-6 * abs(w) for g, w in zip(got, want)), (key, got, want)
    # The weights after 3 AdamW steps: measured 2e-5 to 1.1e-4 apart. Adam divides each update by the
    # gradient's own size, so an element whose gradient is near eps moves by differences its gradient does
    # not have; the loss and grad norm of every step (1e-6, above) carry the parity.
    got, want = weights(tmp_path / "chunked"), weights(tmp_path / "plain")
    assert max(relative(got[k].double(), want[k].double()) for k in want) <= 1e-3
    if nproc:  # the head's weight is all-gathered once per micro-batch either way, not once per chunk
        calls = [[r["all_gather_calls"] for r in steps(run)] for run in (chunked, plain)]
        assert calls[0] == calls[1], calls


def test_bf16_mixed_precision_trains_the_same_with_the_chunked_head(tmp_path):
    bf16 = "fsdp.mixed_precision=bf16"
    plain = pretrain(tmp_path / "plain", *RUN, PLAIN, bf16)
    chunked = pretrain(tmp_path / "chunked", *RUN, CHUNKED, bf16)
    assert [round(r["loss"], 2) for r in steps(chunked)] == [round(r["loss"], 2) for r in steps(plain)]


def peak(tmp_path, name: str, *overrides: str) -> int:
    """The highest rank's training peak of live tensor bytes, from the profiler (tests/profile_peak.py)."""
    run_dir = tmp_path / name
    run(
        "pretrain_fsdp.py",
        [
            "--config",
            TINY,
            f"checkpoint.dir={run_dir}",
            "train.steps=2",
            "checkpoint.export=false",
            *overrides,
        ],
        launcher=[*torchrun(2), os.path.join(REPO, "tests", "profile_peak.py")],
        extra_env={"PEAK_OUT": str(tmp_path / f"{name}.peak")},
    )
    assert event(read_metrics(run_dir), "final")
    return max(json.load(open(f))["peak_bytes"] for f in glob.glob(str(tmp_path / f"{name}.peak.rank*.json")))


def test_the_chunked_head_takes_the_logits_out_of_the_peak(tmp_path):
    """A 32k vocabulary, 4 x 256 tokens per micro-batch: one fp32 logits tensor is 128 MiB."""
    shape = ["model.config.vocab_size=32768", "data.seq_len=256", "train.micro_batch_size=4"]
    shape += ["train.global_batch_size=8"]
    logits = 4 * 256 * 32768 * 4
    plain = peak(tmp_path, "plain", *shape, PLAIN)
    chunked = peak(tmp_path, "chunked", *shape, "train.loss_chunk_tokens=256")
    print(f"peak: plain {plain / 2**20:.0f} MiB, chunked {chunked / 2**20:.0f} MiB")
    assert plain - chunked >= logits


def test_moe_fine_tuning_with_the_chunked_head_equals_the_plain_head(tmp_path):
    def finetune(name: str, chunk: str) -> list[dict]:
        args = [
            "--config",
            os.path.join(REPO, "configs", "debug_moe.json"),
            f"checkpoint.dir={tmp_path / name}",
        ]
        eval_chunk = chunk.replace("train.", "eval.")  # the held-out loss at step 0 and 3, chunked alike
        words = ["train.steps=3", "checkpoint.export=false", "eval.interval=3", chunk, eval_chunk]
        run("finetune_moe_ep_fsdp.py", [*args, *words], nproc=0)
        return read_metrics(tmp_path / name)

    plain, chunked = finetune("plain", PLAIN), finetune("chunked", CHUNKED)
    held_out = [[r["eval_loss"] for r in records if r.get("event") == "eval"] for records in (chunked, plain)]
    assert len(held_out[1]) == 2 and held_out[0] == pytest.approx(held_out[1], rel=1e-6), held_out
    for key in ("loss", "grad_norm", "router_aux_loss"):
        got, want = [r[key] for r in steps(chunked)], [r[key] for r in steps(plain)]
        assert all(abs(g - w) <= 1e-6 * abs(w) for g, w in zip(got, want)), (key, got, want)
    assert event(chunked, "model_ready")["loss_chunk_tokens"] == 48
