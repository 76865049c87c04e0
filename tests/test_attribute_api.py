"""``tda_plugins.attribute`` and what ``Scores`` hands a user: top-k lists by sign, and the
scores as a DataFrame or a ``datasets.Dataset``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tda_plugins
from tda_plugins import LayerSelection
from tda_plugins.methods import Scores, method_by_name
from tda_plugins.store import GradientStore, StoreReader
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import capture_store


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A training store of 6 examples and 2 queries, with texts."""
    root = tmp_path_factory.mktemp("api")
    model = tiny_causal_lm("llama")
    for name, batches in (
        ("train", [lm_batch(3, 8, seed=s) for s in (1, 2)]),
        ("q", [lm_batch(2, 8, seed=9)]),
    ):
        reader = capture_store(model, batches, root / name, LayerSelection("linear"))
        ids = reader.load_all().example_ids.tolist()
        GradientStore(root / name, append=True).write_examples({i: f"{name} {i}" for i in ids})
    return root / "train", root / "q"


def test_attribute_equals_the_method_and_carries_the_texts(stores: tuple[Path, Path]) -> None:
    train, queries = stores
    scores = tda_plugins.attribute(train, queries, "kfac", damping=0.2)
    expected = method_by_name("kfac", damping=0.2).score(StoreReader(train), StoreReader(queries))
    assert torch.equal(scores.values, expected.values)
    assert torch.equal(scores.train_ids, expected.train_ids)
    assert scores.train_texts == {i: f"train {i}" for i in scores.train_ids.tolist()}
    assert scores.query_texts == {i: f"q {i}" for i in scores.query_ids.tolist()}


def test_top_k_lists_hold_only_their_sign() -> None:
    """Helpful lists only positive scores, best first; harmful only negative, worst first;
    a zero is in neither."""
    values = torch.tensor([[3.0, -1.0], [-2.0, -4.0], [0.0, -0.5], [1.0, -3.0]])
    scores = Scores(torch.tensor([10, 11, 12, 13]), torch.tensor([7, 8]), values, "graddot")
    first, second = scores.top_k(3)
    assert [(e["id"], e["score"]) for e in first["helpful"]] == [(10, 3.0), (13, 1.0)]
    assert [(e["id"], e["score"]) for e in first["harmful"]] == [(11, -2.0)]
    assert second["helpful"] == []
    assert [e["id"] for e in second["harmful"]] == [11, 13, 10]


def test_scores_round_trip_through_pandas_and_datasets(stores: tuple[Path, Path]) -> None:
    scores = tda_plugins.attribute(*stores)
    frame = scores.to_pandas()
    assert list(frame.columns) == ["train_id", "query_id", "score", "train_text", "query_text"]
    assert len(frame) == scores.values.numel()
    for row in frame.itertuples():
        i = scores.train_ids.tolist().index(row.train_id)
        j = scores.query_ids.tolist().index(row.query_id)
        assert row.score == pytest.approx(float(scores.values[i, j]))
        assert row.train_text == f"train {row.train_id}" and row.query_text == f"q {row.query_id}"
    dataset = scores.to_dataset()
    assert dataset.column_names == list(frame.columns) and len(dataset) == len(frame)
    assert dataset["score"] == pytest.approx(frame["score"].tolist())
