"""save_pretrained's safetensors files, written by every rank at once: rank 0 writes each file's header, and
each rank writes its own chunks of the tensors straight at their offsets, through DCP's save."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterable

import torch
import xxhash
from safetensors.torch import save
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def safetensors_layout(whole: dict, files: dict) -> tuple[dict, dict]:
    """The headers save_file writes for `files` ({file: its keys}) of the tensors in `whole` (meta tensors),
    each file's tensors in save_file's order: {file: (its header, its size)}, and {key: (its file, where its
    data starts there)}."""
    order = save_file_order({t.dtype for t in whole.values()})
    headers, offsets = {}, {}
    for file, keys in files.items():
        header, end = {"__metadata__": {"format": "pt"}}, 0
        for key in sorted(keys, key=lambda key: (order[whole[key].dtype], key)):
            t = whole[key]
            begin, end = end, end + t.numel() * t.element_size()
            header[key] = dict(dtype=SAFETENSORS_DTYPES[t.dtype], shape=[*t.shape], data_offsets=[begin, end])
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        headers[file] = (len(text).to_bytes(8, "little") + text, 8 + len(text) + end)
        offsets |= {key: (file, 8 + len(text) + header[key]["data_offsets"][0]) for key in keys}
    return headers, offsets


def save_file_order(dtypes: set[torch.dtype]) -> dict[torch.dtype, int]:
    """save_file writes a file's tensors by dtype (an order of its own, larger first; DeepSeek-V3's fp32
    router weights before its bf16 layers), then by name: the dtypes' order, asked of save_file itself."""
    dtypes = sorted(dtypes, key=str)
    data = save({str(i): torch.zeros(1, dtype=dtype) for i, dtype in enumerate(dtypes)})
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return {dtype: header[str(i)]["data_offsets"][0] for i, dtype in enumerate(dtypes)}


class SafetensorsInPlace(FileSystemWriter):
    """DCP's save into files whose headers are written: each rank writes the chunks DCP's planner gives it
    (its shards; a replicated tensor, by one rank) at their offsets. Not torch's HuggingFaceStorageWriter,
    which writes every byte twice (docs/performance.md#writing-the-export-once)."""

    def __init__(self, path: str, offsets: dict[str, tuple[str, int]]) -> None:
        super().__init__(path)
        self.offsets = offsets
        self.written = []  # (file, position, length, xxh3-64 of the bytes): read back by export_check.py

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.write_regions((i.index.fqn, planner.resolve_data(i), i.tensor_data) for i in plan.items)
        future = Future()
        future.set_result([WriteResult(item.index, item.tensor_storage_size(), None) for item in plan.items])
        return future

    def write_regions(self, items: Iterable[tuple[str, torch.Tensor, TensorWriteData | None]]) -> None:
        """Each (key, tensor, the chunk of the key's weight it is, or None: all of it) at its place in its
        file, its bytes hashed for the read-back and synced."""
        fds = {}
        try:
            for key, tensor, chunk in items:
                file, start = self.offsets[key]
                if file not in fds:
                    fds[file] = os.open(os.path.join(self.path, file), os.O_WRONLY)
                tensor = tensor.detach().cpu().contiguous()
                data, done = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()), 0
                ranges = chunk_ranges(chunk, tensor.element_size()) if chunk else [(0, len(data))]
                for offset, length in ranges:
                    digest = xxhash.xxh3_64_intdigest(data[done : done + length])
                    self.written.append((file, start + offset, length, digest))
                    while length:  # pwrite may write less than asked
                        n = os.pwrite(fds[file], data[done : done + length], start + offset)
                        done, offset, length = done + n, offset + n, length - n
            for fd in fds.values() if self.sync_files else ():  # on disk before the manifest, as DCP's own
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)

    def finish(self, metadata, results) -> None:
        pass  # no DCP metadata: the files are save_pretrained's


def chunk_ranges(data: TensorWriteData, itemsize: int):
    """The byte ranges (offset in the whole tensor's data, length) of a chunk of it, in the chunk's own order:
    one range where the chunk spans whole rows (FSDP's dim-0 shards), else one per row of it."""
    shape, offsets, sizes = data.size, data.chunk.offsets, data.chunk.sizes
    if not shape:
        yield 0, itemsize
        return
    k = len(shape) - 1  # the chunk is whole in the dims after k: each run spans dim k's part of them
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[j + 1 :]) * itemsize for j in range(len(shape))]
    for index in itertools.product(*(range(o, o + s) for o, s in zip(offsets[:k], sizes[:k]))):
        yield sum(i * s for i, s in zip(index, strides)) + offsets[k] * strides[k], sizes[k] * strides[k]
