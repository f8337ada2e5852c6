"""Whether what is on disk is whole, checked before it is loaded: a checkpoint or export against its manifest
(common/manifest.py), DCP's index, and a model directory's structure (config.json, weights, shards,
safetensors headers), so a damaged file is one line naming it, not a traceback from deep inside DCP or
safetensors. After a checkpoint failed to load, the same checks and a read of every tensor tell damage
apart from a failure elsewhere. A file that cannot be read at all (OSError) is no evidence: it raises."""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from common.config import ConfigError, ModelConfig
from common.manifest import MANIFEST, checksum

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".distcp")
WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_model_files(cfg: ModelConfig) -> None:
    """A local model.name_or_path must be whole: config.json, the weight files and their sizes, safetensors
    headers, DCP's index. Checked on every rank before any work; it reads only headers. The checksums come
    once the process group exists (verify_model_checksums), so the ranks can share them."""
    if cfg.name_or_path and os.path.isdir(cfg.name_or_path):
        try:
            problem = model_dir_damage(cfg.name_or_path, checksums=False)
        except OSError as e:
            raise ConfigError(f"model.name_or_path {cfg.name_or_path!r} could not be read ({e})") from None
        if problem:
            raise ConfigError(f"model.name_or_path {cfg.name_or_path!r} is damaged: {problem}")


def verify_model_checksums(cfg: ModelConfig, checksums: bool) -> None:
    """A local model directory's weight files against its manifest's checksums, each rank its share (file i
    on rank i mod the world size): across the ranks the weights are read once, not once per rank, and in
    parallel. Every rank takes the finding, so a damaged file is one line on every rank."""
    path = cfg.name_or_path
    if not (checksums and path and os.path.isdir(path)):
        return
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        problem = damage(path, weights_only=True, share=(rank, world))
        error = problem and f"model.name_or_path {path!r} is damaged: {problem}"
    except OSError as e:
        error = f"model.name_or_path {path!r} could not be read ({e})"
    if error := first_on_any_rank(error):
        raise ConfigError(error)


def first_on_any_rank(error: str | None) -> str | None:
    """The first rank's error, on every rank (None where none had one)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return error
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def damage(
    directory: str, checksums: bool = True, weights_only: bool = False, share: tuple[int, int] = (0, 1)
) -> str | None:
    """What is wrong with a checkpoint or export directory, naming the file; None if nothing is. Without a
    manifest (written before manifests existed) only DCP's own index is checked. `weights_only`: leave out the
    small files a person may edit on purpose (config.json, the tokenizer's). `share` (rank, world size):
    checksum only every world-size-th file, from the rank-th; sizes are checked for all."""
    problem = None
    manifest = os.path.join(directory, MANIFEST)
    if os.path.exists(manifest):
        try:
            with open(manifest) as f:
                entries = json.load(f)
        except ValueError as e:
            return f"{manifest} is unreadable ({e})"
        names = [name for name in entries if name.endswith(WEIGHT_SUFFIXES) or not weights_only]
        for index, name in enumerate(names):
            entry = entries[name]
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                return f"{path} is missing"
            size = os.path.getsize(path)
            if size != entry["bytes"]:
                return (
                    f"{path} has {size:,} bytes, {entry['bytes']:,} when written (truncated or overwritten)"
                )
            mine = index % share[1] == share[0]
            if checksums and mine and "xxh3_64" in entry and checksum(path) != entry["xxh3_64"]:
                return f"{path} does not match its checksum (corrupted)"
    if os.path.exists(os.path.join(directory, ".metadata")):
        problem = _dcp_damage(directory)
    return problem


def _dcp_damage(directory: str) -> str | None:
    """DCP's index readable, and every byte range it names inside its files."""
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except OSError:
        raise
    except Exception as e:  # an unpickling error of any type: the index is damaged
        return f"{os.path.join(directory, '.metadata')} is unreadable ({type(e).__name__})"
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            return f"{path} is missing"
        if os.path.getsize(path) < end:
            have = os.path.getsize(path)
            return f"{path} has {have:,} bytes but the checkpoint reads up to byte {end:,} (truncated)"
    return None


def load_damage(directory: str, checksums: bool = True) -> str | None:
    """After a checkpoint failed to load: what in it shows damage, naming the file; None if nothing does,
    and the failure came from elsewhere (an I/O timeout, memory, a rank). Costs a read of the whole
    checkpoint, on one rank (docs/checkpoints.md)."""
    if problem := damage(directory, checksums):
        return problem
    if not os.path.exists(os.path.join(directory, ".metadata")):
        return f"{os.path.join(directory, '.metadata')} is missing"
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".json")):  # train_state.json's too
        try:
            with open(os.path.join(directory, name), "rb") as f:
                json.load(f)
        except ValueError as e:  # UnicodeDecodeError too
            return f"{os.path.join(directory, name)} is not valid JSON ({e})"
    if checksums and os.path.exists(os.path.join(directory, MANIFEST)):
        return None  # every byte is as written: a read cannot fail on the content
    return _unreadable_tensor(directory)


