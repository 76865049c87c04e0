"""The partition of a store between ranks (:mod:`tda_plugins.parallel.ranks`), in one process: each
rank's part, read in chunks, gives exactly the chunks one process reads, in order."""

from __future__ import annotations

import pytest
import torch

from tda_plugins.cli import main
from tda_plugins.parallel.ranks import Ranks, balanced_ranges, chunk_starts
from tda_plugins.store import StoreReader
from tests.models import tiny_causal_lm
from tests.test_cli import random_sequences, write_examples


class Rank(Ranks):
    """Rank ``rank`` of ``size``, for :meth:`Ranks.part` (which exchanges nothing)."""

    def __init__(self, rank: int, size: int):
        super().__init__("cpu")
        self.rank, self.size = rank, size


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> StoreReader:
    """11 examples in shards of 2, 3, 1, 4, 1 (one capture per shard, appended)."""
    root = tmp_path_factory.mktemp("ranks")
    tiny_causal_lm("llama").save_pretrained(root / "model")
    first = 0
    for size in (2, 3, 1, 4, 1):
        data = write_examples(root / "d.jsonl", random_sequences(range(first, first + size), first))
        argv = ["capture", "--model", root / "model", "--data", data, "--out", root / "store"]
        assert main([str(a) for a in [*argv, "--batch-size", 8, "--no-curvature", "--append"]]) == 0
        first += size
    return StoreReader(root / "store")


def chunk_ids(store: StoreReader | None, chunk: int) -> list[list[int]]:
    if store is None:
        return []
    return [c.example_ids.tolist() for c in store.iter_chunks(chunk)]


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5, 6, 11])
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_parts_read_the_one_process_chunks(store: StoreReader, chunk: int, size: int) -> None:
    """Concatenated over the ranks, the parts' chunks are the store's chunks (same
    examples in each, same order), for every chunk size and rank count, empty parts
    (more ranks than chunks) included."""
    parts = [Rank(rank, size).part(store, chunk) for rank in range(size)]
    assert [ids for part in parts for ids in chunk_ids(part, chunk)] == chunk_ids(store, chunk)
    assert sum(0 if p is None else p.num_examples for p in parts) == store.num_examples == 11


def test_chunk_starts_follow_the_reader(store: StoreReader) -> None:
    """The shards at which :func:`chunk_starts` opens chunks are those at which the reader
    does (shard sizes 2, 3, 1, 4, 1)."""
    sizes = [2, 3, 1, 4, 1]
    assert [len(ids) for ids in chunk_ids(store, 100)] == [11]
    assert chunk_starts(sizes, 4) == [0, 1, 3, 4]  # 2 | 3+1 | 4 | 1
    assert [len(ids) for ids in chunk_ids(store, 4)] == [2, 4, 4, 1]
    assert chunk_starts(sizes, 1) == [0, 1, 2, 3, 4]  # a shard above the limit: its own


def test_balanced_ranges_cut_at_chunks_nearest_equal_counts() -> None:
    """32 shards of 8 examples in chunks of 32: 2 ranks get 128 examples each, 3 ranks
    get 96, 64, 96 (cuts only every 4 shards, each nearest its third of 256); ranges are
    contiguous and cover all."""
    sizes = [8] * 32
    starts = chunk_starts(sizes, 32)
    assert balanced_ranges(sizes, starts, 2) == [range(0, 16), range(16, 32)]
    assert balanced_ranges(sizes, starts, 3) == [range(0, 12), range(12, 20), range(20, 32)]
    ranges = balanced_ranges([5, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5], 2)
    assert ranges == [range(0, 1), range(1, 6)]  # 5 | 5


def test_one_process_ranks_exchange_nothing() -> None:
    """:class:`Ranks` (one process) owns every layer, shares its own tensors on its device
    and returns its rows and sums unchanged."""
    ranks = Ranks()
    assert all(ranks.owns(i, 5) for i in range(5))
    x = torch.arange(6.0).reshape(3, 2)
    assert ranks.rows(x) is x and ranks.objects(1) == [1]
    shared = ranks.share({"a": (x,)}, ["a"])
    assert shared["a"][0] is x
    assert [Rank(r, 2).owner(i, 5) for r in range(1) for i in range(5)] == [0, 0, 0, 1, 1]
