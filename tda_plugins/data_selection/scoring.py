"""Each example's score against the selection target, per unit (a layer, or the layers that
share a parameter), from the gradients the training backward captured.

    dot:     s_i = <g_i, T>
    cosine:  s_i = <g_i, T> / (|g_i| |T|)       (a zero gradient scores 0)
    adam:    s_i = <g_i, P T>, P = 1 / (sqrt(v_hat) + eps)   (the metric of the step Adam
             is about to take: its second moment with this step's gradient folded in)

A rule that weighs the examples together (``step_cosine``) also gets the step's Gram
matrix ``<g_i, g_j>`` (``<g_i, P g_j>`` for ``adam``), over every captured parameter.

``g_i`` is example ``i``'s own summed-token-loss gradient (each record's ``loss_scale``
applied). A tied parameter's target is its full gradient in each sharing layer, so a unit's
dot is the sum of its layers' dots; its cosine norm is taken over the parameter itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.data_selection.parallel import Ranks
from tda_plugins.data_selection.settings import ScoreMode
from tda_plugins.data_selection.target import Target
from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.ops import cross_gram, dots_with, sq_norms
from tda_plugins.grads.projection import ProjectionConfig, Projector
from tda_plugins.parallel.dtensor import gathered

Layers = dict[str, tuple[nn.Module, LayerAdapter]]

#: Most bytes of materialized per-example gradients the ranks gather at once to build a
#: set rule's global Gram matrix (a unit larger than this is gathered alone).
GRAM_GATHER_BYTES = 256 * 2**20


@dataclass
class UnitScores:
    """One rank's examples scored, per unit (``U`` units, in :attr:`Scorer.units` order).

    Attributes:
        dots: ``(B, U)`` fp64 inner products with the (preconditioned) target.
        squares: ``(B, U)`` fp64 squared gradient norms (cosine only, else ``None``).
        target_squares: ``(U,)`` fp64 squared target norms (cosine only, else ``None``).
    """

    dots: Tensor
    squares: Tensor | None = None
    target_squares: Tensor | None = None


def _scale(record: MicroBatchRecord) -> Tensor:
    """The record's ``loss_scale`` as a host fp64 tensor (a number, or one per example)."""
    return torch.as_tensor(record.loss_scale, dtype=torch.float64).detach().cpu()