def _unreadable_tensor(directory: str) -> str | None:
    """Each tensor of a DCP checkpoint read as DCP reads it (torch.load of its byte range), one at a time:
    what a damaged file without a manifest, or with checksums off, breaks."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(directory).read_metadata()
    items = sorted(metadata.storage_data.items(), key=lambda item: (item[1].relative_path, item[1].offset))
    for index, info in items:
        if info.transform_descriptors or not isinstance(
            metadata.state_dict_metadata.get(index.fqn), TensorStorageMetadata
        ):
            continue  # compressed, or not a tensor: our checkpoints hold neither
        path = os.path.join(directory, info.relative_path)
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except MemoryError:
            raise
        except Exception as e:  # a format or unpickling error of any type: the bytes are damaged
            return f"{path} is unreadable at {index.fqn} ({type(e).__name__})"
    return None


def what_failed(failed: BaseException) -> str:
    """`Type: first line`; for DCP's CheckpointException, that of the exception it carries from the first
    rank that failed, not its own text (every rank's traceback)."""
    where = ""
    if isinstance(failed, CheckpointException) and failed.failures:
        rank, carried = min(failed.failures.items(), key=lambda item: item[0])
        where, failed = f"rank {rank}: ", carried[0] if isinstance(carried, tuple) else carried
    return f"{where}{type(failed).__name__}: {(str(failed).splitlines() or [''])[0]}"


def damage_seen_by_rank0(path: str, checksums: bool) -> str | None:
    """Rank 0 looks for damage in the checkpoint, every rank takes its finding. A look that fails (the
    storage is still unreachable, memory) is no evidence."""
    problem: list = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        with contextlib.suppress(Exception):
            problem[0] = load_damage(path, checksums)
    if dist.is_initialized():
        dist.broadcast_object_list(problem, src=0)
    return problem[0]


def model_dir_damage(directory: str, checksums: bool = True) -> str | None:
    """What is wrong with a local model directory (an HF checkpoint or an export), naming the file.
    `checksums`: an export's weight files against its manifest's; every rank reads them, from the page
    cache after the first rank of a node (about 15 GB/s of hashing here, docs/checkpoints.md)."""
    config = os.path.join(directory, "config.json")
    try:
        with open(config) as f:
            json.load(f)
    except ValueError as e:
        return f"{config} is not valid JSON ({e})"
    except OSError:
        return f"{directory} has no config.json"
    problem = damage(directory, checksums, weights_only=True)  # against its manifest, if it has one
    if problem or os.path.exists(os.path.join(directory, ".metadata")):  # a SHARDED export: DCP checked
        return problem
    present = [name for name in WEIGHTS if os.path.exists(os.path.join(directory, name))]
    if not present:
        return f"{directory} has no weights (none of {', '.join(WEIGHTS)})"
    if present[0].endswith(".index.json"):
        index = os.path.join(directory, present[0])
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError) as e:
            return f"{index} is not a valid weight index ({e})"
        missing = [s for s in shards if not os.path.exists(os.path.join(directory, s))]
        if missing:
            return f"{index} names {os.path.join(directory, missing[0])}, which is missing"
        files = [s for s in shards if s.endswith(".safetensors")]
    else:
        files = [n for n in present if n.endswith(".safetensors")]
    for name in files:
        if problem := _safetensors_damage(os.path.join(directory, name)):
            return problem
    return None


def _safetensors_damage(path: str) -> str | None:
    """The header readable and every tensor's bytes inside the file: what an interrupted copy breaks."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length)) if 8 + length <= size else None
    except (struct.error, ValueError, UnicodeDecodeError):
        header = None
    if header is None:
        return f"{path} is not a readable safetensors file (its header is cut or damaged)"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        return f"{path} has {size:,} bytes but its tensors end at byte {8 + length + end:,} (truncated)"
    return None
