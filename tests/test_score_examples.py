"""``score_examples``: GradDot and GradCos of training rows against query rows in one
call, with no store. Oracles: each pair's dot product of the two examples' own
summed-loss gradients by autograd (every captured weight), and ``attribute`` on stores
``capture_examples`` writes from the same rows, which it must equal to rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tda_plugins import LayerSelection, attribute, capture_examples, score_examples
from tests.models import tiny_causal_lm, with_lora
from tests.trainers import prompt_completion_pairs, token_rows, word_tokenizer

TRAIN = [{"input_ids": r, "id": 10 + i} for i, r in enumerate(token_rows(7))]
QUERIES = [{"input_ids": r, "id": 90 + i} for i, r in enumerate(token_rows(3, seed=4))]


def own_gradient(model: nn.Module, ids: list[int], names: list[str]) -> torch.Tensor:
    """The example's summed next-token loss gradient over the captured layers' weights."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").backward()
    modules = dict(model.named_modules())
    return torch.cat([modules[n].weight.grad.flatten() for n in names])


def test_graddot_is_each_pairs_gradient_dot_product() -> None:
    model = tiny_causal_lm("llama", torch.float64)
    scores = score_examples(model, TRAIN, QUERIES, batch_size=3, progress=False)
    names = list(LayerSelection().resolve(model))
    train = torch.stack([own_gradient(model, r["input_ids"], names) for r in TRAIN])
    queries = torch.stack([own_gradient(model, r["input_ids"], names) for r in QUERIES])
    assert scores.train_ids.tolist() == [r["id"] for r in TRAIN]
    assert scores.query_ids.tolist() == [r["id"] for r in QUERIES]
    expected = train @ queries.T
    assert scores.values.dtype == torch.float32  # as attribute's
    assert (scores.values.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_a_score_that_is_not_finite_is_refused_naming_its_pair() -> None:
    """A NaN in the model's forward for one training example (its only token with a NaN
    embedding row) is refused, naming that example, not returned as a NaN score."""
    model = tiny_causal_lm("llama", torch.float64)
    row, token = next(
        (i, t)
        for i, r in enumerate(TRAIN)
        for t in r["input_ids"]
        if all(t not in other["input_ids"] for other in TRAIN[:i] + TRAIN[i + 1 :] + QUERIES)
    )
    with torch.no_grad():
        model.get_input_embeddings().weight[token] = float("nan")
    example = TRAIN[row]["id"]
    with pytest.raises(ValueError, match=rf"training example {example} on query 90 is nan"):
        score_examples(model, TRAIN, QUERIES, batch_size=3, progress=False)


def test_a_tied_weight_under_projection_is_refused_before_any_forward() -> None:
    """Each use of GPT-2's tied weight is projected with maps of its own, so a query's two
    uses cannot be summed into one projected side (the terms between them would be dots
    of unrelated coordinates): refused when the capture attaches, naming the weight."""
    model = tiny_causal_lm("gpt2", torch.float64)
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match=r"tied between transformer\.wte and lm_head is projected"):
        score_examples(
            model, TRAIN, QUERIES, layers="all", projection="factor", k_a=4, k_g=4, progress=False
        )
    assert not forwards


def test_a_tied_weight_counts_once_in_graddot_and_refuses_gradcos() -> None:
    """GPT-2's head shares the input embedding's weight: with every layer captured, each
    pair's score is the dot of the whole gradients, the shared weight's counted once
    (both uses summed), not the two uses' separate dots. A cosine, which would count the
    weight twice in its norms, is refused before any forward."""
    model = tiny_causal_lm("gpt2", torch.float64)
    selection = LayerSelection(kind="all")
    params = list(
        {
            id(p): p
            for module, adapter in selection.resolve(model).values()
            for p in adapter.captured_parameters(module).values()
        }.values()
    )

    def whole_gradient(ids: list[int]) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        loss = nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    train = torch.stack([whole_gradient(r["input_ids"]) for r in TRAIN])
    queries = torch.stack([whole_gradient(r["input_ids"]) for r in QUERIES])
    scores = score_examples(model, TRAIN, QUERIES, layers="all", batch_size=3, progress=False)
    expected = train @ queries.T
    assert (scores.values.double() - expected).abs().max() <= 1e-6 * expected.abs().max()
    with pytest.raises(ValueError, match="share one weight"):
        score_examples(model, TRAIN, QUERIES, layers="all", method="gradcos", progress=False)


@pytest.mark.parametrize("method", ["graddot", "gradcos"])
def test_scores_equal_attribute_on_the_stores_of_the_same_rows(tmp_path: Path, method: str) -> None:
    """A LoRA model, text rows through a tokenizer: the same scores, ids and texts as
    capturing both sides to stores and scoring them."""
    tokenizer = word_tokenizer()
    model = with_lora(tiny_causal_lm("llama", torch.float64))
    pairs = prompt_completion_pairs(9)
    train = [{**p.row(), "id": i} for i, p in enumerate(pairs[:6])]
    queries = [p.row() for p in pairs[6:]]
    got = score_examples(
        model, train, queries, tokenizer=tokenizer, method=method, batch_size=4, progress=False
    )
    store = capture_examples(model, train, tmp_path / "train", tokenizer=tokenizer, progress=False)
    asked = capture_examples(model, queries, tmp_path / "q", tokenizer=tokenizer, progress=False)
    expected = attribute(store, asked, method)
    assert torch.equal(got.train_ids, expected.train_ids)
    assert torch.equal(got.query_ids, expected.query_ids)
    assert (got.values - expected.values).abs().max() <= 1e-6 * expected.values.abs().max()
    assert got.train_texts == expected.train_texts and got.query_texts == expected.query_texts


def test_bad_methods_and_repeated_ids_are_refused_before_any_forward() -> None:
    model = tiny_causal_lm("llama", torch.float64)
    calls: list[int] = []
    model.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=r"not 'ekfac'; for the others capture a store"):
        score_examples(model, TRAIN, QUERIES, method="ekfac", progress=False)
    repeated = rf"rows 1 and {len(TRAIN) + 1} have the same example id 10"
    with pytest.raises(ValueError, match=repeated):
        score_examples(model, TRAIN + TRAIN[:1], QUERIES, progress=False)
    assert calls == []


def test_rows_longer_than_the_models_positions_are_truncated_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 40-token row on a model of 32 positions: scored as its first 32 tokens (equal to
    scoring the truncated row), and the warning is logged once, not once per side."""
    model = tiny_causal_lm("llama", torch.float64)
    positions = model.config.max_position_embeddings
    long = [{"input_ids": [5 + i % 50 for i in range(positions + 8)], "id": 1}]
    cut = [{"input_ids": long[0]["input_ids"][:positions], "id": 1}]
    with caplog.at_level("WARNING"):
        got = score_examples(model, long, QUERIES, max_length=positions + 8, progress=False)
    warned = [r.getMessage() for r in caplog.records if "positions" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("tda-plugins: max length"), warned
    assert f"more than the model's {positions} positions" in warned[0]
    expected = score_examples(model, cut, QUERIES, progress=False)
    assert torch.equal(got.values, expected.values)
