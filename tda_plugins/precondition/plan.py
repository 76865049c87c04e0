"""The memory plan of a capture, from shapes alone (a model on the meta device will do).

Computed when a capture session starts, before any step: per captured layer, the K-FAC
statistics it will hold (``A``: ``n_a x n_a``, ``S``: ``n_s x n_s``, or a diagonal, or
none: :mod:`~tda_plugins.precondition.forms`), which rank owns them,
and what its per-example records hold per token; per rank, the statistics in memory, the
records of one micro-batch, the store's shard bytes per step and the communication the
statistics cost, against the plain training step's own memory (parameters, gradients and
Adam moments; divided by the world size when the training shards them, as FSDP does).

Statistics are the part that can refuse: over ``budget_gb`` per rank,
:func:`require_within_budget` raises :class:`CurvatureBudgetError` with the numbers and
the settings that would fit (factor projection, ``last_n_blocks``, the head's output factor
diagonal, curvature off, a larger budget).

Reduction schedule (how the statistics of several ranks meet, see
:class:`~tda_plugins.precondition.statistics.CurvatureAccumulator`):

* ``"local"``: each rank sums its own tokens' products for every layer, and the sums are
  reduced to each layer's owner at every commit (every ``curvature_save_steps`` steps, each
  trainer checkpoint, the end). No communication during steps; each rank holds every
  layer's sums. Chosen when every layer's sums fit the budget (and always in one process).
* ``"owner"``: each micro-batch's products are reduced, layer by layer and a block of
  rows at a time, to the layer's owner, which alone holds its sums: memory divided by the
  world size (balanced by size), plus one block (at most 64 MiB), at the cost of sending
  every layer's Gram once per micro-batch.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import nn

from tda_plugins.capture.layers import LayerSelection, head_layers
from tda_plugins.grads.projection import ProjectionConfig
from tda_plugins.parallel.dtensor import is_dtensor
from tda_plugins.precondition.forms import (
    CURVATURE_OFF,
    NOT_FACTORED,
    FactorSpec,
    Form,
    layer_specs,
)
from tda_plugins.precondition.layer_plan import LayerPlan, layer_plan

logger = logging.getLogger(__name__)

GIB = 1 << 30
#: Owner schedule: most bytes of one product block taken and reduced at a time.
REDUCE_BLOCK_BYTES = 64 << 20
Schedule = Literal["local", "owner"]


class CurvatureBudgetError(ValueError):
    """The K-FAC statistics of a capture would not fit the per-rank memory budget."""


@dataclass(frozen=True)
class PlanInputs:
    """What a plan is computed from, besides the model.

    Attributes:
        selection: the captured layers.
        projection: the projection applied in the hook (``None``: exact gradients).
        curvature: whether K-FAC statistics are accumulated at all.
        curvature_head: keep the output factor of the model's untied output layer (the
            LM head) dense (``vocab x vocab``); by default its diagonal.
        budget_gb: most GiB of statistics per rank; ``None``: no limit.
        world_size: ranks of the data-parallel group.
        rank: this process's rank.
        sharded: the training shards parameters, gradients and optimizer state over the
            ranks (FSDP); otherwise each rank holds them whole (one process, DDP).
        tokens_per_example: sequence length of a micro-batch (``None``: unknown; records
            and shards are then given per 1,024 tokens and per example).
        examples_per_micro_batch: examples in one micro-batch on one rank.
        micro_batches_per_step: gradient accumulation steps.
    """

    selection: LayerSelection
    projection: ProjectionConfig | None = None
    curvature: bool = True
    curvature_head: bool = False
    budget_gb: float | None = 8.0
    world_size: int = 1
    rank: int = 0
    sharded: bool = False
    tokens_per_example: int | None = None
    examples_per_micro_batch: int = 1
    micro_batches_per_step: int = 1


@dataclass(frozen=True)
class CapturePlan:
    """Per-layer and per-rank memory of a capture (see the module docstring).

    Attributes:
        inputs: what it was computed from.
        layers: every captured layer, in model order.
        itemsize: bytes per statistic in memory (fp32: 4; fp64 models: 8).
        training_bytes: the plain training step's parameters, gradients and Adam moments
            on one rank.
        schedule: how the ranks' statistics meet (``"local"`` or ``"owner"``).
    """

    inputs: PlanInputs
    layers: tuple[LayerPlan, ...]
    itemsize: int
    training_bytes: int
    schedule: Schedule = field(default="local")

    # -- what the accumulator needs ------------------------------------------------------

    @property
    def curvature_shapes(self) -> dict[str, FactorSpec]:
        """Layer -> the statistics of every layer that accumulates them (each unpacks as
        ``(n_a, n_s)``)."""
        return {layer.name: layer.factors for layer in self.layers if layer.factors is not None}

    @property
    def excluded(self) -> dict[str, str]:
        """Layer -> why it accumulates no statistics."""
        return {layer.name: layer.note for layer in self.layers if layer.note is not None}

    # -- per rank --------------------------------------------------------------------------

    def owned_bytes(self, rank: int) -> int:
        """Statistics whose owner is ``rank``."""
        return self.itemsize * sum(
            layer.statistics_numel() for layer in self.layers if layer.owner == rank
        )

    @property
    def all_bytes(self) -> int:
        """Statistics of every layer (what one rank holds under the local schedule)."""
        return self.itemsize * sum(layer.statistics_numel() for layer in self.layers)

    @property
    def transient_bytes(self) -> int:
        """Owner schedule: the largest block of a product reduced at once; the local
        schedule adds products straight into its sums."""
        if self.schedule == "local":
            return 0
        widths = [n for spec in self.curvature_shapes.values() for n in spec.dense_widths]
        return max(
            (self.itemsize * n * reduce_block_rows(n, self.itemsize) for n in widths), default=0
        )

    def statistics_bytes(self, rank: int | None = None) -> int:
        """Statistics in memory on ``rank`` (default: the most loaded rank)."""
        if self.schedule == "local":
            return self.all_bytes
        ranks = range(self.inputs.world_size) if rank is None else (rank,)
        return max(self.owned_bytes(r) for r in ranks) + self.transient_bytes

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens of one micro-batch on one rank (1,024 when the length is unknown)."""
        tokens = self.inputs.tokens_per_example or 1024
        return tokens * self.inputs.examples_per_micro_batch

    @property
    def records_bytes(self) -> int:
        """Per-example records of one micro-batch: on the capture device when its
        backward ends (the store then keeps a host copy until the shard is written)."""
        examples = self.inputs.examples_per_micro_batch
        return sum(
            layer.token_bytes * self.tokens_per_micro_batch + layer.example_bytes * examples
            for layer in self.layers
        )

    @property
    def shard_bytes_per_step(self) -> int:
        """Store bytes one rank writes per optimizer step: per example and layer, the
        smaller of its per-token factors and its materialized gradient."""
        tokens = self.inputs.tokens_per_example or 1024
        per_example = sum(
            min(layer.token_shard_bytes * tokens, layer.dense_bytes)
            if layer.token_shard_bytes
            else layer.dense_bytes
            for layer in self.layers
        )
        return (
            per_example * self.inputs.examples_per_micro_batch * self.inputs.micro_batches_per_step
        )

    @property
    def communication_bytes(self) -> int:
        """Statistics sent per micro-batch (owner schedule) or per commit (local)."""
        if self.inputs.world_size == 1:
            return 0
        return self.all_bytes

    @property
    def factorization_bytes(self) -> int:
        """Attribution, one process: the largest factor's fp64 eigendecomposition (the
        matrix, its eigenvectors and LAPACK's workspace, about three copies)."""
        widest = max((n for f in self.curvature_shapes.values() for n in f.dense_widths), default=0)
        return 3 * 8 * widest**2

    @property
    def extra_bytes(self) -> int:
        """What the capture adds on the device of the most loaded rank: statistics and
        one micro-batch's records."""
        return self.statistics_bytes() + self.records_bytes

    # -- reporting -------------------------------------------------------------------------

    def table(self) -> str:
        """A compact table: one row per kind of layer (block indices folded into ``*``),
        then the per-rank totals."""
        inputs = self.inputs
        kinds: dict[str, list[LayerPlan]] = {}
        for layer in self.layers:
            kinds.setdefault(re.sub(r"\.\d+\.", ".*.", layer.name), []).append(layer)
        width = max(len(k) for k in kinds) + 6
        rows = [
            f"{'layer':<{width}} {'n_a':>11} {'n_s':>11} {'statistics':>11} {'records/1k tok':>14}"
        ]
        for kind, layers in kinds.items():
            spec = layers[0].factors
            a, s = (
                (_width(spec.a, spec.a_form), _width(spec.s, spec.s_form))
                if spec is not None
                else ("-", "-")
            )
            stats = self.itemsize * sum(layer.statistics_numel() for layer in layers)
            records = 1024 * sum(layer.token_bytes for layer in layers)
            label = f"{kind} ({len(layers)})"
            rows.append(f"{label:<{width}} {a:>11} {s:>11} {_size(stats):>11} {_size(records):>14}")
        training = "sharded over" if inputs.sharded else "whole on each of"
        tokens = (
            f"per micro-batch of {self.tokens_per_micro_batch} tokens"
            if inputs.tokens_per_example is not None
            else "per 1,024 tokens (sequence length unknown)"
        )
        rows += [
            f"ranks: {inputs.world_size} (training state {training} them); statistics in "
            f"fp{8 * self.itemsize}, schedule '{self.schedule}'",
            f"per rank: statistics {_size(self.statistics_bytes())} (budget "
            f"{'none' if inputs.budget_gb is None else f'{inputs.budget_gb:g} GiB'}), records "
            f"{_size(self.records_bytes)} {tokens}, store "
            f"{_size(self.shard_bytes_per_step)} per step; training step "
            f"{_size(self.training_bytes)} (params, grads, Adam): extra "
            f"{100 * self.extra_bytes / max(self.training_bytes, 1):.0f}% of it",
            f"communication: {_size(self.communication_bytes)} per "
            f"{'micro-batch' if self.schedule == 'owner' else 'commit'}; attribution: "
            f"{_size(self.factorization_bytes)} for the largest factorization",
        ]
        if not inputs.curvature:
            rows.append("no K-FAC statistics: curvature off")
        for name, note in self.excluded.items():
            if note not in (NOT_FACTORED, CURVATURE_OFF):
                rows.append(f"no statistics for {name}: {note}")
        return "\n".join(rows)

    def log(self) -> None:
        logger.info("capture plan (rank %d)\n%s", self.inputs.rank, self.table())


