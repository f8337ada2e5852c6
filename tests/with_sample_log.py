"""Test-only: which global samples each rank trains on, for the data-position tests.

    SAMPLE_LOG=runs/x/samples torchrun --nproc_per_node=2 tests/with_sample_log.py scripts/pretrain_fsdp.py

Each rank appends one JSON line per optimizer step to $SAMPLE_LOG.rank<R>.jsonl: the step's first global
sample and the samples this rank's micro-batches hold, as the sampler read them. Never imported by scripts/
or common/.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.data.batches import LocalBatches  # noqa: E402


def sampled(
    batches: LocalBatches, first_sample: int, _original=LocalBatches.micro_batches
) -> tuple[list, list]:
    """(batches.micro_batches(first_sample), the global samples they hold): the positions the sampler read
    its rows at, watched rather than recomputed, so a sampler that reads the wrong rows shows here."""
    held, read_row = [], batches._row
    batches._row = lambda position: held.append(position) or read_row(position)
    try:
        return _original(batches, first_sample), held
    finally:
        del batches._row


def micro_batches(self, first_sample: int) -> list:
    batches, held = sampled(self, first_sample)
    with open(f"{os.environ['SAMPLE_LOG']}.rank{os.environ.get('RANK', '0')}.jsonl", "a") as f:
        f.write(json.dumps({"first_sample": first_sample, "samples": held}) + "\n")
    return batches


def read_sample_log(prefix: str) -> dict[int, list[int]]:
    """{first sample of a step: every rank's samples of that step}, from all ranks' files."""
    steps: dict[int, list[int]] = {}
    directory, name = os.path.split(prefix)
    for file in sorted(os.listdir(directory)):
        if file.startswith(f"{name}.rank"):
            with open(os.path.join(directory, file)) as f:
                for line in f:
                    record = json.loads(line)
                    steps.setdefault(record["first_sample"], []).extend(record["samples"])
    return steps


if __name__ == "__main__":
    LocalBatches.micro_batches = micro_batches
    sys.argv = sys.argv[1:]  # the script to run, then its own arguments
    runpy.run_path(sys.argv[0], run_name="__main__")
