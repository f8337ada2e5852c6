"""Image-text records streamed (data.streaming=true): each data-parallel rank reads its own part of the
stream, renders each record with the release's processor as it comes, and collates micro_batch_size of them,
as common/data/image_records.py does for records read whole. Nothing is cached or shuffled: the stream's
order is the training order. A record longer than a row, or with no answer, is passed over, said once."""

from __future__ import annotations

import os

import numpy as np

from common.config import ConfigError, DataConfig, TrainConfig
from common.data.batches import Batch, own_stream_state
from common.data.embedded import ensure_embedded_tokenizer
from common.data.files import local_files, open_stream
from common.data.image_records import collate, load_processor, record_row

KEY = "data.dataset"


class StreamingImageBatches:
    """This rank's micro-batches of streamed image-text records; its state is the stream's position, so a run
    resumes on as many data-parallel ranks as it was saved on."""

    def __init__(self, cfg: DataConfig, processor, t: TrainConfig, dp_rank: int, dp_size: int):
        self.dataset = open_stream(cfg, dp_rank, dp_size)
        self.stream = iter(self.dataset)
        files = local_files(cfg.dataset)
        self.folder = os.path.dirname(files[0]) if files else None  # where relative image paths start
        self.processor, self.seq_len, self.dp_rank, self.dp_size = processor, cfg.seq_len, dp_rank, dp_size
        self.accum = t.global_batch_size // (t.micro_batch_size * dp_size)
        self.micro_batch = t.micro_batch_size
        self.passed_over = 0  # records longer than a row, or with no answer

    def _next_record(self) -> tuple[dict, np.ndarray]:
        """The next record that fits a row and has an answer, and its row. A finite stream starts again."""
        for _ in range(2):
            for record in self.stream:
                row = record_row(self.processor, record, self.seq_len, 0, self.folder, KEY)
                if row is not None and (row[1, 1:] == 1).any():
                    return record, row
                self.passed_over += 1
                if self.passed_over == 1:  # once: a stream has no count to give at the end
                    print(
                        f"{KEY}: a streamed record renders to more than data.seq_len + 1 = "
                        f"{self.seq_len + 1} tokens, or has no answer, and is passed over (said once); raise "
                        f"data.seq_len to train on longer ones",
                        flush=True,
                    )
            self.stream = iter(self.dataset)
        raise ConfigError(f"{KEY} streamed no record that fits data.seq_len + 1 = {self.seq_len + 1} tokens")

    def micro_batches(self, first_sample: int) -> list[Batch]:
        out = []
        for _ in range(self.accum):
            records, rows = zip(*(self._next_record() for _ in range(self.micro_batch)))
            out.append(collate(self.processor, list(records), np.stack(rows), self.folder, KEY))
        return out

    def state_dict(self) -> dict:
        return {"dataset": self.dataset.state_dict(), "dp_rank": self.dp_rank}

    def load_state_dict(self, states: list[dict]) -> None:
        self.dataset.load_state_dict(own_stream_state(states, self.dp_rank, self.dp_size)["dataset"])
        self.stream = iter(self.dataset)


def build_streaming_image_batches(cfg: DataConfig, t: TrainConfig, dp_rank: int, dp_size: int, is_main: bool):
    """(the processor, which checkpoints and the export save whole; this rank's StreamingImageBatches)."""
    ensure_embedded_tokenizer(cfg, is_main)
    processor = load_processor(cfg)
    return processor, StreamingImageBatches(cfg, processor, t, dp_rank, dp_size)
