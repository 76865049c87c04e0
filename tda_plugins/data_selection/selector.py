"""Online data selection: score a step's examples, drop the worst, remove them from ``.grad``.

At each optimizer step (all micro-batches of the accumulation window together) every
example ``i`` gets a score against a target gradient ``T`` (the summed gradient of a
target pool at the current weights), from the gradients the training backward already
produced:

    dot:     s_i = <g_i, T>
    cosine:  s_i = <g_i, T> / (|g_i| |T|)
    adam:    s_i = <g_i, P T>, P = 1 / (sqrt(v_hat) + eps)   (the optimizer's current state)

with ``g_i`` the example's own summed-token-loss gradient; ``global`` granularity sums
over layers, ``per_layer`` lets each layer keep its own best examples. A
:class:`~tda_plugins.data_selection.rules.DropRule` picks the dropped examples, and their
exact contributions are removed from every captured parameter's ``.grad``:

    G_new = (G - sum_{dropped} c_i) * N_all / N_kept    (= sum_{kept} c_i * N_all / N_kept)

(whichever of the two sums has fewer examples is computed, in the gradient's dtype; a
parameter the backward left without ``.grad``, under an engine with
``parameter_grads=False``, gets the second form directly). Per layer, the scores and the
sums read the captured factors, or the ``(B, D)`` per-example gradients built once into a
kept workspace and held until the sums (where the cost model says that is cheaper and one
example's gradient fits in cache: block layers, not a wide LM head).

``c_i`` is example ``i``'s contribution to ``.grad`` (the captured gradient) and ``N`` the
loss's token counts (all examples of the window / kept ones). For a trainer that
normalizes by the window's token count (HF ``num_items_in_batch``), this is exactly the
gradient of a fresh backward over the kept examples alone. Under DDP each rank drops its
own examples (per-rank selection); corrections and counts are all-reduced, so every
rank's ``.grad`` stays identical.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.data_selection.rules import DropRule
from tda_plugins.data_selection.target import Target
from tda_plugins.grads.factors import DenseGrad, PerExampleGrad, values_dtype
from tda_plugins.grads.ops import dots_with, rows_sums, sq_norms
from tda_plugins.grads.projection import ProjectionConfig, Projector
from tda_plugins.grads.routing import Route, choose_route
from tda_plugins.grads.workspace import Workspace

logger = logging.getLogger(__name__)

ScoreMode = Literal["dot", "cosine", "adam"]
Granularity = Literal["global", "per_layer"]
TokenCounter = Callable[[MicroBatchRecord], Tensor]

#: Most bytes of one example's gradient in a layer whose per-example gradients selection
#: builds once (about a core's L2 cache). Past it the batched product's output leaves the
#: cache and the factors are faster: scoring and summing 6 of 8 examples of 128 tokens
#: took 0.70x the factors' time built once for a 256 x 256 layer (0.25 MiB an example),
#: 0.84x for 256 x 688 (0.67 MiB), 0.99x for 576 x 576 (1.27 MiB), 1.15x for 576 x 1536
#: and 1.28x for 1024 x 1024 (benchmarks/history/RESULTS-2026-11-30_to_2026-12-04.md,
#: data selection overhead).
DENSE_EXAMPLE_BYTES = 1 << 20
#: Most bytes of per-example gradients built once per step; the selector's workspace keeps
#: that much between steps (a fresh allocation each step costs its page faults again).
DENSE_STEP_BYTES = 1 << 27


@dataclass
class StepSelection:
    """What one optimizer step's selection did.

    Attributes:
        step: optimizer step.
        example_ids: ``(N,)`` ids of the step's examples (this rank).
        scores: ``(N,)`` global scores (per-layer mode: summed over layers).
        dropped: ``(N,)`` bool, dropped in at least one layer.
        non_finite: ``(N,)`` bool, a NaN/inf score (in some layer): always dropped.
        skipped: the corrected gradient was not finite, so the step was skipped (every
            captured parameter's ``.grad`` set to ``None``: the optimizer leaves it alone).
    """

    step: int
    example_ids: Tensor
    scores: Tensor
    dropped: Tensor
    non_finite: Tensor
    skipped: bool = False

    def summary(self) -> dict[str, Any]:
        finite = self.scores[~self.non_finite]
        return {
            "step": self.step,
            "rank": dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
            "kept": int((~self.dropped).sum()),
            "dropped": int(self.dropped.sum()),
            "mean_score": float(finite.mean()) if finite.numel() else None,
            "dropped_ids": self.example_ids[self.dropped].tolist(),
            "non_finite_ids": self.example_ids[self.non_finite].tolist(),
            "skipped": self.skipped,
        }


def _all_reduce(t: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


@dataclass
class _Plan:
    """How one keep mask is applied to ``.grad``.

    Attributes:
        rebuild: sum the kept rows and rebuild ``.grad`` (else subtract the dropped rows).
        factor: ``N_all / N_kept``, the token renormalization (0-dim fp64).
        rows: per record, the ``(n,)`` rows summed (``None``: no row).
    """

    rebuild: bool
    factor: Tensor
    rows: list[Tensor | None]


class DataSelector(CaptureConsumer):
    """Consumer that selects examples at each optimizer step and edits ``.grad``.

    Args:
        layers: the engine's captured layers (``engine.captured_layers``); every
            trainable parameter of the model must belong to one (checked by the caller).
        rule: which examples to drop.
        token_counts: ``record -> (B,)`` number of tokens each example's loss sums over.
        score: ``"dot"``, ``"cosine"`` or ``"adam"``.
        granularity: ``"global"`` or ``"per_layer"``.
        optimizer: needed for ``score="adam"``.
        log_path: JSONL file receiving one line per step and rank (dropped ids).
        score_projection: score in a factor-projected space (LoGra's ``P_g dW P_a^T``,
            ``k_g x k_a`` per layer) instead of the full one: scores become the
            projected inner products (approximate, cost ~ tokens x (N_i + N_o) x k
            instead of tokens x N_i x N_o per layer); removal stays exact. Not with
            ``score="adam"``. A tied parameter's layers are projected separately, so
            its cosine norm leaves out their cross terms.
        route: how scores and sums read each layer's gradients: ``FACTORIZED`` on the
            captured factors, ``MATERIALIZED`` from ``(B, D)`` gradients built once (every
            layer, no byte limit); ``None`` (default): per layer, the cheaper by the cost
            model (with the summed rows' share of the previous step) among the layers
            whose one example's gradient fits :data:`DENSE_EXAMPLE_BYTES`, the largest
            savings first within :data:`DENSE_STEP_BYTES`. Every route gives the same
            selection and ``.grad`` up to rounding.
    """

    wants_step_records: ClassVar[bool] = True

    def __init__(
        self,
        layers: dict[str, tuple[nn.Module, LayerAdapter]],
        rule: DropRule,
        token_counts: TokenCounter,
        score: ScoreMode = "dot",
        granularity: Granularity = "global",
        optimizer: torch.optim.Optimizer | None = None,
        log_path: str | Path | None = None,
        score_projection: ProjectionConfig | None = None,
        route: Route | None = None,
    ):
        if score not in ("dot", "cosine", "adam"):
            raise ValueError(f"score must be 'dot', 'cosine' or 'adam', got {score!r}")
        if granularity not in ("global", "per_layer"):
            raise ValueError(f"granularity must be 'global' or 'per_layer', got {granularity!r}")
        if score == "adam" and optimizer is None:
            raise ValueError("score='adam' needs the optimizer")
        if score_projection is not None and (score == "adam" or score_projection.kind != "factor"):
            raise ValueError(
                "score_projection needs a factor ProjectionConfig and score 'dot' or 'cosine' "
                "(Adam preconditions each parameter, which a projection mixes)"
            )
        self.projector = Projector(score_projection) if score_projection is not None else None
        self._projected_target: dict[str, Tensor] = {}
        self.layers = layers
        self.rule = rule
        self.token_counts = token_counts
        self.score = score
        self.granularity = granularity
        self.optimizer = optimizer
        self.log_path = Path(log_path) if log_path is not None else None
        self.target: Target | None = None
        self.history: list[StepSelection] = []
        self.route = route
        #: Where the materialized layers' gradients are built each step (kept: at most
        #: :data:`DENSE_STEP_BYTES` under the cost model).
        self.workspace = Workspace()
        #: Share of a step's rows the last surgery summed (before the first step: half).
        self._summed_share = 0.5
        #: Norm of the last corrected gradient over the captured parameters (before any
        #: clipping; 0-dim tensor), ``None`` before the first step or when it had no grad.
        self.grad_norm: Tensor | None = None
        self._check_tied_parameters()

    def _check_tied_parameters(self) -> None:
        """Group layers that share a parameter (tied embeddings): they are scored as one."""
        owners: dict[int, list[str]] = {}
        for name, (module, adapter) in self.layers.items():
            for p in adapter.captured_parameters(module).values():
                owners.setdefault(id(p), []).append(name)
        shared = [names for names in owners.values() if len(names) > 1]
        if shared and self.granularity == "per_layer":
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
        self.units = list({tuple(u): u for u in unit_of.values()}.values())

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

    def set_target(self, target: Target) -> None:
        """The target gradient at the current weights, as
        :func:`~tda_plugins.data_selection.target.target_gradient` returns it: per layer the
        ``(D,)`` summed loss gradient of the target examples in the layer's flattened
        layout, and where smaller its per-token factors (scored by the ghost dot)."""
        missing = set(self.layers) - set(target)
        if missing:
            raise ValueError(f"the target has no gradient for layers {sorted(missing)[:3]}")
        parts = {**target.vectors, **{n: f.g for n, f in target.factors.items()}}
        for name, tensor in parts.items():
            low, high = torch.aminmax(tensor)
            if name in self.layers and not bool(torch.isfinite(torch.stack([low, high])).all()):
                raise ValueError(
                    f"the target gradient holds NaN/inf in layer {name!r} at these weights, so "
                    "every score would be NaN; check the target examples (their loss overflows) "
                    "or lower the learning rate"
                )
        self.target = Target(
            {name: v for name, v in target.vectors.items() if name in self.layers},
            {name: f for name, f in target.factors.items() if name in self.layers},
        )
        self._projected_target = {}

    # -- scoring ---------------------------------------------------------------------

    def _adam_scale(self, name: str, like: Tensor) -> Tensor:
        module, adapter = self.layers[name]
        params = adapter.captured_parameters(module)
        state = [self.optimizer.state.get(p, {}) if self.optimizer else {} for p in params.values()]
        if any("exp_avg_sq" not in s for s in state):
            return torch.ones_like(like)  # before the first step Adam has no moments: dot
        group = self.optimizer.param_groups[0] if self.optimizer else {}
        beta2, eps = group["betas"][1], group["eps"]
        step = max(float(s["step"]) for s in state)
        v = {local: s["exp_avg_sq"] for local, s in zip(params, state, strict=True)}
        v_hat = adapter.flatten(module, v).to(like.dtype) / (1 - beta2**step)
        return 1.0 / (v_hat.sqrt() + eps)

    def _unit_scores(
        self, records: list[MicroBatchRecord], target: Target
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
        """Per unit (a layer, or layers sharing a parameter): ``(N,)`` dots with the
        (preconditioned) target, and for cosine only (else empty) the ``(N,)`` squared
        norms and the target's squared norm.

        Dots come from each layer's factors (``<dW_i, T>`` without a ``(N, D)`` tensor);
        a tied parameter's target is its full gradient in each sharing layer, so a unit's
        dot is the sum of its layers' dots. The target's factors (where it has them) serve
        the unprojected, unpreconditioned dots."""
        vectors: Mapping[str, Tensor] = target  # plain dots: a factor layer needs no vector
        if self.projector is not None or self.score == "adam":
            vectors = {name: self._layer_target(name, records, target) for name in self.layers}
        if self.score == "adam":
            vectors = {name: v * self._adam_scale(name, v) for name, v in vectors.items()}
        factors = target.factors if self.projector is None and self.score != "adam" else {}
        per_record = [
            dots_with({name: self._grads(r, name) for name in self.layers}, vectors, factors)
            for r in records
        ]
        scales = [r.loss_scale for r in records]
        layer_dots = {
            name: torch.cat([d[name] * c for d, c in zip(per_record, scales, strict=True)])
            for name in self.layers
        }
        dots, squares, target_sq = {}, {}, {}
        for unit in self.units:
            key = "+".join(unit)
            dots[key] = torch.stack([layer_dots[name] for name in unit]).sum(0)
            if self.score == "cosine":
                squares[key] = self._unit_sq_norms(unit, records)
                target_sq[key] = self._unit_target(unit, records, target).double().pow(2).sum()
        return dots, squares, target_sq

    def materialized_layers(self, records: list[MicroBatchRecord]) -> set[str]:
        """The layers whose ``(N, D)`` per-example gradients this step's selection builds
        once and scores and sums from (see ``route``); the rest are read as captured.
        No layer under a score projection (it scores projected factors) or before a
        target."""
        if self.projector is not None or self.target is None or self.route is Route.FACTORIZED:
            return set()
        forced = self.route is Route.MATERIALIZED
        candidates: list[tuple[float, int, str]] = []  # (flops saved, bytes, layer)
        for name in self.layers:
            grads = [r.layers[name].grads for r in records]
            factors = self.target.factors.get(name) if self.score != "adam" else None
            costs = [
                g.score_and_sum_costs(factors, self._summed_share * g.batch_size) for g in grads
            ]
            total = {route: sum(c[route] for c in costs) for route in costs[0]}
            itemsize = values_dtype(grads[0]).itemsize
            if not forced and (
                choose_route(total) is not Route.MATERIALIZED
                or grads[0].dim * itemsize > DENSE_EXAMPLE_BYTES
            ):
                continue
            nbytes = sum(g.batch_size for g in grads) * grads[0].dim * itemsize
            candidates.append((total[Route.FACTORIZED] - total[Route.MATERIALIZED], nbytes, name))
        dense, left = set(), DENSE_STEP_BYTES
        for _, nbytes, name in sorted(candidates, key=lambda c: -c[0]):
            if forced or nbytes <= left:
                dense.add(name)
                left -= nbytes
        return dense

    def _built_once(self, records: list[MicroBatchRecord]) -> list[MicroBatchRecord]:
        """Shallow copies of the records (the engine's own untouched) in which the
        :meth:`materialized_layers` hold their gradients as :class:`DenseGrad`, written
        into the selector's kept :class:`Workspace` (valid until the next step)."""
        dense = self.materialized_layers(records)
        if not dense:
            return records
        grads = [r.layers[name].grads for r in records for name in r.layers if name in dense]
        slots: dict[int, Tensor] = {}
        device = records[0].example_ids.device
        for dtype in {values_dtype(g) for g in grads}:
            group = [g for g in grads if values_dtype(g) == dtype]
            views = self.workspace.carve([(g.batch_size, g.dim) for g in group], dtype, device)
            slots.update((id(g), g.materialize_into(v)) for g, v in zip(group, views, strict=True))
        return [
            replace(
                r,
                layers={
                    name: replace(lr, grads=DenseGrad(slots[id(lr.grads)])) if name in dense else lr
                    for name, lr in r.layers.items()
                },
            )
            for r in records
        ]

    def _grads(self, record: MicroBatchRecord, name: str) -> PerExampleGrad:
        """Layer ``name``'s per-example gradients as scored (projected if configured)."""
        grads = record.layers[name].grads
        return grads if self.projector is None else self.projector(name, grads)

    def _layer_target(
        self, name: str, records: list[MicroBatchRecord], target: Mapping[str, Tensor]
    ) -> Tensor:
        """Layer ``name``'s target as scored (projected once per refresh if configured)."""
        if self.projector is None:
            return target[name]
        if name not in self._projected_target:
            template = records[0].layers[name].grads
            self._projected_target[name] = self.projector.project_vector(
                name, template, target[name]
            )
        return self._projected_target[name]

    def _unit_sq_norms(self, unit: list[str], records: list[MicroBatchRecord]) -> Tensor:
        """``(N,)`` squared norms of the unit's per-example gradients (a tied unit's
        layers add up inside each parameter, so those are materialized)."""
        if len(unit) == 1 or self.projector is not None:
            return torch.stack(
                [
                    torch.cat([sq_norms(self._grads(r, name)) * r.loss_scale**2 for r in records])
                    for name in unit
                ]
            ).sum(0)
        grads = {
            name: torch.cat([r.layers[name].grads.materialize() * r.loss_scale for r in records])
            for name in unit
        }
        return self._in_parameters(unit, grads).pow(2).sum(dim=1)

    def _unit_target(
        self, unit: list[str], records: list[MicroBatchRecord], target: Mapping[str, Tensor]
    ) -> Tensor:
        """The unit's target over its distinct parameters (a tied one counted once; under
        a projection, each layer's projected target)."""
        if len(unit) == 1 or self.projector is not None:
            return torch.cat([self._layer_target(name, records, target) for name in unit])
        distinct: dict[int, Tensor] = {}
        for name in unit:
            module, adapter = self.layers[name]
            params = adapter.captured_parameters(module)
            for local, value in adapter.unflatten(module, target[name]).items():
                distinct.setdefault(id(params[local]), value.flatten())
        return torch.cat(list(distinct.values()))

    def _keep(self, scores: Tensor) -> Tensor:
        """The rule's keep mask, with every NaN/inf score dropped whatever the rule says (a
        NaN would otherwise sort as any value at all); empty only if no score is finite."""
        finite = torch.isfinite(scores)
        return self.rule.keep(scores.where(finite, -torch.inf)) & finite

    def _keep_masks(
        self, dots: dict[str, Tensor], squares: dict[str, Tensor], target_sq: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """Keep masks per layer, the ``(N,)`` scores recorded for the step, and the ``(N,)``
        mask of examples with a non-finite score (in any layer)."""
        cosine = self.score == "cosine"
        if self.granularity == "global":
            scores = torch.stack(list(dots.values())).sum(0)
            if cosine:
                norm = torch.stack(list(squares.values())).sum(0).sqrt()
                scores = scores / (norm * torch.stack(list(target_sq.values())).sum().sqrt())
            keep = self._keep(scores)
            return dict.fromkeys(self.layers, keep), scores, ~torch.isfinite(scores)
        masks, bad = {}, []
        for name, dot in dots.items():
            layer_scores = dot / (squares[name].sqrt() * target_sq[name].sqrt()) if cosine else dot
            masks[name] = self._keep(layer_scores)
            bad.append(~torch.isfinite(layer_scores))
        return masks, torch.stack(list(dots.values())).sum(0), torch.stack(bad).any(0)

    # -- surgery -----------------------------------------------------------------------

    def _rows_sums(
        self, records: list[MicroBatchRecord], names: list[str], plan: _Plan
    ) -> dict[str, Tensor]:
        """Per layer of ``names``, the ``(D,)`` sum of the contributions of the plan's rows
        to its ``.grad``, in the accumulation dtype; only those rows enter the products,
        so their cost scales with the rows' share."""
        totals: dict[str, Tensor] = {}
        for r, rows in zip(records, plan.rows, strict=True):
            if rows is None:
                continue
            parts = rows_sums({name: r.layers[name].grads for name in names}, rows)
            for name, part in parts.items():
                totals[name] = totals[name].add_(part) if name in totals else part
        return {
            name: totals[name] if name in totals else torch.zeros(records[0].layers[name].grads.dim)
            for name in names
        }

    def _plan(
        self,
        records: list[MicroBatchRecord],
        keep: Tensor,
        counts: Tensor,
        total: Tensor,
        rebuild: bool | None = None,
        non_finite: Tensor | None = None,
    ) -> _Plan:
        """For one keep mask: rebuild ``.grad`` from the kept rows when they are fewer
        than the dropped ones (over all ranks) or when any rank has an example of
        non-finite score (``non_finite``: its NaN is in autograd's ``.grad``, which no
        subtraction removes), else subtract the dropped ones; a given ``rebuild`` decides
        instead."""
        kept_tokens = _all_reduce((counts * keep.double()).sum().clone())
        if rebuild is None:
            dirty = (
                non_finite.sum() if non_finite is not None else keep.new_zeros((), dtype=torch.long)
            )
            counted = _all_reduce(torch.stack([keep.sum(), (~keep).sum(), dirty]))
            rebuild = bool(counted[0] < counted[1] or counted[2] > 0)
        summed = keep if rebuild else ~keep
        rows: list[Tensor | None] = []
        start = 0
        for r in records:
            picked = summed[start : start + r.batch_size].nonzero().flatten()
            start += r.batch_size
            rows.append(picked if picked.numel() else None)
        return _Plan(rebuild, total / kept_tokens, rows)

    def _without_grad(self, records: list[MicroBatchRecord]) -> set[int]:
        """ids of the parameters of this step's captured layers that the backward left
        without a ``.grad`` (an engine with ``parameter_grads=False``): their ``.grad`` is
        built from the kept rows alone, which costs the kept share of one weight-gradient
        product instead of autograd's whole one plus the correction."""
        present = {name for r in records for name in r.layers}
        return {
            id(p)
            for name in present
            for p in self.layers[name][1].captured_parameters(self.layers[name][0]).values()
            if p.grad is None
        }

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        if not records:
            return
        missing = self._without_grad(records)
        if self.target is None:
            if missing:  # nothing to select against yet: every example, as autograd would
                size, device = sum(r.batch_size for r in records), records[0].example_ids.device
                keep = torch.ones(size, dtype=torch.bool, device=device)
                self._apply(records, dict.fromkeys(self.layers, keep), missing)
            return
        records = self._built_once(records)
        dots, squares, target_sq = self._unit_scores(records, self.target)
        masks, scores, non_finite = self._keep_masks(dots, squares, target_sq)
        skipped = self._apply(records, masks, missing, non_finite)
        dropped = torch.stack([~m for m in masks.values()]).any(0)
        self._record(step, records, scores, dropped, non_finite, skipped)

    def _apply(
        self,
        records: list[MicroBatchRecord],
        masks: dict[str, Tensor],
        missing: set[int],
        non_finite: Tensor | None = None,
    ) -> bool:
        """Make every captured parameter's ``.grad`` the normalized sum of its layers' kept
        rows: corrected in place where autograd wrote it, built where it is ``missing``.

        If the result is not finite (an example's NaN kept by no score, or no example
        left), the step is skipped instead: every captured parameter's ``.grad`` becomes
        ``None``, which optimizers skip (no update, no moment or weight-decay change).
        Sets :attr:`grad_norm`; returns whether the step was skipped."""
        counts = torch.cat([self.token_counts(r) for r in records]).double()
        total = _all_reduce(counts.sum().clone())
        world = _world_size()
        by_mask: dict[int, list[str]] = {}  # id(mask) -> its layers (global: one mask)
        for name, keep in masks.items():
            by_mask.setdefault(id(keep), []).append(name)
        corrections: dict[int, tuple[nn.Parameter, Tensor, _Plan]] = {}
        for names in by_mask.values():
            built = [n for n in names if self._param_ids(n) & missing]
            for group, rebuild in (([n for n in names if n not in built], None), (built, True)):
                if not group:
                    continue
                plan = self._plan(records, masks[group[0]], counts, total, rebuild, non_finite)
                summed_rows = sum(len(rows) for rows in plan.rows if rows is not None)
                self._summed_share = summed_rows / len(counts)
                for name, part in self._rows_sums(records, group, plan).items():
                    if world > 1:
                        part = _all_reduce(part) / world
                    module, adapter = self.layers[name]
                    params = adapter.captured_parameters(module)
                    for local, value in adapter.unflatten(module, part).items():
                        previous = corrections.get(id(params[local]))
                        summed = value if previous is None else previous[1] + value
                        corrections[id(params[local])] = (params[local], summed, plan)
        for param, value, plan in corrections.values():
            factor = plan.factor
            if param.grad is None:
                if id(param) in missing:  # plan.rebuild: G = sum_kept c_i * N_all / N_kept
                    param.grad = value.to(param.dtype).mul_(factor.to(param.dtype))
                continue
            if plan.rebuild:  # G_new = sum_kept c_i * N_all / N_kept
                param.grad.copy_(value.to(param.grad.dtype)).mul_(factor.to(param.grad.dtype))
            else:  # G_new = (G - sum_dropped c_i) * N_all / N_kept
                param.grad.sub_(value.to(param.grad.dtype)).mul_(factor.to(param.grad.dtype))
        corrected = [param for param, _, _ in corrections.values()]
        grads = [p.grad for p in corrected if p.grad is not None]
        self.grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        if self.grad_norm is None or bool(torch.isfinite(self.grad_norm)):
            return False
        for param in corrected:
            param.grad = None
        return True

    def _param_ids(self, name: str) -> set[int]:
        module, adapter = self.layers[name]
        return {id(p) for p in adapter.captured_parameters(module).values()}

    def _record(
        self,
        step: int,
        records: list[MicroBatchRecord],
        scores: Tensor,
        dropped: Tensor,
        non_finite: Tensor,
        skipped: bool,
    ) -> None:
        """The step's outcome into :attr:`history` and the JSONL log."""
        ids = torch.cat([r.example_ids for r in records])
        outcome = StepSelection(
            step,
            ids.cpu(),
            scores.detach().float().cpu(),
            dropped.cpu(),
            non_finite.cpu(),
            skipped,
        )
        self.history.append(outcome)
        if bool(outcome.non_finite.any()) or skipped:
            logger.warning(
                "tda-plugins: step %d: examples %s have NaN/inf gradients and were dropped%s",
                step,
                outcome.example_ids[outcome.non_finite].tolist(),
                "; the corrected gradient was not finite, so the step was skipped"
                if skipped
                else "",
            )
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as f:
                f.write(json.dumps(outcome.summary()) + "\n")
