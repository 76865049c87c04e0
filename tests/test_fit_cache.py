"""The store's fit cache (``STORE/fit-cache/``): a second K-FAC/EK-FAC fit on the same
statistics factorizes nothing and scores exactly as the first; anything that changes what
a fit computes (the statistics file, K-FAC's damping, the cache's own bytes) makes it fit
again. Oracle: the scores of a fit on a copy of the store that has no cache."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tda_plugins.methods import method_by_name
from tda_plugins.precondition import fit_cache
from tda_plugins.precondition.fit_cache import CACHE_FOLDER
from tda_plugins.store import StoreReader, memory_store
from tda_plugins.store.layout import CURVATURE_FILE
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import capture_store

FACTORIZATIONS = {"kfac": "cholesky", "ekfac": "eigh"}
METHODS = pytest.mark.parametrize("method", list(FACTORIZATIONS))


@dataclass
class Stores:
    """A captured training store (with K-FAC statistics) and a query store."""

    train: Path
    queries: Path


def uncached_copy(store: Path, to: Path) -> Path:
    """A copy of ``store`` without its fit cache (new files, new inodes)."""
    shutil.copytree(store, to, ignore=shutil.ignore_patterns(CACHE_FOLDER))
    return to


def replace_statistics(store: Path) -> None:
    """Replace the store's statistics file, as a recapture does, by one whose dense
    factors have a random PSD matrix added (new eigenvectors, still PSD)."""
    path = store / "rank-0" / CURVATURE_FILE
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no iteration)
    gen = torch.Generator().manual_seed(0)
    for key, value in tensors.items():
        if value.dim() == 2:
            r = torch.randn(value.shape, generator=gen, dtype=value.dtype)
            tensors[key] = value + r @ r.T * (value.trace() / r.square().sum())
    tmp = path.with_name("replacement.tmp")
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Stores:
    root = tmp_path_factory.mktemp("fit-cache")
    model = tiny_causal_lm("llama")
    train = [lm_batch(lengths=(10, 7, 5), seed=1), lm_batch(lengths=(8, 10, 6), seed=2)]
    capture_store(model, train, root / "train")
    capture_store(model, [lm_batch(batch=2, lengths=(10, 4), seed=3)], root / "q", curvature=False)
    return Stores(root / "train", root / "q")


def scored(method: str, store: Path, queries: Path, **options: float) -> torch.Tensor:
    return method_by_name(method, **options).score(StoreReader(store), StoreReader(queries)).values


def factorizations(method: str) -> Any:
    """A context counting the fit's factorizations (they still run)."""
    name = FACTORIZATIONS[method]
    return mock.patch.object(torch.linalg, name, side_effect=getattr(torch.linalg, name))


@METHODS
def test_a_second_fit_reads_the_first_ones_factorizations(
    tmp_path: Path, stores: Stores, method: str
) -> None:
    store = uncached_copy(stores.train, tmp_path / "store")
    expected = scored(method, uncached_copy(stores.train, tmp_path / "fresh"), stores.queries)
    with factorizations(method) as first:
        assert torch.equal(scored(method, store, stores.queries), expected)
    assert first.call_count > 0
    kind = "eigh" if method == "ekfac" else "damping0.1"
    dtype = str(StoreReader(store).values_dtype()).removeprefix("torch.")
    assert [p.name for p in (store / CACHE_FOLDER).iterdir()] == [
        f"{method}-{kind}-{dtype}-rank0-of1.safetensors"
    ]
    with factorizations(method) as second:
        assert torch.equal(scored(method, store, stores.queries), expected)
    assert second.call_count == 0


@METHODS
@pytest.mark.parametrize("change", ["statistics", "damping", "garbled", "emptied"])
def test_a_fit_whose_inputs_changed_fits_again(
    tmp_path: Path,
    stores: Stores,
    caplog: pytest.LogCaptureFixture,
    method: str,
    change: str,
) -> None:
    """A statistics file replaced (a recapture, an appended capture), another damping for
    K-FAC (EK-FAC's eigendecompositions do not depend on it: it reads them), or a cache
    file that is not one: the fit factorizes again and scores as a fit without a cache;
    an unreadable cache is named in a warning."""
    store = uncached_copy(stores.train, tmp_path / "store")
    scored(method, store, stores.queries)
    (cache,) = (store / CACHE_FOLDER).iterdir()
    options = {"damping": 0.3} if change == "damping" else {}
    if change == "statistics":
        replace_statistics(store)
    if change in ("garbled", "emptied"):
        cache.write_bytes(b"not a safetensors file" if change == "garbled" else b"")
    expected = scored(method, uncached_copy(store, tmp_path / "fresh"), stores.queries, **options)
    with caplog.at_level(logging.WARNING), factorizations(method) as calls:
        got = scored(method, store, stores.queries, **options)
    assert (calls.call_count > 0) is not (change == "damping" and method == "ekfac")
    assert torch.equal(got, expected)
    assert (str(cache) in caplog.text) is (change in ("garbled", "emptied"))


@METHODS
def test_a_store_that_cannot_take_the_cache_is_fitted_without_it(
    tmp_path: Path, stores: Stores, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """A read-only store (the cache's write fails): the fit scores as usual, leaves no
    cache, and fits again next time."""
    store = uncached_copy(stores.train, tmp_path / "store")
    expected = scored(method, uncached_copy(stores.train, tmp_path / "fresh"), stores.queries)

    def refused(*args: Any, **kwargs: Any) -> None:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(fit_cache, "write_renamed", refused)
    assert torch.equal(scored(method, store, stores.queries), expected)
    assert not any((store / CACHE_FOLDER).glob("*"))
    with factorizations(method) as calls:
        scored(method, store, stores.queries)
    assert calls.call_count > 0


def test_a_memory_store_keeps_no_cache(tmp_path: Path) -> None:
    """A memory store does not outlive its process: nothing is cached beside it."""
    model = tiny_causal_lm("llama")
    with memory_store(under=tmp_path) as root:
        capture_store(model, [lm_batch(lengths=(6, 4), seed=1)], root / "train")
        capture_store(model, [lm_batch(lengths=(5,), seed=2)], root / "q", curvature=False)
        scored("ekfac", root / "train", root / "q")
        assert not (root / "train" / CACHE_FOLDER).exists()
