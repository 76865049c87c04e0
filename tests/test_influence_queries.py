"""Query gradients prepared from several captured query micro-batches: one stacked side,
scored as the oracle's per-example gradients, each record's loss scale applied; prepared
during the capture, each layer in the form its Gram route uses."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tda_plugins import LayerSelection, RecordCollector
from tda_plugins.capture import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.live.queries import QueryCollector, query_gradients, score_record
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import flat_oracle_grads, linear_parameter_names, run_captured

LINEAR = LayerSelection("linear")
#: Query lengths whose Gram the cost model routes through the factors (4 tokens) and
#: through materialized gradients (48 tokens) on every linear layer of the tiny GPT-2.
SHORT, LONG = 4, 48


def _records(
    model: torch.nn.Module, batches: list[dict], layers: LayerSelection
) -> list[MicroBatchRecord]:
    """Each batch captured under a trainer's mean loss (its loss scale: its token count)."""
    collector = RecordCollector()
    run_captured(model, batches, [collector], layers, mean_loss=True)
    return collector.records


@pytest.mark.parametrize("length", [SHORT, LONG])
def test_stacked_query_micro_batches_score_as_the_oracle(length: int) -> None:
    """A training micro-batch scored against two query micro-batches of different lengths
    and loss scales, stacked into one prepared side, gives the dots (and cosines) of each
    example's own summed-loss gradients from the loop oracle, queries in record order:
    queries kept as factors (short) and materialized (long) alike."""
    model = tiny_causal_lm("gpt2")  # fp64 throughout (Llama's RMSNorm rounds to fp32)
    train = lm_batch(3, 10, lengths=(10, 7, 4), seed=1)
    queries = [
        lm_batch(2, length - 1, seed=2),
        lm_batch(3, length, lengths=(length, length - 2, length - 1), seed=3),
    ]
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


class _CapturedFactors(CaptureConsumer):
    """Weak references to every captured tensor of the records it sees."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        for layer in record.layers.values():
            layer.grads.map_tensors(lambda t: self.refs.append(weakref.ref(t)) or t)

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.refs)


@pytest.mark.parametrize("length, keeps_factors", [(SHORT, True), (LONG, False)])
def test_collector_prepares_queries_during_capture(length: int, keeps_factors: bool) -> None:
    """Attached to the capturing engine, the collector gives the loop oracle's scores, and
    keeps the captured per-token factors only where the Gram is routed through them: long
    queries are materialized as each micro-batch finishes and none of their factors
    outlives the capture."""
    model = tiny_causal_lm("gpt2")
    queries = [lm_batch(2, length, seed=2), lm_batch(2, length, lengths=(length, 3), seed=3)]
    train = lm_batch(3, 10, lengths=(10, 7, 4), seed=1)
    collector, factors = QueryCollector(rows=4), _CapturedFactors()
    run_captured(model, queries, [collector, factors], LINEAR)
    prepared = collector.gradients()
    assert factors.refs
    assert factors.alive() == (len(factors.refs) if keeps_factors else 0)

    (train_record,) = _records(model, [train], LINEAR)
    names = linear_parameter_names(model)
    expected = flat_oracle_grads(model, [train], names) @ flat_oracle_grads(model, queries, names).T
    torch.testing.assert_close(score_record(train_record, prepared, cosine=False), expected)


def test_collector_refuses_a_wrong_number_of_rows() -> None:
    model = tiny_causal_lm("gpt2")
    (record,) = _records(model, [lm_batch(3, 6)], LINEAR)
    with pytest.raises(ValueError, match="at least one query row"):
        QueryCollector(rows=0)
    too_few = QueryCollector(rows=2)
    with pytest.raises(ValueError, match="made for 2 query rows but received 3"):
        too_few.add(record)
    too_many = QueryCollector(rows=4)
    too_many.add(record)
    with pytest.raises(ValueError, match="made for 4 query rows but received 3; capture every"):
        too_many.gradients()
