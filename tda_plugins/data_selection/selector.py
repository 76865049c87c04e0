"""Online data selection: score a step's examples, drop the worst, remove them from ``.grad``.

At each optimizer step (all micro-batches of the accumulation window together, over every
data-parallel rank) every example ``i`` gets a score against a target gradient ``T`` (the
summed gradient of a target pool at the current weights), from the gradients the training
backward already produced (:mod:`~tda_plugins.data_selection.scoring`); ``global``
granularity sums over layers, ``per_layer`` lets each layer keep its own best examples.
The rule is applied once to the whole global batch
(:mod:`~tda_plugins.data_selection.outcome`), and the dropped examples' exact
contributions are removed from every captured parameter's ``.grad``
(:mod:`~tda_plugins.data_selection.surgery`):

    G_new = (G - sum_{dropped} c_i) * N_all / N_kept    (= sum_{kept} c_i * N_all / N_kept)

``c_i`` is example ``i``'s contribution to ``.grad`` (the captured gradient) and ``N`` the
loss's token counts (all examples of the global batch / kept ones). For a trainer that
normalizes by the global batch's token count (HF ``num_items_in_batch`` with
``average_tokens_across_devices``, OLMo-core ``loss_div_factor`` with equal token counts
per rank), this is exactly the gradient of a fresh backward over the kept examples alone.

Per layer, the scores and the sums read the captured factors, or the ``(B, D)``
per-example gradients built once into a kept workspace and held until the sums (where the
cost model says that is cheaper and one example's gradient fits in cache: block layers,
not a wide LM head).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.data_selection.outcome import Decision, StepSelection, append_log, decide
from tda_plugins.data_selection.parallel import Ranks
from tda_plugins.data_selection.rules import DropRule
from tda_plugins.data_selection.scoring import Scorer, UnitScores
from tda_plugins.data_selection.settings import GRADIENT_SCORES, Granularity, ScoreMode
from tda_plugins.data_selection.surgery import Surgery
from tda_plugins.data_selection.target import ShardedTarget, Target
from tda_plugins.data_selection.token_mean import GENERIC_FIX, check_token_mean
from tda_plugins.grads.base import values_dtype
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.projection import ProjectionConfig
from tda_plugins.grads.routing import Route, choose_route
from tda_plugins.grads.workspace import Workspace

TokenCounter = Callable[[MicroBatchRecord], Tensor]
#: ``record -> (B,)`` each example's summed token loss in the training forward.
ExampleLosses = Callable[[MicroBatchRecord], Tensor]

#: Most bytes of one example's gradient in a layer whose per-example gradients selection
#: builds once (about a core's L2 cache). Past it the batched product's output leaves the
#: cache and the factors are faster: scoring and summing 6 of 8 examples of 128 tokens
#: took 0.70x the factors' time built once for a 256 x 256 layer (0.25 MiB an example),
#: 0.84x for 256 x 688 (0.67 MiB), 0.99x for 576 x 576 (1.27 MiB), 1.15x for 576 x 1536
#: and 1.28x for 1024 x 1024 (benchmarks/RESULTS.md, data selection overhead).
DENSE_EXAMPLE_BYTES = 1 << 20
#: Most bytes of per-example gradients built once per step; the selector's workspace keeps
#: that much between steps (a fresh allocation each step costs its page faults again).
DENSE_STEP_BYTES = 1 << 27


def _example_scales(records: list[MicroBatchRecord], device: torch.device) -> tuple[Tensor, Tensor]:
    """``(B,)`` fp64 each example's ``loss_scale`` over ``records``, on ``device``, and the
    ``(B,)`` relative rounding each carries (its record's ``loss_scale_rounding``)."""
    scales = [
        torch.as_tensor(r.loss_scale, dtype=torch.float64).detach().to(device).reshape(-1)
        for r in records
    ]
    sizes = [r.batch_size for r in records]
    roundings = torch.tensor([r.loss_scale_rounding for r in records], dtype=torch.float64)
    return (
        torch.cat([scale.expand(n) for scale, n in zip(scales, sizes, strict=True)]),
        roundings.repeat_interleave(torch.tensor(sizes)),
    )


class DataSelector(CaptureConsumer):
    """Consumer that selects examples at each optimizer step and edits ``.grad``.

    Args:
        layers: the engine's captured layers (``engine.captured_layers``); every
            trainable parameter of the model must belong to one (checked by the caller).
        rule: which examples to drop.
        token_counts: ``record -> (B,)`` number of tokens each example's loss sums over.
        score: ``"dot"``, ``"cosine"``, ``"adam"`` (against the target of
            :meth:`set_target`) or ``"loss"`` (minus each example's mean token loss, from
            ``example_losses``; no target).
        granularity: ``"global"`` or ``"per_layer"``.
        optimizer: needed for ``score="adam"``.
        log_path: JSONL file receiving one line per step (the global outcome); give it on
            one rank only.
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
        ranks: the data-parallel ranks (default: from ``torch.distributed``).
        divide: ``F``, the trainer's gradient divisor over ranks (``.grad`` = the sum of
            the ranks' backward passes / ``F``; default: the world size).
        example_losses: ``record -> (B,)`` summed token losses (``score="loss"``).
        drop_counts: at optimizer step ``k`` drop ``drop_counts[k]`` examples (a ranked
            rule's order); ``None``: the rule's own count.
        token_mean_fix: the way out named when a step's loss is not the token mean over
            its global batch (:func:`~tda_plugins.data_selection.token_mean.
            check_token_mean`, run on every selected step before ``.grad`` is edited).
    """

    wants_step_records: ClassVar[bool] = True

    def __init__(
        self,
        layers: dict[str, tuple[nn.Module, LayerAdapter]],
        *,
        rule: DropRule,
        token_counts: TokenCounter,
        score: ScoreMode = "dot",
        granularity: Granularity = "global",
        optimizer: torch.optim.Optimizer | None = None,
        log_path: str | Path | None = None,
        score_projection: ProjectionConfig | None = None,
        route: Route | None = None,
        ranks: Ranks | None = None,
        divide: float | None = None,
        example_losses: ExampleLosses | None = None,
        drop_counts: Sequence[int] | None = None,
        token_mean_fix: str = GENERIC_FIX,
    ):
        if score not in (*GRADIENT_SCORES, "loss"):
            raise ValueError(f"score must be 'dot', 'cosine', 'adam' or 'loss', got {score!r}")
        if granularity not in ("global", "per_layer"):
            raise ValueError(f"granularity must be 'global' or 'per_layer', got {granularity!r}")
        if score == "loss" and (example_losses is None or granularity != "global"):
            raise ValueError("score='loss' needs example_losses and granularity='global'")
        if rule.needs_gram and (score == "loss" or granularity != "global"):
            raise ValueError(
                f"rule {rule.name!r} weighs gradients together: it needs a gradient score and "
                "granularity='global'"
            )
        self.layers = layers
        self.example_losses = example_losses
        self.drop_counts = None if drop_counts is None else tuple(drop_counts)
        self.token_mean_fix = token_mean_fix
        self.rule = rule
        self.token_counts = token_counts
        self.granularity = granularity
        self.scorer = Scorer(
            layers,
            score=score,
            per_layer=granularity == "per_layer",
            optimizer=optimizer,
            projection=score_projection,
        )
        if rule.needs_gram and score == "adam" and any(len(u) > 1 for u in self.scorer.units):
            raise ValueError(
                f"rule {rule.name!r} with score='adam' on layers that share a parameter (tied "
                "embeddings) is not supported; use score 'dot' or 'cosine', or untie them"
            )
        self.ranks = ranks or Ranks.current()
        self.surgery = Surgery(
            layers, self.ranks, float(self.ranks.world) if divide is None else divide
        )
        self.log_path = Path(log_path) if log_path is not None else None
        self.target: Target | None = None
        self.history: list[StepSelection] = []
        self.route = route
        #: Where the materialized layers' gradients are built each step (kept: at most
        #: :data:`DENSE_STEP_BYTES` under the cost model).
        self.workspace = Workspace()
        #: Most bytes of a sharded target's layers gathered at once for scoring.
        self.target_peak_bytes = 0

    @property
    def score(self) -> ScoreMode:
        return self.scorer.score

    @property
    def needs_target(self) -> bool:
        """Whether scoring compares gradients with a target (not ``score="loss"``)."""
        return self.score in GRADIENT_SCORES

    @property
    def units(self) -> list[list[str]]:
        return self.scorer.units

    def set_target(self, target: Target) -> None:
        """The target gradient at the current weights, as
        :func:`~tda_plugins.data_selection.target.target_gradient` returns it: per layer the
        ``(D,)`` summed loss gradient of the target examples in the layer's flattened
        layout, and where smaller its per-token factors (scored by the ghost dot); or a
        :class:`~tda_plugins.data_selection.target.ShardedTarget`."""
        missing = set(self.layers) - set(target)
        if missing:
            raise ValueError(f"the target has no gradient for layers {sorted(missing)[:3]}")
        if not isinstance(target, ShardedTarget):
            target = Target(
                {name: v for name, v in target.vectors.items() if name in self.layers},
                {name: f for name, f in target.factors.items() if name in self.layers},
            )
        self.target = target
        self.scorer.new_target()

    # -- routes ------------------------------------------------------------------------

    def materialized_layers(self, records: list[MicroBatchRecord]) -> set[str]:
        """The layers whose ``(N, D)`` per-example gradients this step's selection builds
        once and scores and sums from (see ``route``); the rest are read as captured.
        No layer under a score projection (it scores projected factors) or before a
        target."""
        if (
            self.scorer.projector is not None
            or self.target is None
            or self.route is Route.FACTORIZED
        ):
            return set()
        forced = self.route is Route.MATERIALIZED
        share = self.surgery.summed_share
        candidates: list[tuple[float, int, str]] = []  # (flops saved, bytes, layer)
        for name in self.layers:
            grads = [r.layers[name].grads for r in records if name in r.layers]
            if not grads:
                continue
            factors = self.target.factors.get(name) if self.score != "adam" else None
            costs = [g.score_and_sum_costs(factors, share * g.batch_size) for g in grads]
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

    # -- the step ----------------------------------------------------------------------

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
        if self.target is None and self.needs_target:
            if missing:  # nothing to select against yet: every example, as autograd would
                self._keep_all(records, missing)
            return
        captured, records = records, self._built_once(records)
        counts = torch.cat([self.token_counts(r) for r in records])
        scores = self._scores(records, counts)
        ids = torch.cat([r.example_ids for r in records])
        per_layer = self.granularity == "per_layer"
        scales, roundings = _example_scales(records, counts.device)
        decision = decide(
            step,
            ids=ids,
            counts=counts,
            scales=scales,
            roundings=roundings,
            scores=scores,
            rule=self.rule,
            per_layer=per_layer,
            ranks=self.ranks,
            count=self._drop_count(step),
            gram=self.scorer.gram(records, self.ranks) if self.rule.needs_gram else None,
        )
        outcome = decision.outcome
        check_token_mean(
            step,
            outcome.example_ids,
            decision.counts,
            decision.scales,
            decision.roundings,
            self.surgery.divide,
            self.token_mean_fix,
        )
        if not outcome.skipped:
            masks = {
                name: decision.keep[u if per_layer else 0]
                for u, unit in enumerate(self.units)
                for name in unit
            }
            poisoned = bool(outcome.nonfinite.any())
            self.surgery.apply(
                records, masks, decision, missing, force_rebuild=poisoned, captured=captured
            )
        self.history.append(outcome)
        if self.log_path is not None:
            append_log(self.log_path, outcome)

    def _scores(self, records: list[MicroBatchRecord], counts: Tensor) -> UnitScores:
        """This rank's examples scored: against the target, or minus their mean token loss
        (one unit)."""
        if self.example_losses is not None and self.score == "loss":
            losses = torch.cat([self.example_losses(r) for r in records]).double()
            return UnitScores((-losses / counts.to(losses).clamp(min=1))[:, None])
        target = self.target
        assert target is not None  # needs_target: checked by the caller
        scores = self.scorer.scores(records, target, per_unit=isinstance(target, ShardedTarget))
        if isinstance(target, ShardedTarget):
            self.target_peak_bytes = max(self.target_peak_bytes, target.peak_bytes)
        return scores

    def _drop_count(self, step: int) -> int | None:
        """Examples step ``step`` drops under :attr:`drop_counts` (``None``: the rule's)."""
        if self.drop_counts is None:
            return None
        if step >= len(self.drop_counts):
            raise ValueError(
                f"drop_counts has {len(self.drop_counts)} entries, none for step {step + 1}; "
                "give one count per optimizer step of the run"
            )
        return self.drop_counts[step]

    def _keep_all(self, records: list[MicroBatchRecord], missing: set[int]) -> None:
        """Build the missing ``.grad`` from every example (one process, before a target)."""
        size = sum(r.batch_size for r in records)
        counts = torch.cat([self.token_counts(r) for r in records]).double().cpu()
        keep = torch.ones(size, dtype=torch.bool)
        empty = torch.zeros(size, dtype=torch.bool)
        ids = torch.zeros(size, dtype=torch.int64)
        outcome = StepSelection(-1, ids, empty.float(), empty, empty)
        decision = Decision(
            [keep], counts, counts.sum().expand(size), empty.double(), [size], 0, size, outcome
        )
        self.surgery.apply(records, dict.fromkeys(self.layers, keep), decision, missing, True)
