"""The output layer and loss, plain against chunked (common/loss.py), at Llama 3's vocabulary: time and peak
memory of one forward + backward, for the chunk sizes train.loss_chunk_tokens could take.

    python benchmarks/loss_chunks.py [--tokens 4096] [--hidden 512] [--repeats 3] [--tiny]

One process, fp32, on this machine's cores. The layer is 128,256 x hidden; the tokens are one micro-batch's.
Peak is live tensor bytes during the pass (torch's MemTracker), above the inputs and the weight. The time is
the median of --repeats passes after one warm-up. Prints a markdown table, with ratios to the plain path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from common.loss import ChunkedCrossEntropy

VOCAB = 128_256


def one_pass(hidden, weight, labels, chunk: int) -> None:
    if chunk:
        loss, _correct = ChunkedCrossEntropy.apply(hidden, weight, None, labels, chunk, True)
    else:
        loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
    loss.backward()
    hidden.grad = weight.grad = None


def measure(tokens: int, dim: int, vocab: int, chunk: int, repeats: int) -> tuple[float, int]:
    torch.manual_seed(0)
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = (torch.randn(vocab, dim) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    one_pass(hidden, weight, labels, chunk)  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass(hidden, weight, labels, chunk)
        seconds.append(time.perf_counter() - start)
    tracker = MemTracker()
    with tracker:
        one_pass(hidden, weight, labels, chunk)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return statistics.median(seconds), peak


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a smoke run: small sizes, one repeat")
    args = parser.parse_args()
    tokens, dim, vocab, repeats = args.tokens, args.hidden, VOCAB, args.repeats
    if args.tiny:
        tokens, dim, vocab, repeats = 256, 32, 4096, 1
    print(f"{tokens} tokens, hidden {dim}, vocabulary {vocab:,}, fp32, {torch.get_num_threads()} threads\n")
    print("| train.loss_chunk_tokens | seconds per pass | vs plain | peak MiB | vs plain |")
    print("|---|---|---|---|---|")
    base = None
    for chunk in (0, 256, 512, 1024, 4096):
        seconds, peak = measure(tokens, dim, vocab, chunk, repeats)
        base = base or (seconds, peak)
        name, mib = chunk or "0 (plain)", peak / 2**20
        print(f"| {name} | {seconds:.3f} | {seconds / base[0]:.2f} | {mib:.0f} | {peak / base[1]:.2f} |")


if __name__ == "__main__":
    main()
