"""Query gradients prepared from several captured query micro-batches: one stacked side,
scored as the oracle's per-example gradients, each record's loss scale applied."""

from __future__ import annotations

import pytest
import torch

from tda_plugins import LayerSelection, RecordCollector
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.influence import query_gradients, score_record
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import flat_oracle_grads, linear_parameter_names, run_captured

LINEAR = LayerSelection("linear")


def _records(
    model: torch.nn.Module, batches: list[dict], layers: LayerSelection
) -> list[MicroBatchRecord]:
    """Each batch captured under a trainer's mean loss (its loss scale: its token count)."""
    collector = RecordCollector()
    run_captured(model, batches, [collector], layers, mean_loss=True)
    return collector.records


def test_stacked_query_micro_batches_score_as_the_oracle() -> None:
    """A training micro-batch scored against two query micro-batches of different lengths
    and loss scales, stacked into one prepared side, gives the dots (and cosines) of each
    example's own summed-loss gradients from the loop oracle, queries in record order."""
    model = tiny_causal_lm("gpt2")  # fp64 throughout (Llama's RMSNorm rounds to fp32)
    train = lm_batch(3, 10, lengths=(10, 7, 4), seed=1)
    queries = [lm_batch(2, 6, seed=2), lm_batch(3, 9, lengths=(9, 5, 8), seed=3)]
    query_records = _records(model, queries, LINEAR)
    assert len({float(r.loss_scale) for r in query_records}) == 2
    (train_record,) = _records(model, [train], LINEAR)
    prepared = query_gradients(query_records)

    names = linear_parameter_names(model)
    ref_train = flat_oracle_grads(model, [train], names)
    ref_queries = flat_oracle_grads(model, queries, names)
    torch.testing.assert_close(
        score_record(train_record, prepared, cosine=False), ref_train @ ref_queries.T
    )
    cosine = (
        torch.nn.functional.normalize(ref_train, dim=1)
        @ torch.nn.functional.normalize(ref_queries, dim=1).T
    )
    torch.testing.assert_close(score_record(train_record, prepared, cosine=True), cosine)


def test_query_micro_batches_of_other_layers_are_refused() -> None:
    model = tiny_causal_lm("gpt2")
    batch = lm_batch(2, 6)
    mlp = LayerSelection("linear", include=r"\.mlp\.")
    records = _records(model, [batch], LINEAR) + _records(model, [batch], mlp)
    with pytest.raises(ValueError, match="different layers"):
        query_gradients(records)
    with pytest.raises(ValueError, match="at least one"):
        query_gradients([])
