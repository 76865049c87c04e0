"""Where a store's shards live: files in the rank directory, or tensors in this process.

The writer and the reader reach shard bytes only through a :class:`ShardMedium`: a store
on disk (:data:`FILES`) keeps each shard as a safetensors file, a memory store
(:class:`~tda_plugins.store.memory.MemoryShards`) keeps the captured tensors themselves.
Everything else (the header, the indexes, the end markers, the K-FAC statistics) is a
small file in the store's folder either way, so both are read through the same
:class:`~tda_plugins.store.reader.StoreReader`, chunk for chunk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file
from torch import Tensor

from tda_plugins.store.index import file_checksum, verify_checksum
from tda_plugins.store.io import write_renamed
from tda_plugins.store.layout import SHARD_PATTERN
from tda_plugins.store.shardfile import ShardFile


class OpenShard(Protocol):
    """One shard opened for reading (a context manager): its layers' metadata, and each
    tensor's shape, dtype and values by key."""

    metadata: dict[str, str]

    def __enter__(self) -> OpenShard: ...
    def __exit__(self, *exc: object) -> None: ...
    def shape(self, key: str) -> tuple[int, ...]: ...
    def dtype(self, key: str) -> torch.dtype: ...
    def read(self, key: str) -> Tensor:
        """The tensor in a new tensor of its own."""
        ...

    def mapped(self, key: str) -> Tensor:
        """The tensor without a copy: not to be written to."""
        ...

    def read_into(self, key: str, out: Tensor) -> None:
        """Copy the tensor into ``out``, a tensor (or view) of its shape."""
        ...


class ShardMedium(Protocol):
    """How shards are saved, checked, opened and removed, by their path in the rank
    directory (``rank-<r>/s<step>-m<mb>.safetensors``).

    Attributes:
        on_disk: the shards are files (so fsyncs make them durable); ``False``: they live
            in this process and are gone with it.
    """

    on_disk: bool

    def save(self, path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
        """Keep ``tensors`` (contiguous, on the CPU) as the shard ``path``; it is complete
        or absent, never partial."""
        ...

    def checksum(self, path: Path) -> str:
        """The shard's digest (16 hex digits) for its index entry."""
        ...

    def verify(self, path: Path, expected: str, *, damaged: str) -> None:
        """Refuse (:class:`~tda_plugins.store.layout.StoreError`, ending with
        ``damaged``) a shard that is missing or no longer matches ``expected``."""
        ...

    def open(self, path: Path) -> OpenShard: ...

    def remove(self, path: Path) -> None:
        """Drop the shard, if it exists."""
        ...

    def shard_paths(self, folder: Path) -> list[Path]:
        """Every shard the rank directory ``folder`` holds, listed or not."""
        ...


class FileShards:
    """Shards as safetensors files (:class:`~tda_plugins.store.shardfile.ShardFile`),
    written by ``save_file`` under a temporary name and renamed into place."""

    on_disk = True

    def save(self, path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
        # safetensors writes the tensors straight into the file (no serialized copy),
        # releasing the GIL
        write_renamed(path, lambda tmp: save_file(tensors, tmp, metadata))

    def checksum(self, path: Path) -> str:
        return file_checksum(path)

    def verify(self, path: Path, expected: str, *, damaged: str) -> None:
        verify_checksum(path, expected, damaged=damaged)

    def open(self, path: Path) -> OpenShard:
        return ShardFile(path)

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def shard_paths(self, folder: Path) -> list[Path]:
        return [p for p in folder.iterdir() if SHARD_PATTERN.fullmatch(p.name)]


#: The medium of every store on disk (it holds no state).
FILES = FileShards()
