"""Live influence during training: each step's examples scored against fixed queries.

:class:`InfluenceLogger` is a capture consumer. Before a step, the integration gives it
the query gradients at the current weights (:meth:`InfluenceLogger.set_queries`); at the
optimizer step it scores every example of the step against them, with the same routed
operations as the offline methods:

    score(z, q) = <g_q, g_z>            (graddot)  or its cosine  (gradcos)

with ``g`` each example's own summed-token-loss gradient (the record's ``loss_scale``
applied). Per step it keeps the per-query mean and max; over the run it keeps each
training example's cumulative, learning-rate-weighted influence (TracIn over the steps
it was trained in), whose extremes are the running top-k helpful and harmful examples.

Under DDP or FSDP each rank scores its own examples, and every step's scores (a few
floats per example) and tokens are gathered, so that every rank holds the whole global
step's: the logged metrics equal a one-process run's on the same global batch and agree
on every rank, and the report (written by rank 0) covers every example. Every rank
computes the query gradients itself: it needs them to score its examples, and one
forward and backward of a few queries costs less than gathering them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.grads.ops import QueryGradients
from tda_plugins.methods.scores import Scores
from tda_plugins.queries import query_gradients, score_record
from tda_plugins.report.html import write_html
from tda_plugins.store.io import atomic_write_json


@dataclass
class StepInfluence:
    """Influence of one optimizer step's examples on each query.

    Attributes:
        step: optimizer step.
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


class InfluenceLogger(CaptureConsumer):
    """Scores each step's training examples against query gradients set before the step.

    Args:
        method: ``"gradcos"`` (default; comparable across steps) or ``"graddot"``.
    """

    wants_step_records: ClassVar[bool] = True

    def __init__(self, method: Literal["graddot", "gradcos"] = "gradcos"):
        if method not in ("graddot", "gradcos"):
            raise ValueError(f"live influence supports 'graddot' or 'gradcos', got {method!r}")
        self.method = method
        self.queries: QueryGradients | None = None
        self.learning_rate = 1.0
        self.history: list[StepInfluence] = []
        self._cumulative: dict[int, Tensor] = {}
        self._tokens: dict[int, list[int]] = {}

    def set_queries(
        self,
        queries: MicroBatchRecord | Sequence[MicroBatchRecord] | None,
        learning_rate: float = 1.0,
    ) -> None:
        """Query gradients at the weights of the coming step: one captured record, or
        several (query micro-batches, stacked in order); ``None``: skip the step."""
        self.queries = None if queries is None else query_gradients(queries)
        self.learning_rate = learning_rate

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        if self.queries is None or not records:
            return
        cosine = self.method == "gradcos"
        scores = torch.cat([score_record(r, self.queries, cosine) for r in records]).float().cpu()
        ids = torch.cat([r.example_ids for r in records]).cpu()
        tokens = {}
        for r in records:
            if r.input_ids is not None:
                mask = r.token_mask if r.token_mask is not None else torch.ones_like(r.input_ids)
                for example, row, keep in zip(
                    r.example_ids.tolist(), r.input_ids.cpu(), mask.cpu().bool(), strict=True
                ):
                    tokens[example] = row[keep].tolist()
        ids, scores, tokens = _whole_step(ids, scores, tokens)
        self.history.append(StepInfluence(step, scores.mean(0), scores.amax(0), ids, scores))
        for row, example in zip(scores, ids.tolist(), strict=True):
            previous = self._cumulative.get(example)
            weighted = self.learning_rate * row
            self._cumulative[example] = weighted if previous is None else previous + weighted
        self._tokens.update(tokens)

    def cumulative_scores(self, query_ids: Tensor) -> Scores:
        """Every example seen so far, with its cumulative influence, as :class:`Scores`."""
        ids = sorted(self._cumulative)
        values = torch.stack([self._cumulative[i] for i in ids]) if ids else torch.empty(0, 0)
        return Scores(torch.tensor(ids, dtype=torch.long), query_ids, values, self.method)

    def metrics(self) -> dict[str, float]:
        """The latest step's per-query mean and max influence, named for trainer logs."""
        if not self.history:
            return {}
        last = self.history[-1]
        out = {}
        for j in range(last.mean.shape[0]):
            out[f"influence/q{j}_mean"] = float(last.mean[j])
            out[f"influence/q{j}_max"] = float(last.max[j])
        return out

    def tokens_of(self, example_id: int) -> list[int] | None:
        """The unpadded token ids of a training example seen in a step, if known."""
        return self._tokens.get(example_id)

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
            {"step": h.step, "mean": h.mean.tolist(), "max": h.max.tolist()} for h in self.history
        ]
        summary = {
            "method": self.method,
            "convention": "cumulative learning-rate-weighted score over the steps each "
            "example was trained in; per-step mean/max over that step's examples",
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
            paths["html"] = write_html(
                out / "influence.html", scores, train_texts, query_texts, top_k
            )
        paths["png"] = _plot(out / "influence.png", self.history, query_ids)
        return paths


def _plot(path: Path, history: list[StepInfluence], query_ids: Tensor) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h.step for h in history]
    for j, qid in enumerate(query_ids.tolist()):
        ax.plot(steps, [float(h.mean[j]) for h in history], label=f"query {qid}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean influence of the step's examples")
    ax.set_title("Influence on the queries during training")
    if len(query_ids) <= 10:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _whole_step(
    ids: Tensor, scores: Tensor, tokens: dict[int, list[int]]
) -> tuple[Tensor, Tensor, dict[int, list[int]]]:
    """This rank's ``(n,)`` ids, ``(n, M)`` scores and tokens -> the whole global step's,
    in rank order (the order one process would see the global batch in); unchanged
    without ``torch.distributed``. A few floats and token ids per example, so an object
    gather (every rank gets the same, so the logged metrics agree on every rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ids, scores, tokens
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (ids.tolist(), scores.tolist(), tokens))
    merged: dict[int, list[int]] = {}
    for _, _, part_tokens in parts:
        merged.update(part_tokens)
    all_ids = torch.tensor([i for part_ids, _, _ in parts for i in part_ids], dtype=torch.long)
    rows = [row for _, part_scores, _ in parts for row in part_scores]
    return all_ids, torch.tensor(rows, dtype=scores.dtype).reshape(-1, scores.shape[1]), merged
