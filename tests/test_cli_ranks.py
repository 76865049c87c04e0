"""``tda capture`` and ``tda attribute`` under ``torchrun --nproc-per-node=2`` (gloo, CPU)
against the same commands in one process.

One torchrun launch (``tests/cli_ranks_worker.py``) runs a data-parallel capture and
``attribute`` with graddot, gradcos, kfac and ekfac on 2 ranks, each through
:func:`tda_plugins.cli.main`; the references run in this process, one thread, as the
ranks do. What is guaranteed on the CPU at the same thread count:

* scores of graddot, gradcos and K-FAC: bitwise the one-process scores (each rank reads
  the one-process chunks of its part; K-FAC's inverses are computed by one rank each and
  broadcast);
* EK-FAC: equal up to the order of the fp64 sums of its eigenvalue correction (each rank
  sums its part, the parts are all-reduced);
* the data-parallel store: the same examples in the same order with bitwise the same
  gradients (each rank captures whole one-process batches), the K-FAC statistics equal up
  to the order of their fp64 sums (each rank saves its own, the reader adds them).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tda_plugins.cli import main
from tda_plugins.precondition.statistics import load_curvature
from tda_plugins.store import StoreReader
from tests.cli_ranks_worker import BATCH, CHUNK, METHODS
from tests.launch import torchrun
from tests.models import tiny_causal_lm
from tests.test_cli import random_sequences, write_examples


def run(*argv: object) -> None:
    assert main([str(a) for a in argv]) == 0


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The references on one thread, as each torchrun rank (OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def launched(tmp_path: Path, one_thread: None) -> Path:
    """fp64 tiny Llama; 10 training examples (ids 100-109) in batches of 3 (shards of
    3, 3, 3, 1 examples: with ``--chunk 4`` three chunks, rank 0 scoring the first two
    shards and rank 1 the other two); 3 queries. One-process store, queries and scores
    in ``one-<method>``, then the 2-rank worker."""
    tiny_causal_lm("llama").save_pretrained(tmp_path / "model")
    train = write_examples(tmp_path / "train.jsonl", random_sequences(range(100, 110), 1))
    queries = write_examples(tmp_path / "queries.jsonl", random_sequences(range(900, 903), 2))
    for data, out in ((train, "store"), (queries, "queries")):
        model = ("--model", tmp_path / "model", "--dtype", "float64", "--batch-size", BATCH)
        model = (*model, "--curvature-head")  # K-FAC/EK-FAC on the untied tiny head too
        run("capture", *model, "--data", data, "--out", tmp_path / out)
    for method in METHODS:
        stores = ("--store", tmp_path / "store", "--queries", tmp_path / "queries")
        options = ("--method", method, "--chunk", CHUNK, "--top-k", 3)
        run("attribute", *stores, *options, "--out", tmp_path / f"one-{method}")
    assert "on 2 rank(s)" in torchrun("cli_ranks_worker.py", tmp_path)
    return tmp_path


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_capture_and_attribute_like_one_process(launched: Path) -> None:
    for method in METHODS:
        one = load_file(launched / f"one-{method}" / "scores.safetensors")
        two = load_file(launched / f"ranks-{method}" / "scores.safetensors")
        assert torch.equal(two["train_ids"], one["train_ids"]), method
        assert torch.equal(two["query_ids"], one["query_ids"]), method
        if method == "ekfac":  # fp64 correction sums in another order, fp32 scores
            scale = one["values"].abs().max()
            assert (two["values"] - one["values"]).abs().max() <= 1e-6 * scale
        else:
            assert torch.equal(two["values"], one["values"]), method
            topk = [
                (launched / f"{w}-{method}" / "topk.json").read_text() for w in ("one", "ranks")
            ]
            assert topk[0] == topk[1]

    one, two = StoreReader(launched / "store"), StoreReader(launched / "ranks-store")
    assert sorted(p.name for p in (launched / "ranks-store").glob("rank-*")) == ["rank-0", "rank-1"]
    a, b = one.load_all(), two.load_all()
    assert a.example_ids.tolist() == b.example_ids.tolist() == list(range(100, 110))
    # 4 batches dealt round robin to 2 ranks: a store step covers 2 batches
    assert b.steps.tolist() == [0] * 6 + [1] * 4
    for name, grads in a.layers.items():
        assert torch.equal(b.layers[name].materialize(), grads.materialize()), name
    assert two.texts() == one.texts() and len(one.texts()) == 10
    curvature, summed = load_curvature(launched / "store"), load_curvature(launched / "ranks-store")
    for name, stats in curvature.items():
        other = summed[name]
        assert other.tokens == stats.tokens
        for mine, theirs in ((stats.a_sum, other.a_sum), (stats.g_sum, other.g_sum)):
            assert torch.allclose(theirs, mine, rtol=1e-12, atol=1e-14 * mine.abs().max())
