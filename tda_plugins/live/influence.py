"""Live influence during training: each step's examples scored against fixed queries.

:class:`InfluenceLogger` is a capture consumer. Before a step, the integration gives it
the query gradients at the current weights (:meth:`InfluenceLogger.set_queries`); at the
optimizer step it scores every example of the step against them, with the same routed
operations as the offline methods:

    score(z, q) = <g_q, g_z>            (graddot)  or its cosine  (gradcos)

with ``g`` each example's own summed-token-loss gradient (the record's ``loss_scale``
applied), of the parameters that count, each layer unit-normalized where asked (the
parameter groups of :mod:`~tda_plugins.methods.groups`, as offline). Per step it keeps
the per-query mean and max; over the run it keeps each training example's cumulative,
learning-rate-weighted influence (TracIn over the steps it was trained in), whose
extremes are the running top-k helpful and harmful examples.

Only examples the step trained on count. A step's scores are credited when its results
are first read (:attr:`InfluenceLogger.history`, :meth:`~InfluenceLogger.metrics`,
:meth:`~InfluenceLogger.state`, the report) or the next step is scored, so that in
between the integration can leave out what a data selection dropped from ``.grad``
(:meth:`~InfluenceLogger.leave_out`), whichever callback ran first. Under ``gradcos`` an
example whose gradient is zero (no loss token: masked by its labels or an instance
filter) has no cosine and is left out too; under ``graddot`` it scores 0, its influence.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from tda_plugins.capture.config import CaptureConfig
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.ops import QueryGradients
from tda_plugins.live.queries import (
    query_gradients,
    refuse_tied_cosine,
    scores_and_norms,
    summed_uses,
)
from tda_plugins.methods.groups import ParameterGroups, ScoringSpace
from tda_plugins.methods.scores import Scores
from tda_plugins.parallel.gather import OneProcess, RankGather
from tda_plugins.report.html import render_html, write_html
from tda_plugins.store.io import atomic_write_json


@dataclass
class StepInfluence:
    """Influence of one optimizer step's examples on each query.

    Attributes:
        step: optimizer step, 0-based (the trainers log it as ``step + 1``, their
            ``global_step`` once it is done; reports use that number).
        mean: ``(M,)`` mean score over the step's examples.
        max: ``(M,)`` largest score over the step's examples.
        example_ids: ``(N,)`` ids of the step's examples.
        scores: ``(N, M)`` their scores.
    """

    step: int
    mean: Tensor
    max: Tensor
    example_ids: Tensor
    scores: Tensor


@dataclass
class _Scored:
    """A scored step awaiting credit: ``(N,)`` ids, ``(N, M)`` scores, its learning rate,
    and ``(N,)`` ``scoreless``: rows with no score to credit (a cosine against a zero
    gradient), kept until the credit so that rows are numbered as the selection numbers
    them (:meth:`InfluenceLogger.leave_out`)."""

    step: int
    example_ids: Tensor
    scores: Tensor
    learning_rate: float
    scoreless: Tensor

    def without(self, leave: Tensor) -> _Scored:
        """These scores less the ``(N,)`` rows true in ``leave``."""
        keep = ~leave
        return _Scored(
            self.step,
            self.example_ids[keep],
            self.scores[keep],
            self.learning_rate,
            self.scoreless[keep],
        )


def _occurrences(example_ids: Tensor) -> list[tuple[int, int]]:
    """Each row's ``(id, k)``: its id, and how many earlier rows hold that id."""
    seen: Counter[int] = Counter()
    rows = []
    for example in example_ids.tolist():
        rows.append((example, seen[example]))
        seen[example] += 1
    return rows


