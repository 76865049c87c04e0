"""Work spread over the ranks of a ``torchrun`` launch: who scores, fits and captures what.

``tda attribute`` and ``tda capture`` under ``torchrun --nproc-per-node N`` run one process
per rank; every rank calls the same methods of its :class:`Ranks` in the same order (each
exchange is a collective). :class:`Ranks` is one process (nothing to exchange);
:class:`GroupRanks` exchanges over the default ``torch.distributed`` process group (gloo
on the CPU, NCCL on CUDA), made by :func:`launched_ranks` from torchrun's environment.

How the work is split, so that the merged result is the one-process result:

* **scoring** (:meth:`Ranks.part`): each rank reads a contiguous range of the training
  store's shards, cut only where the one-process scoring loop starts a chunk and balanced
  by example count. Each rank then reads the very chunks one process reads (the chunking
  rule restarts at each cut), so every example's scores are computed from the same inputs
  by the same operations: on the CPU, bitwise the one-process scores at the same thread
  count.
* **per-layer factorizations** (:meth:`Ranks.owner`, :meth:`Ranks.share`): contiguous
  blocks of layers, one per rank, each factorized by its owner and broadcast: bitwise
  what one process computes.
* **sums over the store** (:meth:`Ranks.sum`): each rank sums its part, the parts are
  all-reduced: equal to one process up to the order of the fp64 additions.
"""

from __future__ import annotations

import atexit
import copy
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.store.reader import StoreReader

#: Tensors of one layer, as a preconditioner keeps them (factors, bases, inverses).
LayerTensors = tuple[Tensor, ...]


class Ranks:
    """One process: it owns every layer and the whole store; exchanges return their input.

    Attributes:
        rank: this process's rank (0 here).
        size: number of ranks (1 here).
        device: where this process computes and where its exchanged tensors live.
    """

    rank = 0
    size = 1

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)

    # -- what is this rank's ----------------------------------------------------------

    def part(self, store: StoreReader, chunk: int) -> StoreReader | None:
        """This rank's share of ``store`` read in chunks of ``chunk`` examples: a reader
        over a contiguous range of its shards (``None`` when the range is empty). The
        range starts and ends where :meth:`StoreReader.iter_chunks` with ``chunk`` starts
        a chunk, so its chunks are exactly the one-process chunks of that range."""
        sizes = _shard_sizes(store)
        ranges = balanced_ranges(sizes, chunk_starts(sizes, chunk), self.size)
        shards = ranges[self.rank]
        return _store_range(store, shards) if len(shards) else None

    def owner(self, index: int, count: int) -> int:
        """The rank that computes item ``index`` of ``count`` (contiguous blocks, so that
        consecutive layers fed by one input, which share a factorization, stay together)."""
        return index * self.size // max(count, 1)

    def owns(self, index: int, count: int) -> bool:
        """Whether this rank computes item ``index`` of ``count``."""
        return self.owner(index, count) == self.rank

    # -- exchanges (collectives under GroupRanks) -------------------------------------

    def share(
        self, local: Mapping[str, LayerTensors], names: Sequence[str]
    ) -> dict[str, LayerTensors]:
        """Every layer's tensors, each computed by its :meth:`owner` (``local`` holds this
        rank's), in ``names`` order, on :attr:`device`."""
        return {name: tuple(t.to(self.device) for t in local[name]) for name in names}

    def sum(self, tensors: Sequence[Tensor]) -> None:
        """Sum each tensor over the ranks, in place (every rank gets the total)."""

    def rows(self, values: Tensor) -> Tensor:
        """``(N_r, ...)`` on each rank -> ``(sum_r N_r, ...)`` on every rank, rank 0's rows
        first (trailing sizes and dtype must agree)."""
        return values

    def objects(self, value: Any) -> list[Any]:
        """One picklable value per rank, in rank order, on every rank."""
        return [value]

    def barrier(self) -> None:
        """Wait until every rank reaches this call."""


