"""AdamW-influence: the first-order effect of removing a training example on a query's
loss at the final weights, followed through the recorded AdamW trajectory.

Example ``z`` trained at step ``t`` entered that step's gradient as
``clip_t g_z / loss_scale_z`` (``g_z`` its stored gradient: its own summed token loss).
With each step's Adam denominator and clipping held at their recorded values and every
later gradient held fixed (no second-order terms), AdamW is linear in that entry
(:mod:`tda_plugins.trajectory.adam`), and removing ``z`` changes the query loss by

    score(z, q) = clip_t / loss_scale_z * < intake_t * Q_t , g_z >
    Q_t         = sum_{s >= t} (prod_{t < r <= s} carry_r) (prod_{r > s} decay_r) scale_s * g_q

(``g_q`` the query's gradient at the final weights; ``own_step=True``: the ``s = t`` term
alone). Positive = removing ``z`` raises the query's loss: ``z`` helped. An example
trained at several steps (epochs) is removed from all of them: its rows are summed.

``Q_t`` is built backwards, ``Q_t = decay-adjusted scale_t g_q + carry_{t+1} Q_{t+1}``,
so one reverse pass over the steps scores every example, reading each step's gradients
and second moment once (``docs/design.md`` section 7.9).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.blocks import spans
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.ops import cross_gram, layer_sum
from tda_plugins.methods.base import (
    QUERY_CACHE_BYTES,
    AttributionMethod,
    ScoreRun,
    register_method,
    require_tie_support,
)
from tda_plugins.methods.groups import ScoringSpace
from tda_plugins.methods.scores import Scores
from tda_plugins.parallel.ranks import Ranks, on_device
from tda_plugins.store.layout import StoreError
from tda_plugins.store.reader import StoreReader
from tda_plugins.trajectory.adam import AdamTerms
from tda_plugins.trajectory.reader import TrajectoryReader
from tda_plugins.trajectory.record import StepRecord
from tda_plugins.utils.heap import release_free_heap


@dataclass
class _LayerSweep:
    """One layer's backward pass over the steps for a block of queries.

    Attributes:
        adjoint: ``(M, D)`` running ``lambda_{t+1}``, the derivative of the query loss
            at the final weights with respect to the weights after step ``t`` (the query
            gradients ``g_q`` at the end, shrunk by each later step's decay).
        own_step: keep only each step's own update (no momentum from later steps).
        side: ``(M, D)`` running ``Q_t``.
        carry: the carry of the step after the current one (``None`` at the last step).
    """

    adjoint: Tensor
    own_step: bool
    side: Tensor = field(init=False)
    carry: Tensor | None = None

    def __post_init__(self) -> None:
        self.side = torch.zeros_like(self.adjoint)

    def step(self, terms: AdamTerms) -> Tensor | None:
        """Move to the previous step with its terms; the ``(M, D)`` side its examples are
        scored against (``intake_t Q_t``), or ``None`` where it did not update the layer.
        Leaves ``adjoint`` at ``decay_t lambda_{t+1}``."""
        if self.own_step:
            self.side.zero_()
        elif self.carry is not None:
            self.side.mul_(self.carry.to(self.side.dtype))
        out = None
        if terms.updated:
            self.side.addcmul_(self.adjoint, terms.scale.to(self.side.dtype))
            out = self.side * terms.intake.to(self.side.dtype)
        self.adjoint.mul_(terms.decay.to(self.adjoint.dtype))
        self.carry = terms.carry
        return out


@register_method("adamw_influence")
class AdamWInfluence(AttributionMethod):
    """First-order effect of removing each training example, through the recorded AdamW
    steps (momentum carried to later steps, each step's denominator held fixed).

    Needs a store captured with ``record_trajectory=True`` (unprojected), and queries
    captured at the run's final weights.

    Args:
        damping: unused (no curvature); accepted for the common method signature.
        own_step: score each example by its own step's update alone, no later steps.
    """

    own_step: bool = False

    no_parameter_groups = (
        "its reverse sweep moves each layer's whole query side through the recorded Adam "
        "terms, which are kept per layer, not per parameter group"
    )

    def __init__(self, damping: float = 0.1, own_step: bool | None = None, **groups: Any):
        super().__init__(damping, **groups)
        if own_step is not None:
            self.own_step = own_step

    def scores(self, store: StoreReader, queries: StoreReader, run: ScoreRun) -> Scores:
        """``(N, M)`` scores, one row per training example id (see the module docstring).

        Cost: one reverse pass over the store and its trajectory per block of layers and
        queries whose dense query gradients fit :data:`QUERY_CACHE_BYTES`; per step, the
        cross-Grams of its examples with the dense query sides (GradDot's work against
        materialized queries) plus ``M D`` multiply-adds per layer to move the sides."""
        if run.ranks.size > 1:
            raise ValueError(
                f"{self.name} scores in one process (its pass over the steps runs backwards "
                "through the whole store); run it without torchrun"
            )
        release_free_heap()
        store.require_compatible(queries, run.allow_mismatch)
        require_tie_support(store, supported=False, space=ScoringSpace())
        trajectory = TrajectoryReader(store.root)
        trajectory.require_covers(store)
        if queries.num_examples == 0:
            raise StoreError(f"the query store {queries.root} holds no example")
        records = {step: trajectory.record(step) for step in trajectory.steps}
        rows = _StoreRows(store)
        values = torch.zeros(rows.count, queries.num_examples, dtype=torch.float64)
        blocks = self._blocks(trajectory, queries, store)
        chunk = run.chunk(queries.num_examples)
        bar = tqdm(
            total=rows.count * len(blocks), desc=f"{self.name} scores", disable=not run.progress
        )
        query_ids = torch.empty(0, dtype=torch.long)
        with bar:
            for layers, cols in blocks:
                query = queries.load_all(layers)
                query_ids = query.example_ids
                index = torch.arange(cols.start, cols.stop)
                sweeps = {
                    name: _LayerSweep(
                        query.layers[name].select(index).materialize().to(run.ranks.device),
                        self.own_step,
                    )
                    for name in layers
                }
                del query
                for step in reversed(trajectory.steps):
                    sides = {
                        name: sweeps[name].step(
                            AdamTerms.of(
                                records[step],
                                name,
                                trajectory.second_moment(step, name).to(run.ranks.device),
                                trajectory.entry_parameters(name).to(run.ranks.device),
                            )
                        )
                        for name in layers
                    }
                    scored = self._step_scores(store, step, records[step], sides, chunk, run.ranks)
                    for at, dots, grads in scored:
                        self._absorb(sweeps, grads, dots)
                        values[rows.of(step, at), cols] += dots.cpu()
                    bar.update(len(records[step].example_ids))
        scores = rows.by_example(values, query_ids, self.name)
        scores.require_finite()
        return scores

    def token_scores(
        self, store: StoreReader, queries: StoreReader, train_ids: list[int]
    ) -> dict[int, Tensor]:
        """Not provided: the shared per-token path scores the plain gradients, which would
        be GradDot's token scores under this method's name."""
        raise ValueError(
            f"{self.name} has no token-level scores; use graddot's (its per-token scores "
            "split the plain gradient dot), or score whole examples"
        )

    def _step_scores(
        self,
        store: StoreReader,
        step: int,
        record: StepRecord,
        sides: dict[str, Tensor | None],
        chunk: int,
        ranks: Ranks,
    ) -> Iterator[tuple[slice, Tensor, dict[str, PerExampleGrad]]]:
        """The step's examples in store order, chunk by chunk: their positions within the
        step, ``(B, M)`` scores against the sides and their gradients of the layers the
        step updated (none where it updated no layer: its examples changed nothing)."""
        live = {name: side for name, side in sides.items() if side is not None}
        if not live:
            return
        scale = dict(zip(record.example_ids.tolist(), record.loss_scale.tolist(), strict=True))
        start = 0
        for part in store.at_step(step).iter_chunks(chunk, layers=list(live)):
            ids = part.example_ids.tolist()
            grads = on_device(part.layers, ranks.device)
            dots = layer_sum([cross_gram(grads[n], DenseGrad(side)) for n, side in live.items()])
            factor = torch.tensor([record.clip / scale[i] for i in ids], dtype=torch.float64)
            scores = dots.double() * factor.to(dots.device)[:, None]
            yield slice(start, start + len(ids)), scores, grads
            start += len(ids)

    def _absorb(
        self, sweeps: dict[str, _LayerSweep], grads: dict[str, PerExampleGrad], scores: Tensor
    ) -> None:
        """Fold a chunk of a step's examples, their gradients and ``(B, M)`` scores, into
        the adjoints before the step moves on (no curvature here: nothing to fold)."""

    def _blocks(
        self, trajectory: TrajectoryReader, queries: StoreReader, store: StoreReader
    ) -> list[tuple[list[str], slice]]:
        """Groups of consecutive layers, each with a range of query rows, whose dense
        query gradients and running sides fit :data:`QUERY_CACHE_BYTES` together (a layer
        too wide for every query at once takes the queries in ranges)."""
        itemsize = torch.empty((), dtype=store.values_dtype()).element_size()
        count = queries.num_examples
        blocks: list[tuple[list[str], slice]] = []
        group: list[str] = []
        used = 0
        for name in trajectory.layers:
            per_query = 2 * trajectory.entry_parameters(name).numel() * itemsize
            if per_query * count > QUERY_CACHE_BYTES:
                step = max(1, QUERY_CACHE_BYTES // per_query)
                blocks += [([name], rows) for rows in spans(count, step)]
                continue
            if group and used + per_query * count > QUERY_CACHE_BYTES:
                blocks.append((group, slice(0, count)))
                group, used = [], 0
            group.append(name)
            used += per_query * count
        if group:
            blocks.append((group, slice(0, count)))
        return blocks


@register_method("adamw_own_step")
class AdamWOwnStep(AdamWInfluence):
    """AdamW-influence with each example's own step alone: its update at the step it was
    trained in, without the momentum that carries it into later steps."""

    own_step = True


class _StoreRows:
    """Store rows (one per stored example, in store order) by step, and their sum per
    example id (an example trained at several steps)."""

    def __init__(self, store: StoreReader):
        held = store.step_example_ids()
        self.ids = [i for step in sorted(held) for i in held[step]]
        self.count = len(self.ids)
        self._first: dict[int, int] = {}
        position = 0
        for step in sorted(held):
            self._first[step] = position
            position += len(held[step])

    def of(self, step: int, at: slice) -> slice:
        """Store rows of positions ``at`` within step ``step``."""
        first = self._first[step]
        return slice(first + at.start, first + at.stop)

    def by_example(self, values: Tensor, query_ids: Tensor, method: str) -> Scores:
        """One row per example id (first occurrence order), the sum of its rows."""
        ids = torch.tensor(self.ids, dtype=torch.long)
        summed = Scores(ids, query_ids, values, method).summed_by_id()
        return replace(summed, values=summed.values.float())
