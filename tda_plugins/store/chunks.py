"""Reading a run of stored micro-batches as one chunk, into buffers of the whole chunk.

A chunk of ``N`` examples costs its own size in memory, not twice it: each stored tensor
is read straight into its rows of a chunk-sized buffer (:class:`ShardFile` reads a
file's bytes into it), so the micro-batches' tensors and their concatenation are never
held together. A tensor stored once for several layers (the input q/k/v share) fills one
buffer that those layers share, as they shared it when captured. Buffer shapes come from
the shards' headers, read first (:class:`ShardContents`). Shards are opened through the
store's :class:`~tda_plugins.store.medium.ShardMedium`: files, or a memory store's
tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.dense import stack_examples
from tda_plugins.store.codec import decode, stacked_shape
from tda_plugins.store.layout import StoreError
from tda_plugins.store.medium import OpenShard, ShardMedium


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a shard, from its header.

    Attributes:
        key: the key it is stored under (for a tensor shared with an earlier layer, that
            layer's key).
        shape: its shape, examples first.
        dtype: its dtype.
        shared: stored under an earlier layer's key (counted with that layer).
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shared: bool

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class StoredLayer:
    """One layer's gradients in a shard: representation name, string attributes, and
    the stored tensor of each field."""

    kind: str
    attrs: dict[str, str]
    fields: dict[str, StoredTensor]


@dataclass(frozen=True)
class ShardContents:
    """What one shard holds for some layers, read from its header only (no tensor data).

    Attributes:
        path: the shard file.
        rows: examples in the shard.
        layers: layer name -> its stored gradients.
    """

    path: Path
    rows: int
    layers: dict[str, StoredLayer]

    @classmethod
    def read(cls, medium: ShardMedium, path: Path, layers: list[str]) -> ShardContents:
        """The header entries of ``layers`` of the shard ``path`` in ``medium``; a layer
        the shard lacks is an error that says why a capture leaves one out."""
        with medium.open(path) as f:
            meta: dict[str, Any] = json.loads(f.metadata["layers"])
            aliases: dict[str, str] = json.loads(f.metadata["aliases"])

            def stored(key: str) -> StoredTensor:
                at = aliases.get(key, key)
                return StoredTensor(at, f.shape(at), f.dtype(at), key in aliases)

            entries = {}
            for name in layers:
                if name not in meta:
                    raise StoreError(
                        f"{path.name} holds no gradient for layer {name!r}: it received "
                        "none through its module call (unused, or its weight used directly, "
                        "as a fused loss head does); recapture without that layer"
                    )
                fields = {field: stored(f"{name}::{field}") for field in meta[name]["fields"]}
                entries[name] = StoredLayer(meta[name]["kind"], meta[name]["attrs"], fields)
            rows = f.shape("example_ids")[0]
        return cls(path, rows, entries)


class _Buffer:
    """One field's tensors of every shard of a chunk, stacked along the examples: each
    shard's tensor is read into its rows (zeros pad the axes where it is shorter)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, padded: bool):
        self.tensor = (torch.zeros if padded else torch.empty)(shape, dtype=dtype)

    def fill(self, shard: OpenShard, key: str, start: int) -> None:
        shape = shard.shape(key)
        rows = (slice(start, start + shape[0]),)
        shard.read_into(key, self.tensor[rows + tuple(slice(0, size) for size in shape[1:])])


def read_chunk(
    medium: ShardMedium, paths: list[Path], layers: list[str]
) -> tuple[Tensor, dict[str, PerExampleGrad]]:
    """``(N,)`` example ids and the gradients of ``layers`` (``N`` examples each) of the
    shards ``paths`` in ``medium``, in order, as one chunk.

    One shard's tensors are used as they are stored (no copy: a file's are memory-mapped,
    their pages resident once touched; a memory store's are its own tensors). Of several,
    a layer stored in the same representation by every shard is read into chunk buffers.
    One whose representation changes between its shards (a store keeps the smaller form
    per micro-batch) is read a shard at a time and stacked as
    :func:`~tda_plugins.grads.dense.stack_examples` does."""
    shards = [ShardContents.read(medium, path, layers) for path in paths]
    if len(shards) == 1:
        return _mapped_shard(medium, shards[0], layers)
    buffers: dict[tuple[str, ...], _Buffer] = {}
    uniform: dict[str, dict[str, tuple[str, ...]]] = {}  # layer -> field -> buffer
    mixed: dict[str, list[PerExampleGrad]] = {}
    for name in layers:
        entries = [shard.layers[name] for shard in shards]
        if len({entry.kind for entry in entries}) > 1:
            mixed[name] = []
            continue
        uniform[name] = {}
        for field in entries[0].fields:
            stored = [entry.fields[field] for entry in entries]
            keys = tuple(t.key for t in stored)  # equal for layers that share the tensor
            uniform[name][field] = keys
            if keys not in buffers:
                shape = stacked_shape(entries[0].kind, field, [t.shape for t in stored])
                dtype = _promoted([t.dtype for t in stored])
                padded = any(t.shape[1:] != shape[1:] for t in stored)
                buffers[keys] = _Buffer(shape, dtype, padded)
    ids, start = [], 0
    for i, shard in enumerate(shards):
        with medium.open(shard.path) as f:
            ids.append(f.read("example_ids"))
            for keys, buffer in buffers.items():
                buffer.fill(f, keys[i], start)
            for name, parts in mixed.items():
                entry = shard.layers[name]
                tensors = {field: f.read(t.key) for field, t in entry.fields.items()}
                parts.append(decode(entry.kind, tensors, entry.attrs))
        start += shard.rows
    grads = {}
    for name in layers:
        if name in mixed:
            grads[name] = stack_examples(mixed[name])
        else:
            entry = shards[0].layers[name]
            tensors = {field: buffers[keys].tensor for field, keys in uniform[name].items()}
            grads[name] = decode(entry.kind, tensors, entry.attrs)
    return torch.cat(ids), grads


def _mapped_shard(
    medium: ShardMedium, shard: ShardContents, layers: list[str]
) -> tuple[Tensor, dict[str, PerExampleGrad]]:
    """A chunk of one shard: its tensors as stored, not copied (a tensor shared by
    several layers taken once)."""
    with medium.open(shard.path) as f:
        tensors: dict[str, Tensor] = {}
        grads = {}
        for name in layers:
            entry = shard.layers[name]
            for t in entry.fields.values():
                if t.key not in tensors:
                    tensors[t.key] = f.mapped(t.key)
            fields = {field: tensors[t.key] for field, t in entry.fields.items()}
            grads[name] = decode(entry.kind, fields, entry.attrs)
        return f.read("example_ids"), grads


def _promoted(dtypes: list[torch.dtype]) -> torch.dtype:
    out = dtypes[0]
    for dtype in dtypes[1:]:
        out = torch.promote_types(out, dtype)
    return out
