"""Test-only: which global samples each rank trains on, for the data-position tests.

    SAMPLE_LOG=runs/x/samples torchrun --nproc_per_node=2 tests/with_sample_log.py scripts/pretrain_fsdp.py

Each rank appends one JSON line per optimizer step to $SAMPLE_LOG.rank<R>.jsonl: the step's first global
sample and the samples this rank's micro-batches hold. Never imported by scripts/ or common/.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.data.batches import LocalBatches  # noqa: E402


def micro_batches(self, first_sample: int, _original=LocalBatches.micro_batches) -> list:
    batches = _original(self, first_sample)
    held = [i for batch in batches for i in batch.sample_indices]
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