class InfluenceLogger(CaptureConsumer):
    """Scores each step's training examples against query gradients set before the step.

    In a data-parallel run each rank scores its own examples of the step against the
    same queries (every rank holds them: see ``set_queries``), and ``gather`` brings every
    rank's scores together at each scored step (one float per example and query, and its
    id), so the per-step metrics and the running totals cover the whole global batch and
    are the same on every rank; the token ids behind the report's texts are gathered once,
    at the end.

    Args:
        method: ``"gradcos"`` (default; comparable across steps) or ``"graddot"``.
        gather: how the ranks' scores come together (default: one process, nothing to
            exchange; see :func:`~tda_plugins.parallel.gather.rank_gather`).
        exclude_params: parameter name patterns left out of both sides (``("bias",)``;
            :class:`~tda_plugins.methods.groups.ParameterGroups`), checked against the
            engine's layers when it attaches, before any step.
        normalize_layers: each layer's gradient unit-normalized per example before the dot.
    """

    wants_step_records: ClassVar[bool] = True

    def __init__(
        self,
        method: Literal["graddot", "gradcos"] = "gradcos",
        gather: RankGather | None = None,
        *,
        exclude_params: str | Sequence[str] = (),
        normalize_layers: bool = False,
    ):
        if method not in ("graddot", "gradcos"):
            raise ValueError(f"live influence supports 'graddot' or 'gradcos', got {method!r}")
        self.method = method
        self.gather: RankGather = gather if gather is not None else OneProcess()
        self.groups = ParameterGroups.of(exclude_params, normalize_layers)
        #: The groups resolved against the engine's layers (at :meth:`on_attach`).
        self.space = ScoringSpace(normalize_layers=self.groups.normalize_layers)
        self._resolved = False
        self.ties: tuple[tuple[str, ...], ...] = ()
        self.queries: QueryGradients | None = None
        self.learning_rate = 1.0
        self._history: list[StepInfluence] = []
        self._scored: _Scored | None = None
        self._cumulative: dict[int, Tensor] = {}
        self._tokens: dict[int, list[int]] = {}

    def over(self, gather: RankGather) -> InfluenceLogger:
        """A fresh logger with this one's method and parameter groups that gathers the
        ranks' scores through ``gather`` (a training run's, once its ranks are known)."""
        groups = self.groups
        return InfluenceLogger(
            self.method,
            gather,
            exclude_params=groups.exclude,
            normalize_layers=groups.normalize_layers,
        )

    @property
    def history(self) -> list[StepInfluence]:
        """Every scored step with an example that trained, oldest first (the latest scored
        step is credited first)."""
        self._credit()
        return self._history

    def leave_out(self, step: int, example_ids: Tensor, untrained: Tensor) -> None:
        """Examples of step ``step`` (0-based) that did not train, such as those a data
        selection dropped from ``.grad``: left out of the step's mean and max and of
        their cumulative scores. Nothing happens unless ``step`` is the latest scored step
        and still awaits its credit (call it before reading the step's results).

        Args:
            step: the optimizer step, 0-based.
            example_ids: ``(N,)`` the step's examples in the global order (every rank's
                micro-batches in turn, in rank order), the order this logger scored them in.
            untrained: ``(N,)`` bool, the rows that did not train.

        A scored row is matched by its id and its occurrence of that id in the step, so
        that of two copies of one content hash (duplicated rows), the one that trained
        keeps its credit.
        """
        scored = self._scored
        if scored is None or scored.step != step or not bool(untrained.any()):
            return
        rows = zip(_occurrences(example_ids), untrained.tolist(), strict=True)
        untrained_rows = {row for row, out in rows if out}
        leave = [row in untrained_rows for row in _occurrences(scored.example_ids)]
        self._scored = scored.without(torch.tensor(leave, dtype=torch.bool))

    def _credit(self) -> None:
        """Credit the scored step awaiting it (if any of its examples trained): its history
        entry and its cumulative scores."""
        scored, self._scored = self._scored, None
        if scored is not None:
            scored = scored.without(scored.scoreless)
        if scored is None or not scored.example_ids.numel():
            return
        scores, ids = scored.scores, scored.example_ids
        self._history.append(
            StepInfluence(scored.step, scores.mean(0), scores.amax(0), ids, scores)
        )
        for row, example in zip(scores, ids.tolist(), strict=True):
            previous = self._cumulative.get(example)
            weighted = scored.learning_rate * row
            self._cumulative[example] = weighted if previous is None else previous + weighted

    def on_attach(self, config: CaptureConfig) -> None:
        self.space = self.groups.resolve(config)
        self._resolved = True
        self.ties = config.tied
        if self.method == "gradcos" or self.groups.normalize_layers:
            refuse_tied_cosine(self.ties, "log influence")

    def _query_layers(self, layers: Mapping[str, PerExampleGrad]) -> dict[str, PerExampleGrad]:
        """A query record's layers as scored: the parameter groups applied, and the uses
        of a tied weight given one side, the sum of their gradients (so that the dots
        with each use's training gradients add up to the weight's)."""
        return summed_uses(self.space.apply(layers), self.ties)

    def set_queries(
        self,
        queries: MicroBatchRecord | Sequence[MicroBatchRecord] | None,
        learning_rate: float = 1.0,
    ) -> None:
        """Query gradients at the weights of the coming step: one captured record, or
        several (query micro-batches, stacked in order); ``None``: skip the step.

        In a data-parallel run every rank sets the same queries, computed by itself: its
        own examples' gradients stay on it, so it needs every query's gradient to score
        them, and one forward and backward over the queries costs about what sending
        their gradients would (under FSDP2 that forward is a collective anyway)."""
        if queries is not None and self.groups.exclude and not self._resolved:
            raise ValueError(
                "this InfluenceLogger leaves parameters out (exclude_params), which it "
                "resolves against the capture engine's layers: attach it to the engine "
                "(consumers=[...] or engine.add_consumer) before setting queries"
            )
        self.queries = None if queries is None else query_gradients(queries, self._query_layers)
        self.learning_rate = learning_rate

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        if self.queries is None:  # not a scored step, on every rank alike
            return
        cosine = self.method == "gradcos"
        self._credit()
        if records:
            parts = [scores_and_norms(r, self.queries, cosine, self.space.apply) for r in records]
            local = torch.cat([scores for scores, _ in parts]).float()
            local_ids = torch.cat([r.example_ids for r in records]).to(local.device)
            scoreless = torch.zeros(local.shape[0], 1, device=local.device)
            if cosine:  # no gradient, no cosine: such an example did not train
                sq = torch.cat([n for _, n in parts if n is not None]).to(local.device)
                scoreless[:, 0] = (sq <= 0).float()
        else:  # this rank had no example in the step: an empty share, (0, M)
            norms = self.queries.sq_norms()
            local = torch.zeros(0, norms.shape[0], device=norms.device)
            local_ids = torch.zeros(0, dtype=torch.long, device=norms.device)
            scoreless = torch.zeros(0, 1, device=norms.device)
        # the flag travels as one more score column: one gather for both
        gathered = self.gather.rows(torch.cat([local, scoreless], dim=1)).cpu()
        ids = self.gather.rows(local_ids.long()).cpu()
        scores, flags = gathered[:, :-1], gathered[:, -1] > 0
        _require_finite(step, ids, scores, flags)
        self._scored = _Scored(step, ids, scores, self.learning_rate, flags)
        for r in records:
            if r.input_ids is not None:
                mask = r.token_mask if r.token_mask is not None else torch.ones_like(r.input_ids)
                for example, tokens, keep in zip(
                    r.example_ids.tolist(), r.input_ids.cpu(), mask.cpu().bool(), strict=True
                ):
                    self._tokens[example] = tokens[keep].tolist()

    def on_end(self) -> None:
        """Every rank's token ids, for the report's texts (a collective in a distributed run)."""
        self._credit()
        merged: dict[int, list[int]] = {}
        for tokens in self.gather.objects(self._tokens):
            merged.update(tokens)
        self._tokens = merged

    def state(self) -> dict[str, Tensor]:
        """The history, cumulative scores and token ids as tensors, to save with a
        checkpoint (layout: :mod:`tda_plugins.live.resume`)."""
        history = self.history
        width = history[0].mean.shape[0] if history else 0
        cumulative = sorted(self._cumulative)
        tokens = sorted(self._tokens)
        ids = [h.example_ids.long() for h in history] or [torch.zeros(0, dtype=torch.long)]
        return {
            "steps": torch.tensor([h.step for h in history], dtype=torch.long),
            "rows": torch.tensor([h.example_ids.numel() for h in history], dtype=torch.long),
            "mean": _stacked([h.mean for h in history], width),
            "max": _stacked([h.max for h in history], width),
            "example_ids": torch.cat(ids),
            "scores": torch.cat([h.scores.float() for h in history] or [torch.zeros(0, width)]),
            "cumulative_ids": torch.tensor(cumulative, dtype=torch.long),
            "cumulative": _stacked([self._cumulative[i] for i in cumulative], width),
            "token_ids": torch.tensor(tokens, dtype=torch.long),
            "token_counts": torch.tensor([len(self._tokens[i]) for i in tokens], dtype=torch.long),
            "tokens": torch.tensor([t for i in tokens for t in self._tokens[i]], dtype=torch.long),
        }

    def restore(self, state: dict[str, Tensor]) -> None:
        """Go on from ``state`` (:meth:`state` of the run this one resumes), before the
        first step."""
        rows = state["rows"].tolist()
        self._scored = None
        self._history = [
            StepInfluence(int(step), mean, peak, ids, scores)
            for step, mean, peak, ids, scores in zip(
                state["steps"].tolist(),
                state["mean"],
                state["max"],
                state["example_ids"].split(rows),
                state["scores"].split(rows),
                strict=True,
            )
        ]
        self._cumulative = dict(
            zip(state["cumulative_ids"].tolist(), state["cumulative"], strict=True)
        )
        self._tokens = {
            example: part.tolist()
            for example, part in zip(
                state["token_ids"].tolist(),
                state["tokens"].split(state["token_counts"].tolist()),
                strict=True,
            )
        }

    def cumulative_scores(self, query_ids: Tensor) -> Scores:
        """Every example seen so far, with its cumulative influence, as :class:`Scores`."""
        self._credit()
        ids = sorted(self._cumulative)
        values = torch.stack([self._cumulative[i] for i in ids]) if ids else torch.empty(0, 0)
        return Scores(torch.tensor(ids, dtype=torch.long), query_ids, values, self.method)

    def metrics(self, step: int) -> dict[str, float]:
        """Optimizer step ``step``'s (0-based) per-query mean and max influence, named for
        trainer logs; none where that step was not scored (``every_n_steps``) or none of
        its examples trained, so that a log never carries an earlier step's values."""
        history = self.history
        if not history or history[-1].step != step:
            return {}
        last = history[-1]
        out = {}
        for j in range(last.mean.shape[0]):
            out[f"influence/q{j}_mean"] = float(last.mean[j])
            out[f"influence/q{j}_max"] = float(last.max[j])
        return out

    def report_texts(
        self,
        query_ids: Tensor,
        query_tokens: Sequence[Sequence[int]],
        decode: Callable[[list[int]], str] | None = None,
    ) -> tuple[dict[int, str], dict[int, str]]:
        """The report's texts: every training example seen so far whose tokens are known,
        and every query (``query_tokens[j]``, unpadded, is query ``query_ids[j]``), as
        ``decode`` writes them, or their token ids separated by spaces."""

        def text(tokens: Sequence[int]) -> str:
            ids = [int(t) for t in tokens]
            return decode(ids) if decode is not None else " ".join(map(str, ids))

        self._credit()
        train = {i: text(t) for i in sorted(self._cumulative) if (t := self._tokens.get(i))}
        queries = {int(q): text(t) for q, t in zip(query_ids.tolist(), query_tokens, strict=True)}
        return train, queries

    def write_report(
        self,
        directory: str | Path,
        query_ids: Tensor,
        train_texts: dict[int, str],
        query_texts: dict[int, str],
        top_k: int = 5,
    ) -> dict[str, Path]:
        """``influence.json`` (the per-step history, every example's cumulative score per
        query, and the top-k), ``influence.html`` and ``influence.png``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        scores = self.cumulative_scores(query_ids)
        history: list[dict[str, Any]] = [
            {"step": h.step + 1, "mean": h.mean.tolist(), "max": h.max.tolist()}
            for h in self.history
        ]
        summary = {
            "method": self.method,
            "convention": "cumulative learning-rate-weighted score over the steps each "
            "example was trained in; per-step mean/max over that step's examples; steps "
            "numbered as the trainer logs them (1 = the first optimizer step); query j is "
            "q<j> in the logs",
            "query_ids": query_ids.tolist(),
            "history": history,
            "top_k": scores.top_k(top_k) if scores.values.numel() else [],
            "cumulative": [
                {"id": i, "scores": row}
                for i, row in zip(scores.train_ids.tolist(), scores.values.tolist(), strict=True)
            ],
        }
        atomic_write_json(out / "influence.json", summary)
        paths = {"json": out / "influence.json"}
        if scores.values.numel():
            names = {q: f"q{j}" for j, q in enumerate(query_ids.tolist())}  # as logged
            page = render_html(scores, train_texts, query_texts, k=top_k, query_names=names)
            paths["html"] = write_html(out / "influence.html", page)
        paths["png"] = _plot(out / "influence.png", self.history, query_ids)
        return paths


def _stacked(rows: list[Tensor], width: int) -> Tensor:
    """``(len(rows), width)`` the rows stacked, fp32."""
    return torch.stack([r.float() for r in rows]) if rows else torch.zeros(0, width)


def _plot(path: Path, history: list[StepInfluence], query_ids: Tensor) -> Path:
    """Each query's mean influence per step, as a PNG. Drawn on a ``Figure`` of its own
    (not through ``pyplot``), so that the process's backend and open figures, a
    notebook's inline plots among them, stay as they were."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    steps = [h.step + 1 for h in history]  # as the trainer's logs number them
    for j, qid in enumerate(query_ids.tolist()):
        ax.plot(steps, [float(h.mean[j]) for h in history], label=f"q{j} (id {qid})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean influence of the step's examples")
    ax.set_title("Influence on the queries during training")
    if len(query_ids) <= 10:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _require_finite(step: int, ids: Tensor, scores: Tensor, scoreless: Tensor) -> None:
    """Refuse a step whose ``(N, M)`` scores hold NaN/inf for a scored example (``scoreless``:
    ``(N,)`` bool, the rows left out), naming the step and the examples: on every rank
    alike (the scores are gathered), before anything of the step is logged or saved."""
    bad = ~torch.isfinite(scores).all(dim=1) & ~scoreless
    if bool(bad.any()):
        raise FloatingPointError(
            f"non-finite influence scores (NaN/inf) at step {step + 1}, of the examples "
            f"{ids[bad][:3].tolist()}: their gradients or the queries' hold NaN/inf (an "
            "overflowing step), so the step is not logged; lower the learning rate or enable "
            "gradient clipping/loss scaling"
        )
