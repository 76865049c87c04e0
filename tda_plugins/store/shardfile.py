"""Reading a safetensors shard with plain file reads, straight into tensors we allocate.

The safetensors layout is an 8-byte little-endian header length, a JSON header (each
tensor's dtype, shape and byte offsets, plus ``__metadata__``) and the tensors' bytes.
Reading a tensor's bytes with ``readinto`` into its place in a destination tensor (a
chunk of several shards) makes one copy from the page cache, where a memory-mapped
tensor (``safe_open(...).get_tensor``) would be copied into the chunk while its pages
count towards the process's resident memory too. A tensor used as it is stored (a chunk
of one shard) is memory-mapped instead (:meth:`ShardFile.mapped`). The store's writer
keeps using safetensors; files too large to build in memory first (the K-FAC
statistics, the fit cache) are written by :func:`write_streamed`, a tensor at a time.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import struct
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from math import prod
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tda_plugins.store.io import writing
from tda_plugins.store.layout import StoreError

#: torch dtype of each safetensors dtype name a store holds.
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
}


#: safetensors dtype name of each torch dtype.
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def write_streamed(
    path: Path,
    entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors: Iterable[Tensor],
    metadata: Mapping[str, str],
    done: Callable[[int], object] | None = None,
) -> None:
    """Write a safetensors file whose header is known from ``entries`` (key, dtype,
    shape, in file order) before its tensors are: each of ``tensors`` (one per entry,
    in order, produced as the file is written) goes straight from its memory to the file,
    so no more than one of them need exist at a time and no copy of the file is built.
    ``done(bytes)`` after each tensor. A tensor of another shape or dtype than its entry
    is refused."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, dtype, shape in entries:
        size = dtype.itemsize * prod(shape)
        header[key] = {
            "dtype": NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with writing(path), open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for (key, dtype, shape), tensor in zip(entries, tensors, strict=True):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                got = f"{tensor.dtype} {tuple(tensor.shape)}"
                raise ValueError(f"{key} is {got}, not {dtype} {shape}")
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            data.numpy().tofile(f)  # straight from the tensor's memory
            if done is not None:
                done(data.numel())


class ShardFile:
    """An open shard: its header on construction, any tensor's bytes on demand.

    Use as a context manager (the file is closed on exit)."""

    def __init__(self, path: Path):
        if sys.byteorder != "little":
            raise StoreError("gradient stores are little-endian; this machine is not")
        self.path = path
        self._file = io.FileIO(path, "rb")  # closed in __exit__
        try:
            size = int.from_bytes(self._read_exactly(8), "little")
            if size > os.fstat(self._file.fileno()).st_size - 8:
                raise ValueError(f"its header length {size} runs past the end of the file")
            header: dict[str, Any] = json.loads(self._read_exactly(size))
        except (ValueError, OSError) as error:
            self._file.close()
            raise StoreError(
                f"{path} is not a readable gradient shard ({error}); the store is damaged: "
                "recapture it"
            ) from error
        self._data_start = 8 + size
        self._map: mmap.mmap | None = None
        self.metadata: dict[str, str] = header.pop("__metadata__", {})
        self._entries: dict[str, dict[str, Any]] = header

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key)["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return DTYPES[self._entry(key)["dtype"]]

    def read(self, key: str) -> Tensor:
        """The tensor stored under ``key``, in a new tensor."""
        out = torch.empty(self.shape(key), dtype=self.dtype(key))
        self.read_into(key, out)
        return out

    def mapped(self, key: str) -> Tensor:
        """The tensor stored under ``key`` as a copy-on-write memory map of the file: no
        copy is made, its pages are read when first touched, and writes to it stay in
        this process. It stays valid after the file is closed."""
        shape, dtype = self.shape(key), self.dtype(key)
        begin, end = self._entry(key)["data_offsets"]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        if self._map is None:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        count = (end - begin) // dtype.itemsize
        flat = torch.frombuffer(
            self._map, dtype=dtype, count=count, offset=self._data_start + begin
        )
        return flat.view(shape)

    def read_into(self, key: str, out: Tensor) -> None:
        """Copy the tensor stored under ``key`` into ``out``, a CPU tensor of its shape
        (a view into a larger tensor may be strided, or of another dtype: then the bytes
        pass through one temporary of the stored tensor's size)."""
        if tuple(out.shape) != self.shape(key):
            raise StoreError(
                f"{self.path.name}: {key} has shape {self.shape(key)}, not {out.shape}"
            )
        if not out.is_contiguous() or out.dtype != self.dtype(key):
            out.copy_(self.read(key))
            return
        begin, end = self._entry(key)["data_offsets"]
        self._file.seek(self._data_start + begin)
        view = out.view(-1).view(torch.uint8).numpy().data  # a memoryview of out
        if len(view) != end - begin:
            raise StoreError(f"{self.path.name}: {key} holds {end - begin} bytes, not {len(view)}")
        filled = 0
        while filled < len(view):
            count = self._file.readinto(view[filled:])
            if not count:
                raise StoreError(f"{self.path} ends inside {key}: the store is damaged")
            filled += count

    def _entry(self, key: str) -> dict[str, Any]:
        if key not in self._entries:
            raise StoreError(f"{self.path.name} holds no tensor {key!r}")
        return self._entries[key]

    def _read_exactly(self, count: int) -> bytes:
        data = self._file.read(count)
        if len(data) != count:
            raise ValueError(f"the file ends after {len(data)} of {count} header bytes")
        return data
