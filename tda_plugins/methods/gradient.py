"""First-order methods: GradDot, GradCos and TracIn (no curvature)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tda_plugins.methods.base import AttributionMethod, ScoreRun, register_method
from tda_plugins.methods.scores import Scores
from tda_plugins.store.layout import TRAINED, StoreError
from tda_plugins.store.reader import StoreReader


@register_method("graddot")
class GradDot(AttributionMethod):
    """``<g_q, g_z>``: the plain dot product of per-example gradients."""


@register_method("gradcos")
class GradCos(AttributionMethod):
    """``<g_q, g_z> / (|g_q| |g_z|)``: cosine over all captured layers together."""

    normalize = True
    scores_tied_weights = False


@dataclass(frozen=True)
class Checkpoint:
    """One TracIn checkpoint: training and query gradients at the same weights."""

    store: StoreReader
    queries: StoreReader
    learning_rate: float


@register_method("tracin")
class TracIn(AttributionMethod):
    """``sum_c lr_c <g_q(c), g_z(c)>`` over checkpoints (TracIn-CP).

    The store and queries passed to :meth:`score` are one checkpoint (weighted by
    ``learning_rate``); ``extra`` adds the others. Training ids are aligned across
    checkpoints; an example missing from a checkpoint contributes nothing there. Each
    checkpoint is scored with the same parameter groups.
    """

    def __init__(
        self,
        damping: float = 0.1,
        learning_rate: float = 1.0,
        extra: tuple[Checkpoint, ...] = (),
        *,
        exclude_params: str | Sequence[str] = (),
        normalize_layers: bool = False,
    ):
        super().__init__(damping, exclude_params=exclude_params, normalize_layers=normalize_layers)
        self.learning_rate = learning_rate
        self.extra = extra

    def scores(self, store: StoreReader, queries: StoreReader, run: ScoreRun) -> Scores:
        checkpoints = (Checkpoint(store, queries, self.learning_rate), *self.extra)
        for checkpoint in checkpoints:
            _refuse_training_run(checkpoint.store)
        groups = self.groups
        per_checkpoint = [
            GradDot(exclude_params=groups.exclude, normalize_layers=groups.normalize_layers).scores(
                c.store,
                c.queries,
                replace(run, label=f"{self.name} scores, checkpoint {i} of {len(checkpoints)}"),
            )
            for i, c in enumerate(checkpoints, 1)
        ]
        first = per_checkpoint[0]
        for other in per_checkpoint[1:]:
            if not torch.equal(other.query_ids, first.query_ids):
                raise StoreError("TracIn checkpoints must hold the same queries in the same order")
        ids = sorted({i for s in per_checkpoint for i in s.train_ids.tolist()})
        row = {i: r for r, i in enumerate(ids)}
        total = torch.zeros(len(ids), first.values.shape[1])
        for c, scores in zip(checkpoints, per_checkpoint, strict=True):
            rows = torch.tensor([row[i] for i in scores.train_ids.tolist()])
            total.index_add_(0, rows, c.learning_rate * scores.values)
        return Scores(torch.tensor(ids), first.query_ids, total, self.name)


def _refuse_training_run(store: StoreReader) -> None:
    """A store a training run wrote holds each step's gradients at that step's weights, and
    its queries are taken at the weights the run ended with: no TracIn checkpoint (training
    and query gradients at the same weights), and TracIn over it would be GradDot."""
    if store.metadata.get(TRAINED):
        raise StoreError(
            f"{store.root} was written by a training run: each step's rows are gradients at "
            "that step's weights, not at the weights its queries were taken at, so it is no "
            "TracIn checkpoint (training and query gradients at the same weights). For TracIn "
            "over the run's steps, log it while training (InfluenceLoggingCallback: the "
            "learning-rate-weighted sum over the steps each example trained in); for TracIn "
            "over checkpoints, capture both sides at each one (tda capture --model "
            "<checkpoint>, then --checkpoint); graddot scores this store as it is"
        )
