"""A rank's index: the committed shards, validated before anything reads or removes a file.

``rank-<r>/index.json`` is ``{"shards": [entry, ...]}``, one entry per committed
micro-batch::

    {"file": "s00000003-m000012.safetensors", "step": 3, "micro_batch": 12,
     "example_ids": [...], "xxh3": "<XXH3-64 of the shard file, 16 hex digits>"}

An index is data from disk, so it is checked as untrusted input: every key present with
its type, the file name exactly the one its step and micro-batch give (so an entry can
only ever name a file inside its own rank directory: no separator, no ``..``, no absolute
path), no shard listed twice, and a checksum of the right form. Reading and removing
shards goes through :class:`ShardEntry`, so no path comes from an index unchecked.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from tda_plugins.store.io import atomic_write_json, read_json
from tda_plugins.store.layout import SHARD_PATTERN, StoreError, shard_name

_CHECKSUM = re.compile(r"[0-9a-f]{16}")


def file_checksum(path: Path) -> str:
    """XXH3-64 of a file's bytes as 16 hex digits, hashed straight from a read-only memory
    map (no copy out of the page cache, which the reader maps anyway).

    A checksum against damage (flipped bits, a truncated or overwritten file), not against
    forgery: whoever can rewrite a shard can rewrite its index entry too, so no digest would
    stop a crafted store; the reader's value checks do. XXH3 runs at about 25 GB/s on one
    core here, against 3.7 GB/s for CRC-32 and 0.6 GB/s for BLAKE2b, so that verifying
    every shard on read costs a few percent of scoring (``benchmarks/store_integrity.py``).
    """
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_64_hexdigest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return xxhash.xxh3_64_hexdigest(mapped)


def verify_checksum(path: Path, expected: str, *, damaged: str) -> None:
    """Refuse a file whose :func:`file_checksum` is not ``expected``, or that cannot be
    read; ``damaged`` ends the error: what is damaged and the way out."""
    try:
        digest = file_checksum(path)
    except OSError as error:
        raise StoreError(f"cannot read {path} ({error}); {damaged}") from error
    if digest != expected:
        raise StoreError(
            f"{path} does not match its checksum (its bytes changed after it was written: "
            f"disk damage or an edit); {damaged}"
        )


def read_index_json(path: Path, *, damaged: str) -> Any:
    """An index file's JSON value (``None`` when there is no file); an unreadable one is a
    :class:`StoreError` ending with ``damaged``."""
    if not path.exists():
        return None
    try:
        return read_json(path)
    except ValueError as error:
        raise StoreError(f"{error}; {damaged}") from error


@dataclass(frozen=True)
class ShardEntry:
    """One committed micro-batch of a rank.

    Attributes:
        file: the shard's file name inside the rank directory (``s<step>-m<mb>``).
        step: optimizer step.
        micro_batch: micro-batch counter of the capture that wrote it.
        example_ids: ids of its examples, in row order.
        xxh3: :func:`file_checksum` of the shard file.
    """

    file: str
    step: int
    micro_batch: int
    example_ids: tuple[int, ...]
    xxh3: str

    def path(self, folder: Path) -> Path:
        """The shard file in the rank directory ``folder``."""
        return folder / self.file

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "step": self.step,
            "micro_batch": self.micro_batch,
            "example_ids": list(self.example_ids),
            "xxh3": self.xxh3,
        }

    @classmethod
    def from_json(cls, value: Any, where: str) -> ShardEntry:
        """Validate one index entry; ``where`` names it in errors."""
        if not isinstance(value, dict):
            raise StoreError(f"{where} is not an object; the index is damaged: recapture")
        missing = sorted({"file", "step", "micro_batch", "example_ids", "xxh3"} - set(value))
        if missing:
            raise StoreError(f"{where} lacks {missing}; the index is damaged: recapture")
        step, micro_batch = value["step"], value["micro_batch"]
        if not all(type(v) is int and v >= 0 for v in (step, micro_batch)):
            raise StoreError(f"{where}: step and micro_batch must be integers >= 0")
        name = value["file"]
        if not isinstance(name, str) or not SHARD_PATTERN.fullmatch(name):
            raise StoreError(
                f"{where} names the file {name!r}, which is not a shard name of this store "
                "(a path outside the store, or a damaged index); nothing was read or removed"
            )
        if name != shard_name(step, micro_batch):
            raise StoreError(f"{where}: file {name} does not match its step and micro-batch")
        ids = value["example_ids"]
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise StoreError(f"{where}: example_ids must be a list of integers")
        digest = value["xxh3"]
        if not isinstance(digest, str) or not _CHECKSUM.fullmatch(digest):
            raise StoreError(f"{where}: xxh3 must be a 16-digit hex checksum")
        return cls(name, step, micro_batch, tuple(ids), digest)


def read_index(path: Path) -> list[ShardEntry]:
    """The validated entries of an index file, in order (``[]`` when it does not exist)."""
    value = read_index_json(path, damaged="the index is damaged: recapture")
    if value is None:
        return []
    if not isinstance(value, dict) or not isinstance(value.get("shards"), list):
        raise StoreError(f"{path} is not a shard index (no 'shards' list); recapture")
    entries = [ShardEntry.from_json(v, f"{path} entry {i}") for i, v in enumerate(value["shards"])]
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if entry.file in seen:
            raise StoreError(f"{path} entry {i} lists {entry.file} a second time; recapture")
        seen.add(entry.file)
    return entries


def write_index(path: Path, entries: list[ShardEntry], *, durable: bool = True) -> None:
    """Replace the index atomically (a reader sees the old or the new one, never a mix);
    ``durable=False``: without its fsyncs (on disk only after a later sync)."""
    atomic_write_json(path, {"shards": [e.to_json() for e in entries]}, durable=durable)
