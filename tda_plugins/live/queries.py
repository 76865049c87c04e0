"""Query gradients prepared once, for scoring many training micro-batches against them.

The live paths (:class:`~tda_plugins.live.influence.InfluenceLogger`, a consumer scoring each
micro-batch as its backward finishes) hold the queries' gradients for the whole run and
score every training micro-batch against all of them at once:

    score(z, q) = <g_q, g_z>

with ``g`` each example's own summed-token-loss gradient (each record's ``loss_scale``
applied). :class:`QueryCollector` builds that side as the query micro-batches are
captured; :func:`query_gradients` does the same from records already captured.

Each layer takes, at its first micro-batch, the form its scores will use. Where the cost
model routes a Gram of captures like this one through materialized gradients (every
linear layer at ordinary sequence lengths, projected or not), the micro-batch's
``(B, D)`` gradients are written straight into one ``(rows, D)`` buffer allocated once:
no per-token factors outlive their micro-batch and no stacked copy is made. Besides the
memory of the factors themselves, this avoids the C heap growth of many mid-sized
long-lived tensors allocated between each micro-batch's transient buffers (glibc cannot
reuse or return the freed space around them; measured in
``benchmarks/history/RESULTS-2026-11-30_to_2026-12-04.md``, "Peer comparison", rerun
(14)). Otherwise (few tokens, wide layers) the layer's factors are kept and stacked once
at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor

from tda_plugins.capture.config import CaptureConfig
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.grads.base import PerExampleGrad, empty_values
from tda_plugins.grads.dense import DenseGrad, stack_examples, sum_of_uses
from tda_plugins.grads.ops import QueryGradients, example_sq_norms, safe_norms
from tda_plugins.grads.projection import projected_tie
from tda_plugins.grads.routing import Route, choose_route

#: What is scored of a record's layers (parameter groups: ``ScoringSpace.apply``).
LayerTransform = Callable[[Mapping[str, PerExampleGrad]], dict[str, PerExampleGrad]]


def _as_captured(layers: Mapping[str, PerExampleGrad]) -> dict[str, PerExampleGrad]:
    return dict(layers)


def summed_uses(
    layers: dict[str, PerExampleGrad], ties: Sequence[Sequence[str]]
) -> dict[str, PerExampleGrad]:
    """``layers`` (one side of a dot product, the queries) with each use of a tied weight
    (``ties``: groups of layers sharing one, an embedding and the head tied to it) given
    the sum of the uses' gradients: the dots with each use's training gradients then add
    up to the shared weight's, ``<q_1 + q_2, t_1 + t_2>``, which a dot per layer alone would
    miss the cross terms of. A use absent from ``layers`` is left out of its sum. Such a
    side serves dot products only: its norms count the shared weight twice."""
    for unit in ties:
        kept = [n for n in unit if n in layers]
        if len(kept) > 1:
            layers.update(dict.fromkeys(kept, sum_of_uses([layers[n] for n in kept])))
    return layers


def refuse_tied_cosine(ties: Sequence[Sequence[str]], fix: str) -> None:
    """Refuse a cosine or per-layer normalization over layers that share a weight
    (``ties``, as :func:`summed_uses` takes them); ``fix`` starts the way out
    (``"score"``: "score with method='graddot' ...")."""
    if ties:
        unit = " and ".join(ties[0])
        raise ValueError(
            f"the captured layers {unit} share one weight, which a cosine or per-layer "
            f"normalization would count as two: {fix} with method='graddot' (which counts "
            "it once), or capture one of the two uses (e.g. layers='linear')"
        )


class _LayerRows(Protocol):
    """One layer's query rows as they arrive."""

    def add(self, grads: PerExampleGrad, start: int) -> None:
        """Take the gradients of rows ``start : start + grads.batch_size``."""

    def result(self) -> PerExampleGrad:
        """All rows, in order."""


class _DenseRows:
    """Materialized into one ``(rows, D)`` buffer as the micro-batches arrive."""

    def __init__(self, first: PerExampleGrad, rows: int):
        self.values = empty_values(first, rows)

    def add(self, grads: PerExampleGrad, start: int) -> None:
        grads.materialize_into(self.values[start : start + grads.batch_size])

    def result(self) -> PerExampleGrad:
        return DenseGrad(self.values)


class _FactorParts:
    """Kept as captured, stacked once at the end."""

    def __init__(self, first: PerExampleGrad, rows: int):
        self.parts: list[PerExampleGrad] = []

    def add(self, grads: PerExampleGrad, start: int) -> None:
        self.parts.append(grads)

    def result(self) -> PerExampleGrad:
        return stack_examples(self.parts)