class Scorer:
    """Scores a step's examples against a target.

    Args:
        layers: the engine's captured layers.
        score: ``"dot"``, ``"cosine"`` or ``"adam"``.
        per_layer: units must not share a parameter (per-layer kept sets).
        optimizer: Adam-family optimizer (``score="adam"``).
        projection: score in this factor-projected space instead (``None``: exact).
    """

    def __init__(
        self,
        layers: Layers,
        *,
        score: ScoreMode,
        per_layer: bool,
        optimizer: torch.optim.Optimizer | None = None,
        projection: ProjectionConfig | None = None,
    ):
        if score == "adam" and optimizer is None:
            raise ValueError("score='adam' needs the optimizer")
        if projection is not None and (score == "adam" or projection.kind != "factor"):
            raise ValueError(
                "score_projection needs a factor ProjectionConfig and score 'dot' or 'cosine' "
                "(Adam preconditions each parameter, which a projection mixes)"
            )
        self.layers = layers
        self.score = score
        self.optimizer = optimizer
        self.projector = Projector(projection) if projection is not None else None
        self._projected_target: dict[str, Tensor] = {}
        self.units = self._units(per_layer)

    def _units(self, per_layer: bool) -> list[list[str]]:
        """Group layers that share a parameter (tied embeddings): they are scored as one."""
        owners: dict[int, list[str]] = {}
        for name, (module, adapter) in self.layers.items():
            for p in adapter.captured_parameters(module).values():
                owners.setdefault(id(p), []).append(name)
        shared = [names for names in owners.values() if len(names) > 1]
        if shared and per_layer:
            raise ValueError(
                f"layers {shared[0]} share a parameter, so per-layer selection would apply two "
                "different kept sets to it; use granularity='global'"
            )
        unit_of = {name: [name] for name in self.layers}
        for names in shared:
            merged = sorted(
                {n for name in names for n in unit_of[name]}, key=list(self.layers).index
            )
            for name in merged:
                unit_of[name] = merged
        return list({tuple(u): u for u in unit_of.values()}.values())

    def new_target(self) -> None:
        """A new target: forget the projected one."""
        self._projected_target = {}

    # -- per layer ---------------------------------------------------------------------

    def grads(self, record: MicroBatchRecord, name: str) -> PerExampleGrad:
        """Layer ``name``'s per-example gradients as scored (projected if configured)."""
        grads = record.layers[name].grads
        return grads if self.projector is None else self.projector(name, grads)

    def _layer_target(self, name: str, records: list[MicroBatchRecord], vector: Tensor) -> Tensor:
        """Layer ``name``'s target as scored (projected once per refresh if configured)."""
        if self.projector is None:
            return vector
        if name not in self._projected_target:
            template = records[0].layers[name].grads
            self._projected_target[name] = self.projector.project_vector(name, template, vector)
        return self._projected_target[name]

    def _adam_scale(self, name: str, dtype: torch.dtype, fold: bool) -> Tensor:
        """Layer ``name``'s ``(D,)`` ``P = 1 / (sqrt(v_hat) + eps)`` in ``dtype``, flattened
        like its gradients (a scalar 1 where there is no metric yet):
        the metric of the step Adam is about to take. Its second moment has this step's
        ``.grad`` folded in, ``v = beta2 v_prev + (1 - beta2) grad^2`` bias-corrected for
        step ``t + 1``, as the optimizer computes it before updating (from the whole
        batch's gradient before the trainer's clipping, which waits for the edit: the kept
        set is what the scores choose). At the first step that
        is ``1 / (|grad| + eps)``, Adam's sign-like first update. Without a ``.grad`` on
        every captured layer (``fold`` false, :meth:`_every_grad_written`, decided once a
        step: under ``parameter_grads=False`` an embedding, whose input needs no gradient,
        still gets autograd's): the state alone for every layer, the identity before any
        step, so that one step's layers share one metric."""
        module, adapter = self.layers[name]
        params = adapter.captured_parameters(module)
        optimizer = self.optimizer
        assert optimizer is not None  # checked in __init__
        beta2, eps = optimizer.param_groups[0]["betas"][1], optimizer.param_groups[0]["eps"]
        state = [optimizer.state.get(p, {}) for p in params.values()]
        if not fold and any("exp_avg_sq" not in s for s in state):
            return torch.ones((), dtype=dtype)
        steps = [float(gathered(torch.as_tensor(s["step"]))) for s in state if "step" in s]
        step = max(steps, default=0.0) + fold
        v: dict[str, Tensor] = {}
        for (local, p), s in zip(params.items(), state, strict=True):
            prior = (
                gathered(s["exp_avg_sq"]).double()
                if "exp_avg_sq" in s
                else torch.zeros((), dtype=torch.float64)
            )
            grad = gathered(p.grad).detach().double() if fold and p.grad is not None else None
            v[local] = prior if grad is None else beta2 * prior + (1 - beta2) * grad.square()
        v_hat = adapter.flatten(module, v).to(dtype) / (1 - beta2**step)
        return 1.0 / (v_hat.sqrt() + eps)

    def _every_grad_written(self) -> bool:
        """Whether every captured layer's parameters hold this step's ``.grad``."""
        return all(
            p.grad is not None
            for module, adapter in self.layers.values()
            for p in adapter.captured_parameters(module).values()
        )

    def _in_parameters(self, unit: list[str], per_layer: dict[str, Tensor]) -> Tensor:
        """``(..., D)`` per layer -> the unit's parameters, tied parts added: ``(..., D_u)``."""
        if len(unit) == 1:
            return per_layer[unit[0]]
        lead = per_layer[unit[0]].shape[:-1]
        by_param: dict[int, Tensor] = {}
        for name in unit:
            module, adapter = self.layers[name]
            params = adapter.captured_parameters(module)
            for local, value in adapter.unflatten(module, per_layer[name]).items():
                key = id(params[local])
                by_param[key] = value if key not in by_param else by_param[key] + value
        return torch.cat([v.reshape(*lead, -1) for v in by_param.values()], dim=-1)

    def _unit_sq_norms(self, unit: list[str], records: list[MicroBatchRecord]) -> Tensor:
        """``(N,)`` squared norms of the unit's per-example gradients (a tied unit's
        layers add up inside each parameter, so those are materialized)."""
        if len(unit) == 1 or self.projector is not None:
            return torch.stack(
                [
                    torch.cat([sq_norms(self.grads(r, name)) * r.loss_scale**2 for r in records])
                    for name in unit
                ]
            ).sum(0)
        grads = {
            name: torch.cat([r.layers[name].grads.materialize() * r.loss_scale for r in records])
            for name in unit
        }
        return self._in_parameters(unit, grads).pow(2).sum(dim=1)

    def _unit_target_sq(
        self, unit: list[str], records: list[MicroBatchRecord], vectors: Mapping[str, Tensor]
    ) -> Tensor:
        """The unit's squared target norm over its distinct parameters (a tied one counted
        once; under a projection, each layer's projected target)."""
        if len(unit) == 1 or self.projector is not None:
            parts = [self._layer_target(name, records, vectors[name]) for name in unit]
            return torch.cat(parts).double().pow(2).sum()
        distinct: dict[int, Tensor] = {}
        for name in unit:
            module, adapter = self.layers[name]
            params = adapter.captured_parameters(module)
            for local, value in adapter.unflatten(module, vectors[name]).items():
                distinct.setdefault(id(params[local]), value.flatten())
        return torch.cat(list(distinct.values())).double().pow(2).sum()

    # -- the step ----------------------------------------------------------------------

    def gram(self, records: list[MicroBatchRecord], ranks: Ranks | None = None) -> Tensor:
        """``(N, N)`` fp64 inner products of the step's examples' gradients over every
        captured parameter, in the metric of the score (``P`` for ``adam``; under a
        projection, of the projected gradients), on the host.

        One process (``ranks`` ``None`` or of world 1): this process's examples, each layer
        and pair of micro-batches by the cheaper of the ghost product and the materialized
        one (:func:`~tda_plugins.grads.ops.cross_gram`); a tied unit is materialized (not
        under ``adam``: refused where the rule is chosen). Data-parallel ranks: the whole
        global batch's, rows and columns in rank order, the same on every rank
        (:meth:`_global_gram`)."""
        fold = self.score == "adam" and self._every_grad_written()
        if ranks is not None and ranks.world > 1:
            return self._global_gram(records, ranks, fold)
        sizes = [r.batch_size for r in records]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        out = torch.zeros(sum(sizes), sum(sizes), dtype=torch.float64)
        for unit in self.units:
            if len(unit) > 1 and self.projector is None:
                grads = self._unit_rows(unit, records).double().cpu()
                out += grads @ grads.T
                continue
            for name in unit:
                metric = (
                    self._adam_scale(name, torch.float64, fold) if self.score == "adam" else None
                )
                for i, first in enumerate(records):
                    left = _in_metric(self.grads(first, name), metric)
                    for j, second in enumerate(records):
                        block = cross_gram(left, self.grads(second, name)).double().cpu()
                        block *= _scale(first).view(-1, 1) * _scale(second).view(1, -1)
                        out[starts[i] : starts[i] + sizes[i], starts[j] : starts[j] + sizes[j]] += (
                            block
                        )
        return out

    def _global_gram(self, records: list[MicroBatchRecord], ranks: Ranks, fold: bool) -> Tensor:
        """The global batch's Gram matrix on every data-parallel rank. No rank holds another
        rank's gradients, so the units' materialized per-example gradients are gathered
        from every rank, a group of units at a time (at most :data:`GRAM_GATHER_BYTES`
        gathered at once, a larger unit alone); each rank multiplies its own examples'
        (in the metric) with everyone's, ``(B_r, N)``, and those rows are gathered last.
        Collectives per step: one for the counts, one per group, one for the rows."""
        local = sum(r.batch_size for r in records)
        device = records[0].example_ids.device
        sizes = ranks.sizes(local, device)
        rows = torch.zeros(local, sum(sizes), dtype=torch.float64, device=device)
        for group in self._row_groups(records, sum(sizes)):
            mine = torch.cat([unit_rows for _, unit_rows in group], dim=1)
            everyone, _ = ranks.gather_rows(mine, sizes)
            left = mine
            if self.score == "adam":
                metric = torch.cat([self._unit_metric(unit, mine.dtype, fold) for unit, _ in group])
                left = mine * metric.to(mine.device)
            rows += (left @ everyone.T).double()
        gram, _ = ranks.gather_rows(rows, sizes)
        return gram.cpu()

    def _row_groups(
        self, records: list[MicroBatchRecord], examples: int
    ) -> Iterator[list[tuple[list[str], Tensor]]]:
        """Each unit with its :meth:`_unit_rows`, in consecutive groups whose rows for
        ``examples`` examples take at most :data:`GRAM_GATHER_BYTES` (a larger unit alone).
        Every rank cuts the same groups: the widths and ``examples`` are the same on all."""
        group: list[tuple[list[str], Tensor]] = []
        used = 0
        for unit in self.units:
            unit_rows = self._unit_rows(unit, records)
            size = examples * unit_rows.shape[1] * unit_rows.element_size()
            if group and used + size > GRAM_GATHER_BYTES:
                yield group
                group, used = [], 0
            group.append((unit, unit_rows))
            used += size
        if group:
            yield group

    def _unit_rows(self, unit: list[str], records: list[MicroBatchRecord]) -> Tensor:
        """``(B, D_u)`` the unit's per-example gradients as scored, materialized, each
        record's ``loss_scale`` applied (a tied unit's layers added in its parameters)."""
        per_layer = {
            name: torch.cat([_scaled_rows(self.grads(r, name), r) for r in records])
            for name in unit
        }
        if len(unit) > 1 and self.projector is None:
            return self._in_parameters(unit, per_layer)
        return torch.cat([per_layer[name] for name in unit], dim=1)

    def _unit_metric(self, unit: list[str], dtype: torch.dtype, fold: bool) -> Tensor:
        """``(D_u,)`` the Adam metric ``P`` of a one-layer unit, flattened like its rows."""
        (name,) = unit  # adam on tied units is refused where the rule is chosen
        module, adapter = self.layers[name]
        width = sum(p.numel() for p in adapter.captured_parameters(module).values())
        return self._adam_scale(name, dtype, fold).expand(width)

    def scores(
        self, records: list[MicroBatchRecord], target: Target, *, per_unit: bool
    ) -> UnitScores:
        """This rank's examples scored per unit.

        ``per_unit``: score the units one at a time, each unit's target vectors read once
        and dropped before the next (a sharded target is gathered a unit at a time);
        otherwise all layers at once (layers fed by one input share one product)."""
        chunks = self.units if per_unit else [list(self.layers)]
        fold = self.score == "adam" and self._every_grad_written()
        dots, squares, target_sq = [], [], []
        for chunk in chunks:
            part = self._chunk_scores(records, target, chunk, fold)
            dots.append(part.dots)
            if part.squares is not None and part.target_squares is not None:
                squares.append(part.squares)
                target_sq.append(part.target_squares)
        cosine = self.score == "cosine"
        return UnitScores(
            torch.cat(dots, dim=1),
            torch.cat(squares, dim=1) if cosine else None,
            torch.cat(target_sq) if cosine else None,
        )

    def _chunk_scores(
        self, records: list[MicroBatchRecord], target: Target, names: list[str], fold: bool
    ) -> UnitScores:
        """:meth:`scores` of the units made of ``names`` (whole units, in order)."""
        needs_vectors = self.projector is not None or self.score != "dot"
        factors = target.factors if self.projector is None and self.score != "adam" else {}
        vectors: Mapping[str, Tensor] = target
        if needs_vectors or len(names) < len(self.layers):
            vectors = {name: target[name] for name in names}  # read (gathered) once here
        scored = vectors
        if self.projector is not None or self.score == "adam":
            scored = {name: self._layer_target(name, records, vectors[name]) for name in names}
        if self.score == "adam":
            scored = {name: v * self._adam_scale(name, v.dtype, fold) for name, v in scored.items()}
        per_record = [
            dots_with({name: self.grads(r, name) for name in names}, scored, factors)
            for r in records
        ]
        scales = [r.loss_scale for r in records]
        layer_dots = {
            name: torch.cat([d[name] * c for d, c in zip(per_record, scales, strict=True)])
            for name in names
        }
        units = [u for u in self.units if u[0] in layer_dots]
        dots = torch.stack(
            [torch.stack([layer_dots[n] for n in unit]).sum(0).double() for unit in units], dim=1
        )
        if self.score != "cosine":
            return UnitScores(dots)
        squares = torch.stack([self._unit_sq_norms(u, records).double() for u in units], dim=1)
        target_sq = torch.stack([self._unit_target_sq(u, records, vectors) for u in units])
        return UnitScores(dots, squares, target_sq)


def _scaled_rows(grads: PerExampleGrad, record: MicroBatchRecord) -> Tensor:
    """``(B, D)`` ``grads`` materialized, times ``record``'s ``loss_scale``."""
    values = grads.materialize()
    return values * _scale(record).to(values).view(-1, 1)


def _in_metric(grads: PerExampleGrad, metric: Tensor | None) -> PerExampleGrad:
    """``grads`` in the score's metric: ``P g`` for ``adam`` (``metric`` = ``P``), else as is."""
    if metric is None:
        return grads
    values = grads.materialize()
    return DenseGrad(values * metric.to(values.dtype))
