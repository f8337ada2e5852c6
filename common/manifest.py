"""Every checkpoint and export records a manifest when it is complete (manifest.json: each file's size and
XXH3 checksum), so that a damaged file can be named before it is loaded (common/ops/integrity.py)."""

from __future__ import annotations

import json
import os

import xxhash

MANIFEST = "manifest.json"
CHUNK = 16 * 2**20


def checksum(path: str) -> str:
    """XXH3-64, not CRC-32: a save pays 5% for it here, 12.5% with CRC-32 (docs/performance.md)."""
    digest, block = xxhash.xxh3_64(), memoryview(bytearray(CHUNK))  # one buffer: read() makes one per block
    with open(path, "rb") as f:
        while n := f.readinto(block):
            digest.update(block[:n])
    return digest.hexdigest()


def file_entries(directory: str, names: list[str]) -> dict:
    """{name: {"bytes", "xxh3_64"}} of these files of `directory`."""
    out = {}
    for name in names:
        path = os.path.join(directory, name)
        out[name] = {"bytes": os.path.getsize(path), "xxh3_64": checksum(path)}
    return out


def write_manifest(directory: str, known: dict | None = None) -> None:
    """manifest.json for every file of `directory`, then every file and folder of it synced to disk, so that
    what the manifest describes survives a node's crash once the directory is renamed into place (DCP's
    writer syncs only its own files). `known`: entries already computed (by the ranks that wrote those
    files, in parallel)."""
    entries = dict(known or {})
    rest = [n for n in os.listdir(directory) if n not in entries and n != MANIFEST]
    entries.update(file_entries(directory, [n for n in rest if os.path.isfile(os.path.join(directory, n))]))
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(dict(sorted(entries.items())), f, indent=1)
    for root, _, names in os.walk(directory):
        for path in [*(os.path.join(root, name) for name in names), root]:
            fsync_path(path)


def fsync_path(path: str) -> None:
    """fsync a file, or a directory's entries (a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
