"""Curvature that survives a crash: a capture killed by SIGKILL (a worker process,
``tests/curvature_crash_worker.py``, forked by the test process's zygote) leaves K-FAC
statistics of its committed steps, so that the store is attributable as it is, and its
latest trainer checkpoint resumable, also when it died between the trainer's checkpoint
and the capture's ``on_save``.

The oracle for the statistics is built from the store itself: captured with
``keep_tokens`` and rows without padding, it holds every token row's layer input ``a``
and output gradient ``g`` (under the summed-loss convention), whose products over the
committed steps are the K-FAC sums.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest
import torch

from tda_plugins import LayerSelection
from tda_plugins.grads import TokenFactors
from tda_plugins.methods import method_by_name
from tda_plugins.precondition import load_curvature
from tda_plugins.precondition.snapshots import KroneckerFactors
from tda_plugins.store import StoreReader
from tests.curvature_crash_worker import STEPS, train
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import capture_store, rel_error
from tests.test_curvature import dense_scores
from tests.zygote import Zygote

#: fp32 products and sums against fp64 products of the same stored fp32 factors.
TOL = 1e-5


def store_oracle(store: StoreReader, steps: int) -> dict[str, KroneckerFactors]:
    """Layer -> sums of ``a a^T`` and ``g g^T`` over the stored token rows of steps
    ``< steps``, in fp64."""
    chunk = store.load_all()
    keep = chunk.steps < steps
    out = {}
    for name, grads in chunk.layers.items():
        assert isinstance(grads, TokenFactors)
        a = grads.a[keep].double().flatten(0, 1)
        g = grads.g[keep].double().flatten(0, 1)
        out[name] = KroneckerFactors(a.T @ a, g.T @ g, torch.tensor(float(a.shape[0])))
    return out


def assert_statistics(got: dict[str, KroneckerFactors], ref: dict[str, KroneckerFactors]) -> None:
    assert got.keys() == ref.keys()
    for name, stats in ref.items():
        assert got[name].tokens.item() == stats.tokens.item(), name
        assert rel_error(got[name].a_sum, stats.a_sum) <= TOL, name
        assert rel_error(got[name].g_sum, stats.g_sum) <= TOL, name


@pytest.mark.slow
@pytest.mark.parametrize(("point", "committed"), [("save", 4), ("step", 5)])
def test_killed_capture_is_attributable_and_resumable(
    tmp_path: Path,
    point: str,
    committed: int,
    caplog: pytest.LogCaptureFixture,
    zygote: Zygote,
) -> None:
    code, output = zygote.run("tests.curvature_crash_worker:train", tmp_path, point, timeout=300)
    assert code == -signal.SIGKILL, output[-3000:]
    store = StoreReader(tmp_path / "store")
    assert store.steps == list(range(committed))
    assert (tmp_path / "out" / "checkpoint-4").is_dir()

    # Attribute the store as the crash left it: statistics of every committed step.
    with caplog.at_level(logging.WARNING):
        curvature = load_curvature(store.root)
    assert f"committed before step {committed}" in caplog.text
    assert_statistics(curvature, store_oracle(store, committed))
    model = tiny_causal_lm("llama", torch.float32)
    queries = capture_store(
        model, [lm_batch(2, 8, seed=3)], tmp_path / "q", LayerSelection("linear"), curvature=False
    )
    scores = method_by_name("kfac").score(store, queries)
    train_grads = {n: g.materialize() for n, g in store.load_all().layers.items()}
    query_grads = {n: g.materialize() for n, g in queries.load_all().layers.items()}
    shapes = {n: (s.g_sum.shape[0], s.a_sum.shape[0]) for n, s in curvature.items()}
    expected = dense_scores(
        "kfac",
        {n: g.double().view(-1, *shapes[n]) for n, g in train_grads.items()},
        {n: g.double().view(-1, *shapes[n]) for n, g in query_grads.items()},
        curvature,
    )
    assert rel_error(scores.values, expected) <= 1e-4

    # Resume from the latest trainer checkpoint: the run completes as if never killed.
    train(tmp_path, point, resume_from=tmp_path / "out" / "checkpoint-4")
    store = StoreReader(tmp_path / "store")
    assert store.steps == list(range(STEPS))
    assert_statistics(load_curvature(store.root), store_oracle(store, STEPS))
