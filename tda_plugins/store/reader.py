"""Reading a gradient store: a merged view over every rank, streamed in bounded chunks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tda_plugins.grads.factors import PerExampleGrad
from tda_plugins.store.chunks import ShardContents, read_chunk
from tda_plugins.store.io import read_json
from tda_plugins.store.layout import (
    EXAMPLES_FILE,
    INDEX_FILE,
    StoreError,
    read_header,
)


@dataclass
class StoreChunk:
    """Per-example gradients of a run of consecutive stored examples.

    Attributes:
        example_ids: ``(N,)`` int64 ids.
        steps: ``(N,)`` int64 optimizer step each example was captured at.
        layers: layer name -> per-example gradients (``N`` examples), in store order.
    """

    example_ids: Tensor
    steps: Tensor
    layers: dict[str, PerExampleGrad]

    @property
    def size(self) -> int:
        return int(self.example_ids.shape[0])


@dataclass(frozen=True)
class _Shard:
    path: Path
    step: int
    rank: int
    micro_batch: int
    size: int


class StoreReader:
    """Read-only, merged view of a store written by one or more ranks.

    Shards are ordered by (step, rank, micro-batch). Reading never loads more than one
    chunk of ``max_examples`` examples at a time, so stores larger than RAM can be scored.
    """

    def __init__(self, path: str | Path):
        self.root = Path(path)
        self.config, self.metadata = read_header(self.root)
        self._shards = self._list_shards()

    def _committed(self) -> list[_Shard]:
        """The committed shards, refusing a store that has none."""
        if not self._shards:
            raise StoreError(f"the store {self.root} holds no committed step")
        return self._shards

    def _list_shards(self) -> list[_Shard]:
        shards = []
        for index in sorted(self.root.glob(f"rank-*/{INDEX_FILE}")):
            rank = int(index.parent.name.split("-", 1)[1])
            for entry in read_json(index)["shards"]:
                shards.append(
                    _Shard(
                        index.parent / entry["file"],
                        int(entry["step"]),
                        rank,
                        int(entry["micro_batch"]),
                        len(entry["example_ids"]),
                    )
                )
        return sorted(shards, key=lambda s: (s.step, s.rank, s.micro_batch))

    @property
    def layer_names(self) -> list[str]:
        return list(self.config.layers)

    @property
    def num_examples(self) -> int:
        return sum(s.size for s in self._shards)

    @property
    def steps(self) -> list[int]:
        """Distinct committed optimizer steps, ascending."""
        return sorted({s.step for s in self._shards})

    def require_compatible(self, other: StoreReader) -> None:
        """Raise unless ``other`` was captured with the same layers, projection and loss."""
        differences = self.config.differences(other.config)
        if differences:
            raise StoreError(
                f"queries in {other.root} do not match the store {self.root}: "
                f"{'; '.join(differences)}. Capture the queries with the store's options"
            )

    def texts(self) -> dict[int, str]:
        """Example id -> text, where the capture saved texts (else empty)."""
        path = self.root / EXAMPLES_FILE
        if not path.exists():
            return {}
        rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
        return {int(r["id"]): r["text"] for r in rows}

    def iter_chunks(
        self, max_examples: int = 256, layers: list[str] | None = None
    ) -> Iterator[StoreChunk]:
        """Consecutive chunks of at most ``max_examples`` examples (whole micro-batches;
        a micro-batch larger than the limit is its own chunk)."""
        shards = self._committed()
        layers = list(self.config.layers) if layers is None else layers
        group: list[_Shard] = []
        for shard in shards:
            if group and sum(s.size for s in group) + shard.size > max_examples:
                yield self._chunk(group, layers)
                group = []
            group.append(shard)
        yield self._chunk(group, layers)

    def _chunk(self, shards: list[_Shard], layers: list[str]) -> StoreChunk:
        ids, grads = read_chunk([shard.path for shard in shards], layers)
        steps = torch.cat([torch.full((shard.size,), shard.step) for shard in shards])
        return StoreChunk(ids, steps, grads)

    def load_all(self, layers: list[str] | None = None) -> StoreChunk:
        """Every stored example in one chunk (for query sets), of ``layers`` (default
        all)."""
        return next(self.iter_chunks(max_examples=max(self.num_examples, 1), layers=layers))

    def layer_nbytes(self) -> dict[str, int]:
        """Layer name -> stored bytes per example (a tensor shared by several layers
        counted with the first), read from the first shard's header only."""
        contents = ShardContents.read(self._committed()[0].path, self.layer_names)
        return {
            name: -(-sum(t.nbytes for t in entry.fields.values() if not t.shared) // contents.rows)
            for name, entry in contents.layers.items()
        }

    def values_dtype(self) -> torch.dtype:
        """The accumulation dtype of the stored gradients (as :func:`values_dtype` of a
        loaded one): fp64 when any stored gradient tensor is fp64, else fp32; read from
        the first shard's header only."""
        contents = ShardContents.read(self._committed()[0].path, self.layer_names)
        dtypes = {t.dtype for layer in contents.layers.values() for t in layer.fields.values()}
        return torch.float64 if torch.float64 in dtypes else torch.float32