def _width(n: int, form: Form) -> str:
    """A factor's width as the plan's table shows it (a diagonal marked, none as ``-``)."""
    return {"dense": str(n), "diagonal": f"{n} diag", "none": "-"}[form]


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# -- shapes ----------------------------------------------------------------------------------


def reduce_block_rows(n: int, itemsize: int) -> int:
    """Rows of an ``(n, n)`` product taken and reduced at a time (owner schedule)."""
    return max(1, min(n, REDUCE_BLOCK_BYTES // (n * itemsize)))


def assign_owners(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """Layer -> owning rank, balanced by size: largest first, each to the least loaded
    rank (ties: the lower rank); equal sizes in the order given. Deterministic from the
    names and sizes, so every rank computes the same assignment. The most loaded rank
    holds at most the mean load plus one layer (the greedy's bound)."""
    loads = [0] * world_size
    owners: dict[str, int] = {}
    order = sorted(range(len(sizes)), key=lambda i: -list(sizes.values())[i])
    names = list(sizes)
    for i in order:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[names[i]] = rank
        loads[rank] += sizes[names[i]]
    return {name: owners[name] for name in names}


def training_bytes(model: nn.Module, world_size: int, sharded: bool) -> int:
    """Parameters, gradients of the trainable ones, and two Adam moments per trainable
    parameter in its own dtype, on one rank: a DTensor's local shard (FSDP2 shards over
    its mesh, HSDP over the shard dimension of its mesh alone, each replica whole), a
    plain tensor whole, or divided by ``world_size`` when ``sharded`` (a plan of a
    sharded run made on an unsharded model, such as a meta-device one)."""
    seen: set[int] = set()
    whole = local = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        copies = 4 if p.requires_grad else 1
        if is_dtensor(p):
            shard = p.to_local()
            local += shard.numel() * shard.element_size() * copies
        else:
            whole += p.numel() * p.element_size() * copies
    return local + (whole // world_size if sharded else whole)


def plan_capture(model: nn.Module, inputs: PlanInputs) -> CapturePlan:
    """The plan of capturing ``inputs.selection`` of ``model`` (any device, meta included)."""
    selected = inputs.selection.resolve(model)
    specs: dict[str, FactorSpec | str] = (
        layer_specs(
            selected,
            projection=inputs.projection,
            curvature_head=inputs.curvature_head,
            heads=head_layers(model),
        )
        if inputs.curvature
        else dict.fromkeys(selected, CURVATURE_OFF)
    )
    layers = []
    dtypes: set[torch.dtype] = set()
    for name, (module, adapter) in selected.items():
        layer = layer_plan(name, module, adapter, inputs.projection, specs[name])
        if layer.factors is not None:
            dtypes |= {p.dtype for p in adapter.captured_parameters(module).values()}
        layers.append(layer)
    sizes = {layer.name: layer.statistics_numel() for layer in layers if layer.factors is not None}
    owners = assign_owners(sizes, inputs.world_size)
    layers = [replace(layer, owner=owners.get(layer.name)) for layer in layers]
    itemsize = 8 if torch.float64 in dtypes else 4
    plan = CapturePlan(
        inputs, tuple(layers), itemsize, training_bytes(model, inputs.world_size, inputs.sharded)
    )
    budget = _budget_bytes(inputs)
    fits_replicated = budget is None or plan.all_bytes <= budget
    schedule: Schedule = "local" if inputs.world_size == 1 or fits_replicated else "owner"
    return replace(plan, schedule=schedule)


def _budget_bytes(inputs: PlanInputs) -> int | None:
    return None if inputs.budget_gb is None else int(inputs.budget_gb * GIB)


# -- refusal -----------------------------------------------------------------------------------


def require_within_budget(model: nn.Module, plan: CapturePlan) -> None:
    """Raise :class:`CurvatureBudgetError` when the statistics of the most loaded rank
    exceed the budget, naming the numbers and the settings that would fit, each with its
    own figure."""
    budget = _budget_bytes(plan.inputs)
    need = plan.statistics_bytes()
    if budget is None or need <= budget:
        return
    inputs = plan.inputs
    options = []
    if inputs.projection is None:
        projected = plan_capture(model, replace(inputs, projection=ProjectionConfig("factor")))
        options.append(f"projection='factor' (k_a=k_g=16: {_size(projected.statistics_bytes())})")
    blocks = _largest_fitting_blocks(model, inputs, budget)
    if blocks is not None:
        n, fitting = blocks
        options.append(f"last_n_blocks={n} ({_size(fitting.statistics_bytes())})")
    if inputs.curvature_head:
        without = plan_capture(model, replace(inputs, curvature_head=False))
        if without.statistics_bytes() < need:
            options.append(f"curvature_head=False ({_size(without.statistics_bytes())})")
    options.append("curvature=False (no K-FAC/EK-FAC/LoGra afterwards)")
    options.append(f"curvature_budget_gb={_round_up(need / GIB):g}")
    widest = max(
        plan.curvature_shapes.items(), key=lambda item: max(item[1].dense_widths, default=0)
    )
    raise CurvatureBudgetError(
        f"K-FAC statistics need {_size(need)} per rank ({len(plan.curvature_shapes)} layers "
        f"over {inputs.world_size} rank(s), widest {widest[0]}: "
        f"{max(widest[1].dense_widths, default=0)}^2), over "
        f"curvature_budget_gb={inputs.budget_gb:g}; ways out: {'; '.join(options)}"
    )


def _round_up(x: float) -> float:
    """``x`` rounded up to two significant digits."""
    scale = 10.0 ** (math.floor(math.log10(x)) - 1)
    return float(f"{math.ceil(x / scale) * scale:.2g}")


def _largest_fitting_blocks(
    model: nn.Module, inputs: PlanInputs, budget: int
) -> tuple[int, CapturePlan] | None:
    """The most trailing blocks whose statistics fit, by bisection (``None``: not even one)."""
    found: tuple[int, CapturePlan] | None = None
    low, high = 1, _block_count(model)
    while low <= high:
        n = (low + high) // 2
        selection = replace(inputs.selection, last_n_blocks=n)
        try:
            plan = plan_capture(model, replace(inputs, selection=selection))
        except ValueError:  # no captured layer in the last n blocks
            low = n + 1
            continue
        if plan.statistics_bytes() <= budget:
            found, low = (n, plan), n + 1
        else:
            high = n - 1
    return found


def _block_count(model: nn.Module) -> int:
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    return max((len(m) for m in lists), default=0)
