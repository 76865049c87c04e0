"""One step's decision, taken once for the whole global batch: gather every rank's scores,
drop the non-finite ones, apply the rule, and log the outcome.

Every rank gathers the same few numbers per example (its id, loss tokens, loss scale and
its rounding, and per-unit scores: ``4 + U`` floats, ``4 + 2U`` for cosine) in rank
order, the order of the examples in one process's global batch (each rank's micro-batches
in turn), and applies the rule to all of them on the host: every rank computes the same
kept sets from the same numbers, and a run on ``W`` ranks drops exactly what one process
drops on the same global batch (ties are broken by that order). This gather is the step's
one host read of device values.

An example whose score is not finite (a non-finite gradient, from a poisoned input or an
overflow) is dropped whatever the rule says, and named in the log; the rule then applies
to the finite ones. A step with no finite example is skipped: no ``.grad`` is edited, and
the integration drops every ``.grad`` so that the optimizer leaves the weights and its
state as they are.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tda_plugins.data_selection.parallel import Ranks
from tda_plugins.data_selection.rules import DropRule, SetRule
from tda_plugins.data_selection.scoring import UnitScores
from tda_plugins.grads.ops import safe_norms

logger = logging.getLogger(__name__)


@dataclass
class StepSelection:
    """What one optimizer step's selection did, over the whole global batch (the same on
    every rank).

    Attributes:
        step: optimizer step, 0-based (logged as ``step + 1``, the trainer's number).
        example_ids: ``(N,)`` ids of the step's examples, every rank's in rank order.
        scores: ``(N,)`` scores (per-layer mode: summed over layers); non-finite where the
            example's gradient is.
        dropped: ``(N,)`` bool, dropped in at least one layer (non-finite ones included).
        nonfinite: ``(N,)`` bool, dropped because their score is not finite.
        skipped: no example had a finite score; the optimizer step was skipped.
    """

    step: int
    example_ids: Tensor
    scores: Tensor
    dropped: Tensor
    nonfinite: Tensor
    skipped: bool = False

    def untrained(self) -> Tensor:
        """``(N,)`` bool: the examples whose gradient did not reach the optimizer, the
        dropped ones, and every one of a skipped step (per row: of two copies of one
        content hash in the step, one may be dropped and the other trained)."""
        return torch.ones_like(self.dropped) if self.skipped else self.dropped.clone()

    def summary(self) -> dict[str, Any]:
        """The JSON line of :attr:`step`, numbered as the trainers log it (``step + 1``:
        1 is the first optimizer step); valid JSON: non-finite scores are left out of the
        mean, which is ``None`` when no score is finite."""
        finite = self.scores[~self.nonfinite]
        return {
            "step": self.step + 1,
            "kept": int((~self.dropped).sum()),
            "dropped": int(self.dropped.sum()),
            "mean_score": float(finite.double().mean()) if finite.numel() else None,
            "dropped_ids": self.example_ids[self.dropped].tolist(),
            "nonfinite_ids": self.example_ids[self.nonfinite].tolist(),
            "skipped": self.skipped,
        }


@dataclass
class Decision:
    """The global decision and this rank's share of it (host tensors).

    Attributes:
        keep: per unit, the ``(N,)`` kept mask of the global batch (``granularity="global"``:
            one mask for every unit).
        counts: ``(N,)`` fp64 loss tokens of every example.
        scales: ``(N,)`` fp64 every example's ``loss_scale`` (what its loss was divided by).
        roundings: ``(N,)`` fp64 the relative rounding each scale carries.
        sizes: each rank's number of examples.
        offset: where this rank's examples start in the global order.
        size: this rank's number of examples.
        outcome: what is logged.
    """

    keep: list[Tensor]
    counts: Tensor
    scales: Tensor
    roundings: Tensor
    sizes: list[int]
    offset: int
    size: int
    outcome: StepSelection

    def local(self, mask: Tensor) -> Tensor:
        """This rank's part of a global ``(N,)`` mask."""
        return mask[self.offset : self.offset + self.size]


def _kept(rule: DropRule, scores: Tensor, finite: Tensor, count: int | None) -> Tensor:
    """``(N,)`` kept mask: the rule over the finite scores (``count``: how many it drops,
    for a ranked rule); none kept if none is finite."""
    keep = torch.zeros_like(finite)
    rows = finite.nonzero().flatten()
    if rows.numel():
        keep[rows] = rule.keep(scores[rows], count)
    return keep


def _kept_set(rule: SetRule, dots: Tensor, gram: Tensor, finite: Tensor) -> Tensor:
    """``(N,)`` kept mask of a set rule over the finite examples (``gram``: ``(N, N)``);
    none kept if none is finite."""
    keep = torch.zeros_like(finite)
    rows = finite.nonzero().flatten()
    if rows.numel():
        keep[rows] = rule.kept_of(dots[rows], gram.cpu()[rows][:, rows])
    return keep


def decide(
    step: int,
    *,
    ids: Tensor,
    counts: Tensor,
    scales: Tensor,
    roundings: Tensor,
    scores: UnitScores,
    rule: DropRule,
    per_layer: bool,
    ranks: Ranks,
    count: int | None = None,
    gram: Tensor | None = None,
) -> Decision:
    """Gather this rank's ``(B,)`` ids, loss tokens, loss scales and their roundings and its
    per-unit scores with every other rank's, and apply ``rule`` once to the global batch
    (``count``: the number a ranked rule drops, per unit, instead of its own; ``gram``: the
    ``(N, N)`` Gram matrix a set rule reads: the global batch's, in rank order)."""
    if isinstance(rule, SetRule) and gram is None:
        raise ValueError(f"rule {rule.name!r} needs the step's Gram matrix")
    parts = [
        ids.view(torch.float64)[:, None],
        counts.double()[:, None],
        scales.double()[:, None],
        roundings.double()[:, None],
        scores.dots,
    ]
    if scores.squares is not None:
        parts.append(scores.squares)
    local = torch.cat([p.to(scores.dots.device) for p in parts], dim=1)
    rows, sizes = ranks.gather_rows(local)
    rows = rows.cpu()  # the step's one host read
    units = scores.dots.shape[1]
    global_ids = rows[:, 0].contiguous().view(torch.int64)
    global_counts = rows[:, 1].contiguous()
    global_scales = rows[:, 2].contiguous()
    global_roundings = rows[:, 3].contiguous()
    dots = rows[:, 4 : 4 + units]
    finite = torch.isfinite(dots).all(dim=1)
    if scores.squares is not None and scores.target_squares is not None:
        squares = rows[:, 4 + units :]
        finite &= torch.isfinite(squares).all(dim=1)
        target_sq = scores.target_squares.cpu()
        if not per_layer:
            norms = safe_norms(squares.sum(1)) * target_sq.sum().sqrt()
            unit_scores = (dots.sum(1) / norms)[:, None]
        else:
            unit_scores = dots / (safe_norms(squares) * target_sq.sqrt())
    else:
        unit_scores = dots.sum(1, keepdim=True) if not per_layer else dots
    if per_layer:
        keep = [_kept(rule, unit_scores[:, u], finite, count) for u in range(units)]
        summed = unit_scores.sum(1)  # each layer's score as its rule used it, summed
    elif isinstance(rule, SetRule) and gram is not None:
        keep = [_kept_set(rule, dots.sum(1), gram, finite)]
        summed = unit_scores[:, 0]
    else:
        keep = [_kept(rule, unit_scores[:, 0], finite, count)]
        summed = unit_scores[:, 0]
    dropped = torch.stack([~k for k in keep]).any(0) if keep else ~finite
    outcome = StepSelection(
        step, global_ids, summed.float(), dropped, ~finite, skipped=not bool(finite.any())
    )
    if not bool(finite.all()):
        logger.warning(
            "tda-plugins: step %d: examples %s have a non-finite gradient (score); dropped%s",
            step + 1,
            outcome.summary()["nonfinite_ids"],
            ", and the optimizer step is skipped (no finite example)" if outcome.skipped else "",
        )
    return Decision(
        keep,
        global_counts,
        global_scales,
        global_roundings,
        sizes,
        sum(sizes[: ranks.rank]),
        sizes[ranks.rank],
        outcome,
    )


def start_log(path: Path, start_step: int) -> None:
    """Make ``path`` the log of a run whose next optimizer step has index ``start_step``:
    the lines of its steps before (a resumed run's earlier steps) stay; later lines (the
    steps a crashed run got to past its checkpoint, which the resumed run redoes, or a
    previous run's in the same folder) go. Rewritten through a temporary file renamed
    over it, so an interruption leaves the old log or the new one."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= start_step]
    if len(kept) == len(lines):
        return
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept))
    partial.replace(path)


def append_log(path: Path, outcome: StepSelection) -> None:
    """One JSON line per optimizer step (written by rank 0 only: the outcome is global)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(outcome.summary(), allow_nan=False) + "\n")
