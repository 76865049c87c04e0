"""A store in memory (:func:`~tda_plugins.store.memory.memory_store`) scores exactly as
the same capture on disk, and leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tda_plugins import LayerSelection
from tda_plugins.methods import method_by_name
from tda_plugins.store.memory import SHARED_MEMORY, memory_store
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import capture_store

TRAIN = [lm_batch(lengths=(10, 7, 5), seed=1), lm_batch(lengths=(8, 10, 6), seed=2)]
QUERIES = [lm_batch(batch=2, lengths=(10, 4), seed=3)]


def scores(root: Path) -> dict[str, torch.Tensor]:
    """GradDot and EK-FAC scores of :data:`QUERIES` against :data:`TRAIN` in ``root``."""
    model, layers = tiny_causal_lm("llama", torch.float32), LayerSelection("linear")
    store = capture_store(model, TRAIN, root / "train", layers)
    queries = capture_store(model, QUERIES, root / "q", layers, curvature=False)
    return {m: method_by_name(m).score(store, queries).values for m in ("graddot", "ekfac")}


def test_scores_through_a_memory_store_equal_the_disk_stores_exactly(tmp_path: Path) -> None:
    on_disk = scores(tmp_path)
    with memory_store() as folder:
        assert folder.parent == SHARED_MEMORY
        in_memory = scores(folder)
    assert not folder.exists()
    assert all(torch.equal(in_memory[m], on_disk[m]) for m in on_disk)


def test_no_shared_memory_is_refused_naming_the_way_out(tmp_path: Path) -> None:
    absent = memory_store(under=tmp_path / "absent")
    with pytest.raises(OSError, match="capture into a folder on disk"), absent:
        pass
