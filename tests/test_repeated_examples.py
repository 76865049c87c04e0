"""An example a training store holds more than once: a duplicated row (one content hash)
twice in one micro-batch, and again at a later step in a row padded to another length.

Capture never moves the weights here, so every occurrence's gradient is the example's
own: the oracle is a store that holds each example once, unpadded, and the repeated
store must score each example ``count`` times that (its occurrences summed), per token
too, on the right- and the left-padded layouts alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from tda_plugins import CaptureEngine, LayerSelection
from tda_plugins.capture import CaptureConsumer
from tda_plugins.methods import method_by_name
from tda_plugins.store import GradientStore, StoreError, StoreReader
from tda_plugins.store.texts import TextRecorder
from tests.models import tiny_causal_lm
from tests.stores import summed_loss
from tests.trainers import word_tokenizer

A, B, C = [5, 9, 14, 3, 22], [7, 7, 30, 12, 40, 41, 42], [19, 4, 8, 25, 6, 11, 2, 13, 50]
#: Training steps, one micro-batch each: A twice beside B, then A again beside the longer C.
STEPS = [[A, A, B], [A, C]]
COUNTS = {tuple(A): 3, tuple(B): 1, tuple(C): 1}


def padded(rows: list[list[int]], left: bool) -> dict[str, Tensor]:
    """One batch of ``rows``, padded to the longest (id 0, mask 0, label -100); on the
    left, ``position_ids`` count real tokens, so that each row's loss is its unpadded one."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        at = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, at], mask[i, at] = torch.tensor(row), 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if left:  # the last pad would predict the first token: a term the unpadded row lacks
        positions = mask.cumsum(dim=1) - 1
        batch["labels"] = batch["labels"].masked_fill(positions <= 0, -100)
        batch["position_ids"] = positions.clamp_min(0)
    return batch


def capture(model: nn.Module, steps: list[list[list[int]]], path: Path, left: bool) -> StoreReader:
    """A training store with per-token factors and texts; ids are content hashes."""
    consumers: list[CaptureConsumer] = [
        GradientStore(path, keep_tokens=True, model=model),
        TextRecorder(path, 0, word_tokenizer(), tokens=True),
    ]
    with CaptureEngine(model, layers=LayerSelection("linear"), consumers=consumers) as engine:
        for rows in steps:
            summed_loss(model, padded(rows, left)).backward()
            model.zero_grad(set_to_none=True)
            engine.optimizer_step()
        engine.end()
    return StoreReader(path)


@pytest.fixture(scope="module", params=["right", "left"])
def stores(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[StoreReader, StoreReader, StoreReader]:
    """The repeated store, the once-each store and one query, at one set of weights."""
    root = tmp_path_factory.mktemp(request.param)
    model, left = tiny_causal_lm("llama", dtype=torch.float64), request.param == "left"
    repeated = capture(model, STEPS, root / "repeated", left)
    once = capture(model, [[A], [B], [C]], root / "once", left)
    queries = capture(model, [[[30, 12, 7, 9]]], root / "queries", left)
    return repeated, once, queries


def test_a_duplicated_row_is_stored_once_per_occurrence(
    stores: tuple[StoreReader, StoreReader, StoreReader],
) -> None:
    repeated, once, _ = stores
    ids = once.load_all().example_ids.tolist()
    assert repeated.load_all().example_ids.tolist() == [ids[0], ids[0], ids[1], ids[0], ids[2]]


@pytest.mark.parametrize("method", ["graddot", "gradcos"])
def test_an_example_stored_more_than_once_scores_the_sum_of_its_occurrences(
    stores: tuple[StoreReader, StoreReader, StoreReader], method: str
) -> None:
    repeated, once, queries = stores
    got = method_by_name(method).score(repeated, queries)
    single = method_by_name(method).score(once, queries)
    assert got.train_ids.tolist() == single.train_ids.tolist()  # one row each, first seen
    counts = torch.tensor([[c] for c in COUNTS.values()], dtype=single.values.dtype)
    torch.testing.assert_close(got.values, counts * single.values, rtol=1e-6, atol=1e-9)


def test_token_scores_add_the_occurrences_token_by_token(
    stores: tuple[StoreReader, StoreReader, StoreReader],
) -> None:
    """Each example's token row, read at its saved positions, is ``count`` times its
    unpadded row, and sums to its score."""
    repeated, once, queries = stores
    graddot = method_by_name("graddot")
    ids = graddot.score(once, queries).train_ids.tolist()
    got = graddot.token_scores(repeated, queries, ids)
    single = graddot.token_scores(once, queries, ids)
    scores = graddot.score(repeated, queries)
    texts, single_texts = repeated.token_texts(), once.token_texts()
    for row, (example, count) in enumerate(zip(ids, COUNTS.values(), strict=True)):
        values = got[example][:, texts[example].positions]
        expected = count * single[example][:, single_texts[example].positions]
        torch.testing.assert_close(values, expected, rtol=1e-6, atol=1e-9)
        assert got[example].sum().item() == pytest.approx(float(scores.values[row, 0]), rel=1e-6)


def test_token_scores_of_rows_of_several_lengths_need_the_saved_layout(
    stores: tuple[StoreReader, StoreReader, StoreReader], tmp_path: Path
) -> None:
    """Without texts the real tokens of differently padded occurrences cannot be found:
    refused, naming the way out (one length needs no layout)."""
    repeated, _, queries = stores
    bare = tmp_path / "bare"
    model = tiny_causal_lm("llama", dtype=torch.float64)
    store = GradientStore(bare, keep_tokens=True, model=model)
    with CaptureEngine(model, layers=LayerSelection("linear"), consumers=[store]) as engine:
        for rows in STEPS:
            summed_loss(model, padded(rows, left=False)).backward()
            model.zero_grad(set_to_none=True)
            engine.optimizer_step()
        engine.end()
    example = repeated.load_all().example_ids.tolist()[0]
    with pytest.raises(StoreError, match="store_texts=True"):
        method_by_name("graddot").token_scores(StoreReader(bare), queries, [example])


def test_explicit_ids_repeated_in_one_step_are_still_refused(tmp_path: Path) -> None:
    """Only a content hash may repeat within a step: an explicit id given twice is two
    examples under one name."""
    model = tiny_causal_lm("llama")
    store = GradientStore(tmp_path / "s")
    with (
        pytest.raises(StoreError, match="occurs twice in step 0"),
        CaptureEngine(model, layers=LayerSelection("linear"), consumers=[store]) as engine,
    ):
        engine.set_example_ids(torch.tensor([4, 4]))
        summed_loss(model, padded([A, B], left=False)).backward()