#: The form of a layer's prepared queries, by the route of its Gram.
_FORMS: dict[Route, type[_DenseRows] | type[_FactorParts]] = {
    Route.MATERIALIZED: _DenseRows,
    Route.FACTORIZED: _FactorParts,
}


class QueryCollector(CaptureConsumer):
    """A capture consumer that prepares the query side as query micro-batches finish.

    Attach it to the engine that captures the queries (or call :meth:`add` with records),
    then take :meth:`gradients` once every query row has arrived. Memory: the prepared
    side plus one micro-batch's record. Attached, it sums the uses of each tied weight the
    engine captures (:func:`summed_uses`), so that its queries score dot products against
    training gradients of the same layers; not cosines (which such a weight refuses).

    Args:
        rows: number of query examples that will arrive (the size of each layer's
            buffer); score columns follow the examples in arrival order.
        transform: what is kept of each micro-batch's layers (parameter groups; default
            all of them, as captured).
    """

    def __init__(self, rows: int, transform: LayerTransform = _as_captured):
        if rows < 1:
            raise ValueError(f"QueryCollector needs at least one query row, got rows={rows}")
        self.rows = rows
        self.transform = transform
        self._filled = 0
        self._captured: set[str] = set()
        self._layers: dict[str, _LayerRows] = {}
        self._ties: tuple[tuple[str, ...], ...] = ()

    def on_attach(self, config: CaptureConfig) -> None:
        projected = projected_tie(config.tied[0], config.projection) if config.tied else ""
        if projected:
            raise ValueError(f"{projected}, or one of the two uses only (e.g. layers='linear')")
        self._ties = config.tied

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        self.add(record)

    def add(self, record: MicroBatchRecord) -> None:
        """Take one captured query micro-batch (its ``loss_scale`` applied)."""
        if self._filled and record.layers.keys() != self._captured:
            raise ValueError(
                "query micro-batches were captured on different layers: "
                f"{sorted(set(record.layers) ^ self._captured)[:3]} are in some only; "
                "capture them with one engine configuration"
            )
        if self._filled + record.batch_size > self.rows:
            raise ValueError(
                f"QueryCollector was made for {self.rows} query rows but received "
                f"{self._filled + record.batch_size}; pass the number of query examples"
            )
        layers = summed_uses(self.transform(record.example_grads()), self._ties)
        for name, grads in layers.items():
            if name not in self._layers:
                form = _FORMS[choose_route(grads.gram_costs(grads))]
                self._layers[name] = form(grads, self.rows)
            self._layers[name].add(grads, self._filled)
        self._captured = set(record.layers)
        self._filled += record.batch_size

    def gradients(self) -> QueryGradients:
        """The prepared query side (once all ``rows`` have arrived)."""
        if self._filled != self.rows:
            raise ValueError(
                f"QueryCollector was made for {self.rows} query rows but received "
                f"{self._filled}; capture every query before scoring"
            )
        return QueryGradients({name: rows.result() for name, rows in self._layers.items()})


def query_gradients(
    queries: MicroBatchRecord | Sequence[MicroBatchRecord],
    transform: LayerTransform = _as_captured,
) -> QueryGradients:
    """Captured query micro-batches, prepared once for scoring many training micro-batches
    (as :class:`QueryCollector`, from records already in memory, ``transform`` applied to
    each). Score columns follow the records' examples in order."""
    records = [queries] if isinstance(queries, MicroBatchRecord) else list(queries)
    if not records:
        raise ValueError("query_gradients needs at least one captured query micro-batch")
    collector = QueryCollector(sum(r.batch_size for r in records), transform)
    for record in records:
        collector.add(record)
    return collector.gradients()


def score_record(
    record: MicroBatchRecord,
    queries: QueryGradients,
    cosine: bool,
    transform: LayerTransform = _as_captured,
) -> Tensor:
    """``(B, M)`` scores of a training micro-batch against query gradients prepared once
    (:class:`QueryCollector`, :func:`query_gradients`) for all the micro-batches scored
    against them, ``transform`` applied to the record's layers as to the queries'."""
    return scores_and_norms(record, queries, cosine, transform)[0]


def scores_and_norms(
    record: MicroBatchRecord,
    queries: QueryGradients,
    cosine: bool,
    transform: LayerTransform = _as_captured,
) -> tuple[Tensor, Tensor | None]:
    """:func:`score_record`'s ``(B, M)`` scores, and for a cosine the ``(B,)`` training
    gradients' squared norms (``None`` for dot products, which need none): where one is
    0 the cosine is undefined, and given as 0."""
    train = transform(record.example_grads())
    scores = queries.scores(train)
    if not cosine:
        return scores, None
    sq = example_sq_norms(train)
    return scores / torch.outer(safe_norms(sq), queries.norms()).to(scores.dtype), sq