class GroupRanks(Ranks):
    """The ranks of the default ``torch.distributed`` process group.

    Tensors travel on :attr:`device` (NCCL needs CUDA tensors, gloo takes CPU ones)."""

    def __init__(self, device: str | torch.device):
        super().__init__(device)
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def share(
        self, local: Mapping[str, LayerTensors], names: Sequence[str]
    ) -> dict[str, LayerTensors]:
        # shapes and dtypes first (a few bytes per layer), then each tensor from its owner
        specs = self.objects({n: [(t.shape, t.dtype) for t in local[n]] for n in local})
        out = {}
        for index, name in enumerate(names):
            owner = self.owner(index, len(names))
            if owner == self.rank:
                tensors = tuple(t.to(self.device).contiguous() for t in local[name])
            else:
                tensors = tuple(
                    torch.empty(shape, dtype=dtype, device=self.device)
                    for shape, dtype in specs[owner][name]
                )
            for tensor in tensors:
                dist.broadcast(tensor, src=owner)
            out[name] = tensors
        return out

    def sum(self, tensors: Sequence[Tensor]) -> None:
        for tensor in tensors:
            dist.all_reduce(tensor)

    def rows(self, values: Tensor) -> Tensor:
        values = values.to(self.device)
        count = torch.tensor([values.shape[0]], dtype=torch.long, device=self.device)
        counts = [torch.empty_like(count) for _ in range(self.size)]
        dist.all_gather(counts, count)
        sizes = [int(c.item()) for c in counts]
        padded = values.new_zeros((max(sizes), *values.shape[1:]))
        padded[: values.shape[0]] = values
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])

    def objects(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        dist.barrier()


def on_device(layers: dict[str, PerExampleGrad], device: torch.device) -> dict[str, PerExampleGrad]:
    """``layers`` with every tensor on ``device`` (the same objects on the CPU, where the
    store is read)."""
    if device.type == "cpu":
        return layers
    return {name: g.map_tensors(lambda t: t.to(device)) for name, g in layers.items()}


def launch_size() -> int:
    """The number of ranks torchrun launched (``WORLD_SIZE``; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_ranks(device: str) -> Ranks:
    """The ranks of this launch computing on ``device``: :class:`Ranks` for one process;
    under torchrun (``WORLD_SIZE`` > 1) :class:`GroupRanks` over the default process group
    (gloo for ``cpu``, NCCL for ``cuda``, each rank on the GPU of its ``LOCAL_RANK``).

    The group is initialized from torchrun's environment if it is not yet, and then kept
    for the life of the process (destroyed at exit): several commands run in one process
    (:func:`tda_plugins.cli.main` called in turn) share it, as a group cannot be made
    again after it is destroyed."""
    if launch_size() == 1:
        return Ranks(device)
    where = torch.device(device)
    if where.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: torchrun launches compute on cpu or cuda only")
    if where.type == "cuda":
        if where.index is not None:
            raise ValueError(
                f"--device {device} under torchrun: give --device cuda, and each rank takes "
                "the GPU of its LOCAL_RANK"
            )
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(where)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if where.type == "cuda" else "gloo")
        atexit.register(dist.destroy_process_group)
    return GroupRanks(where)


# -- the partition of a store ----------------------------------------------------------


def chunk_starts(sizes: Sequence[int], chunk: int) -> list[int]:
    """Index of the first shard of each chunk that :meth:`StoreReader.iter_chunks` forms
    from shards of ``sizes`` examples with ``max_examples=chunk`` (whole shards; a chunk
    closes before the shard that would take it past ``chunk``)."""
    starts: list[int] = []
    held = 0
    for index, size in enumerate(sizes):
        if not starts or held + size > chunk:
            starts.append(index)
            held = 0
        held += size
    return starts


def balanced_ranges(sizes: Sequence[int], starts: Sequence[int], parts: int) -> list[range]:
    """``parts`` contiguous ranges of shard indices covering every shard, cut only at
    ``starts``, the ``r``-th cut at the start whose examples before it are nearest
    ``r / parts`` of all (a range may be empty when there are fewer chunks than parts)."""
    before = [0]
    for size in sizes:
        before.append(before[-1] + size)
    total = before[-1]
    candidates = [*starts, len(sizes)]
    cuts = [0]
    for r in range(1, parts):
        target = total * r / parts
        allowed = [s for s in candidates if s >= cuts[-1]]
        cuts.append(min(allowed, key=lambda s: abs(before[s] - target)))
    cuts.append(len(sizes))
    return [range(cuts[r], cuts[r + 1]) for r in range(parts)]


# The reader lists its shards in ``_shards`` (ordered by step, rank, micro-batch) and
# reads only those; a range of them is a reader of that range. These two functions are the
# only place that relies on it (tests/test_ranks.py checks the chunks against the reader's).


def _shard_sizes(store: StoreReader) -> list[int]:
    return [shard.size for shard in store._shards]


def _store_range(store: StoreReader, shards: range) -> StoreReader:
    part = copy.copy(store)
    part._shards = store._shards[shards.start : shards.stop]
    return part
