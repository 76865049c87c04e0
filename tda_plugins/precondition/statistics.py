"""Inline K-FAC statistics, accumulated from the captured factors during training.

Per linear layer (linear, Conv1D, LoRA, factor-projected):

    A = sum over token rows of [a;1][a;1]^T      (N_i' x N_i')
    S = sum over token rows of g g^T              (N_o x N_o)

divided by the number of real (non-padding) token rows when read; an embedding keeps the
diagonal ``A`` of its one-hot inputs (token counts), an LM head (tied or not, unless
``curvature_head``) the diagonal of its vocabulary-wide ``S``, a norm scale one dense
factor of its per-example gradients (:mod:`~tda_plugins.precondition.forms`, what each
micro-batch adds: :mod:`~tda_plugins.precondition.products`). ``g`` is scaled by the record's
``loss_scale``, i.e. taken under the store's per-example summed-loss convention. Padding
rows are excluded through the record's token mask, by multiplication (no host sync).
Layers fed by one input (q/k/v, gate/up) share one ``A`` product per micro-batch, and
each product adds to the upper triangle of the symmetric sum only (mirrored when read).

Precision and memory: each micro-batch's products are taken, and summed until the next
commit, in the gradients' accumulation dtype (fp32 for fp32/bf16 models; half the bytes
of fp64), on the capture device. At each commit (every ``curvature_save_steps`` steps,
each trainer checkpoint, the end) those running sums are added, in fp64, to the fp64
totals of the previous commit, read back from its file one layer at a time, and the sum
is written as the new file (:mod:`~tda_plugins.precondition.snapshots`); the running sums
restart from zero. So fp32 rounding accumulates over one commit's micro-batches only,
however long the run (measured in ``tests/test_curvature_scale.py``), and a crashed run
keeps its statistics up to its last commit.

Ranks: each layer has one owner (balanced by size,
:func:`~tda_plugins.precondition.plan.assign_owners`), which alone saves its statistics.
Under the ``"local"`` schedule every rank sums its own tokens for every layer and the sums
are reduced to the owners at each commit; under ``"owner"`` each micro-batch's products
are reduced to the owner at once and only owners hold sums (see
:mod:`~tda_plugins.precondition.plan` for when each is chosen).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from tda_plugins.capture.config import CaptureConfig
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.grads.blocks import tensor_key
from tda_plugins.grads.projection import ProjectionConfig
from tda_plugins.grads.tokens import TokenFactors
from tda_plugins.precondition.forms import FactorSpec, Form, form_of, layer_specs
from tda_plugins.precondition.plan import Schedule, assign_owners, reduce_block_rows
from tda_plugins.precondition.products import Contribution, Products
from tda_plugins.precondition.snapshots import (
    Kind,
    KroneckerFactors,
    latest_set,
    link_statistics,
    prune_commits,
    read_set,
    snapshot_path,
    sum_files,
    write_statistics,
)
from tda_plugins.store.layout import StoreError, rank_dir
from tda_plugins.store.sync import EndSync, durability_mode, sync_later

__all__ = [
    "CurvatureAccumulator",
    "KroneckerFactors",
    "add_upper_gram",
    "load_curvature",
    "mirrored",
]


#: Widest Gram taken as one product; wider ones are halved (see :func:`add_upper_gram`).
_GRAM_LEAF = 200
#: A halved Gram splits at a multiple of this many columns (aligned panels).
_GRAM_ALIGN = 64


def add_upper_gram(out: Tensor, x: Tensor) -> None:
    """Add ``x^T x`` of ``(rows, n)`` ``x`` to the upper triangle (diagonal included) of
    the ``(n, n)`` ``out`` (any dtype: the product is taken in ``x``'s); entries below
    the diagonal may or may not be added to: read the sum through :func:`mirrored`.

    Halves the columns recursively: the two diagonal Grams recurse, the block above them
    is one rectangular product. That is about half the full product's multiply-adds,
    spent in the largest products the triangle allows (on the peer benchmark's GPT-2
    shapes, 1024 rows, 11-12% faster than equal 256-wide blocks of the upper triangle,
    which run below the GEMM's peak), and the block below is not written at all (5-7%
    less than adding its mirror each time).
    """
    n = x.shape[1]
    if n <= _GRAM_LEAF:
        out += (x.T @ x).to(out.dtype)
        return
    half = max(_GRAM_ALIGN, n // 2 // _GRAM_ALIGN * _GRAM_ALIGN)
    add_upper_gram(out[:half, :half], x[:, :half])
    add_upper_gram(out[half:, half:], x[:, half:])
    out[:half, half:] += (x[:, :half].T @ x[:, half:]).to(out.dtype)


def mirrored(upper: Tensor) -> Tensor:
    """The symmetric ``(n, n)`` matrix whose upper triangle (diagonal included) is
    ``upper``'s; its entries below the diagonal are ignored."""
    return upper.triu() + upper.triu(1).T


def load_curvature(root: str | Path) -> dict[str, KroneckerFactors]:
    """The K-FAC statistics of a store (fp64), each layer summed over the ranks' files
    (see :func:`~tda_plugins.precondition.snapshots.read_set`)."""
    return read_set(root).load()


class CurvatureAccumulator(CaptureConsumer):
    """Consumer that accumulates :class:`KroneckerFactors` per captured layer.

    Args:
        path: the gradient store directory the statistics are saved into.
        rank: this process's rank (its files go to ``rank-<rank>/``).
        product_dtype: dtype of each micro-batch's products and of the running sums;
            ``None`` (default): the gradients' accumulation dtype (fp32 unless the model
            is fp64); ``torch.float64``: exact fp64 products, at about twice the cost.
        shapes: layer -> its :class:`~tda_plugins.precondition.forms.FactorSpec` (or
            ``(n_a, n_s)``: two dense factors) for the layers to accumulate
            (:attr:`~tda_plugins.precondition.plan.CapturePlan.curvature_shapes`); every
            other layer gets none. ``None``: every layer with factors, its spec found from
            its module and the capture's projection as it arrives (one process only:
            ranks must agree on the layers they reduce).
        excluded: layer -> why it has no statistics, saved for readers' error messages.
        world_size: ranks that capture together (default: ``torch.distributed``'s world,
            else 1); each layer's statistics are reduced to, and saved by, its owner.
        schedule: ``"local"`` (reduce at each commit) or ``"owner"`` (reduce each
            micro-batch); see :mod:`~tda_plugins.precondition.plan`.
        curvature_head: without ``shapes``, keep a dense ``vocab x vocab`` output factor
            for the model's untied output layer, its LM head (default: its diagonal, as a
            tied head's; the engine names the head). With ``shapes`` the plan
            has decided (:class:`~tda_plugins.precondition.plan.PlanInputs`).
        durability: when each commit's file is fsynced, as the store's
            (:class:`~tda_plugins.store.writer.GradientStore`): ``"step"`` (default)
            before :meth:`commit` returns; ``"end"`` (one-pass captures) on a thread of its
            own, off the caller's path (:meth:`flush` waits for it, as does the
            interpreter at exit); ``"none"`` never.
    """

    def __init__(
        self,
        path: str | Path,
        rank: int = 0,
        product_dtype: torch.dtype | None = None,
        *,
        shapes: Mapping[str, FactorSpec | tuple[int, int]] | None = None,
        excluded: Mapping[str, str] | None = None,
        world_size: int | None = None,
        schedule: Schedule = "local",
        curvature_head: bool = False,
        durability: str = "step",
    ):
        self.durability = durability_mode(durability)
        self._end_syncs: list[EndSync] = []
        self.root = Path(path)
        self.curvature_head = curvature_head
        self.rank = rank
        self.product_dtype = product_dtype
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = world_size or (dist.get_world_size() if initialized else 1)
        if self.world_size > 1 and shapes is None:
            raise ValueError(
                "a CurvatureAccumulator on several ranks needs shapes= (plan_capture(...)."
                "curvature_shapes), so that every rank reduces the same layers in one order"
            )
        if schedule not in ("local", "owner"):
            raise ValueError(f"schedule must be 'local' or 'owner', got {schedule!r}")
        self.schedule = schedule
        self.shapes = None if shapes is None else {n: FactorSpec.of(v) for n, v in shapes.items()}
        self.excluded = dict(excluded or {})
        #: layer -> the rank that owns (reduces to, saves) its statistics
        self.owners = assign_owners(
            {n: spec.numel for n, spec in (self.shapes or {}).items()}, self.world_size
        )
        self._member = dist.get_rank() if self.world_size > 1 else 0
        # every layer's spec: the planned ones, or (no plan) each one's as it arrives
        self._specs: dict[str, FactorSpec] = dict(self.shapes or {})
        self._projection: ProjectionConfig | None = None
        self._heads: frozenset[str] = frozenset()
        # running sums since the last commit, exact in their upper triangles only (see
        # add_upper_gram); under "owner", of the owned layers only
        self._sums: dict[str, KroneckerFactors] = {}
        #: files whose sums (of the owned layers) the running sums add to
        self._base: list[Path] = []
        self._base_step: int | None = None
        #: the file of this accumulator's last commit (not one a resume started from)
        self._committed: Path | None = None
        self._dirty = False
        self._resumed = False
        self._next_step = 0

    # -- ownership -------------------------------------------------------------------------

    def owns(self, layer: str) -> bool:
        """Whether this rank holds and saves ``layer``'s statistics."""
        return self.world_size == 1 or self.owners.get(layer) == self._member

    def _owned_names(self) -> list[str]:
        if self.shapes is not None:
            return [n for n in self.shapes if self.owns(n)]
        names = dict.fromkeys(self._sums)
        names.update(dict.fromkeys(sum_files(self._base)))
        return list(names)

    @property
    def factors(self) -> dict[str, KroneckerFactors]:
        """Owned layer -> its statistics so far (fp64, symmetric; each access reads the
        last commit's file back). Under the ``"local"`` schedule on several ranks, the
        sums since the last commit are this rank's own tokens only."""
        return {name: self._total(name) for name in self._owned_names()}

    def _total(self, name: str) -> KroneckerFactors:
        """The last commit's fp64 sums of ``name`` plus the running sums (on the CPU)."""
        base = sum_files(self._base, [name]).get(name)
        running = self._sums.get(name)
        if running is None and base is None:  # a planned layer no micro-batch reached
            return _zeros(self._shape(name), torch.float64, torch.device("cpu"))
        if running is not None:  # mirrored in host memory, not beside the device's sums
            running = KroneckerFactors(
                _mirrored_on_host(running.a_sum),
                _mirrored_on_host(running.g_sum),
                running.tokens.double().cpu(),
            )
        if base is None:
            assert running is not None
            return running
        return base if running is None else base + running

    # -- events ------------------------------------------------------------------------------

    def on_attach(self, config: CaptureConfig) -> None:
        self._projection = config.projection
        self._heads = config.head_layers
        final = snapshot_path(rank_dir(self.root, self.rank), "final", 0)
        if final.exists() and not self._resumed and self.world_size == 1 and not self._base:
            self._base = [final]  # an appending capture continues the saved sums

    def restore(self, step: int) -> None:
        """Continue from the statistics committed for the steps before ``step`` (a run
        resumed from a trainer checkpoint: no step is counted twice). Refuses, changing
        nothing, when no rank saved a complete set for ``step``."""
        found = latest_set(self.root, at_step=step)
        if found is None:
            raise StoreError(
                f"{self.root} has no K-FAC statistics saved at step {step} "
                f"(curvature-before-step{step}.safetensors from every rank), so resuming there "
                "would count later steps twice; resume from a checkpoint saved while this "
                "capture ran, or use curvature=False"
            )
        own = found.files.get(self.rank)
        meta = found.metadata()[list(found.files).index(self.rank)] if own is not None else {}
        same_owners = meta.get("owners") == json.dumps(self.owners, sort_keys=True)
        self._base = [own] if own is not None and same_owners else list(found.files.values())
        self._base_step, self._next_step, self._sums, self._resumed = step, step, {}, True
        self._committed = None

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        self._next_step = step + 1

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        self._dirty = True
        if self.schedule == "owner" and self.world_size > 1:
            self._reduce_products(record)
            return
        # Layers fed by one input (q/k/v, gate/up) share its A product: a lone layer's is
        # added straight into its running sum (no (N_i', N_i') temporary per micro-batch),
        # a shared one is taken once and added to each.
        products = Products(record, self.product_dtype)
        for group in self._input_groups(record):
            shared = None
            for name in group:
                spec = self._specs[name]
                c = products(record.layers[name].grads, spec)
                stats = self._running(name, c)
                if len(group) > 1:
                    shared = c.a
                else:
                    _add(stats.a_sum, c.a, spec.a_form)
                _add(stats.g_sum, c.s, spec.s_form)
                stats.tokens += c.tokens
            if shared is not None:
                a_sum = torch.zeros_like(self._sums[group[0]].a_sum)
                add_upper_gram(a_sum, shared)
                for name in group:
                    self._sums[name].a_sum += a_sum
            products.forget()

    def on_end(self) -> None:
        self.commit(self._next_step, "final")

    # -- products ------------------------------------------------------------------------------

    def _input_groups(self, record: MicroBatchRecord) -> list[list[str]]:
        """The record's layers that keep statistics, grouped by input: linear layers fed by
        one input (one ``[a; 1]`` tensor) together, every other layer alone."""
        self._learn_specs(record)
        groups: dict[object, list[str]] = {}
        key: object
        for name, layer in record.layers.items():
            if name not in self._specs:
                continue
            grads, key = layer.grads, name
            if isinstance(grads, TokenFactors) and self._specs[name].a_form == "dense":
                key = (tensor_key(grads.a), grads.bias)
            groups.setdefault(key, []).append(name)
        return list(groups.values())

    def _learn_specs(self, record: MicroBatchRecord) -> None:
        """Without a plan: the spec of each layer seen for the first time, from its module
        and the capture's projection (a layer without factors noted in ``excluded``)."""
        if self.shapes is not None or all(n in self._specs for n in record.layers):
            return
        modules = {n: (r.module, r.adapter) for n, r in record.layers.items()}
        found = layer_specs(
            modules,
            projection=self._projection,
            curvature_head=self.curvature_head,
            heads=self._heads,
        )
        for name, spec in found.items():
            if isinstance(spec, FactorSpec):
                self._specs.setdefault(name, spec)
            else:
                self.excluded.setdefault(name, spec)

    def _running(self, name: str, c: Contribution) -> KroneckerFactors:
        """Layer ``name``'s running sums, zero ones first (in the products' dtype)."""
        if name not in self._sums:
            self._sums[name] = _zeros(self._specs[name], c.s.dtype, c.s.device)
        return self._sums[name]

    def _reduce_products(self, record: MicroBatchRecord) -> None:
        """Owner schedule: each layer's products of this micro-batch, in the planned
        order on every rank, reduced to its owner (zeros for a layer this rank did not
        see), which adds them to its running sums. A dense factor's product is taken and
        reduced a block of rows at a time (at most
        :data:`~tda_plugins.precondition.plan.REDUCE_BLOCK_BYTES`; the upper triangle's
        rows only), so no rank holds a whole ``(n, n)`` product beside its sums; a
        diagonal one is reduced whole; an input shared by several layers (q/k/v) is
        multiplied again for each of them."""
        assert self.shapes is not None
        products = Products(record, self.product_dtype)
        dtype, device = products.dtype_and_device(self.shapes)
        counts = torch.zeros(len(self.shapes), dtype=torch.float64, device=device)
        for i, (name, spec) in enumerate(self.shapes.items()):
            if self.owns(name) and name not in self._sums:
                self._sums[name] = _zeros(spec, dtype, device)
            layer = record.layers.get(name)
            c = None if layer is None else products(layer.grads, spec)
            if c is not None:
                counts[i] = c.tokens
            for field, part, n, form in (
                ("a_sum", None if c is None else c.a, spec.a, spec.a_form),
                ("g_sum", None if c is None else c.s, spec.s, spec.s_form),
            ):
                self._reduce_factor(name, field, part, n, form, dtype, device)
            del c
            products.forget()
        dist.all_reduce(counts)
        for i, name in enumerate(self.shapes):
            if self.owns(name):
                self._sums[name].tokens += counts[i]

    def _reduce_factor(
        self,
        name: str,
        field: str,
        part: Tensor | None,
        n: int,
        form: Form,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """One factor's product of this micro-batch reduced to the owner of ``name``, which
        adds it to its running ``field``: for a dense factor the Gram of its rows ``part``
        (zeros for ``None``), upper block rows at a time; for a diagonal one the vector
        ``part``, whole."""
        if form == "none":
            return
        owner = self.owners[name]
        if form == "diagonal":
            vector = torch.zeros(n, dtype=dtype, device=device) if part is None else part
            dist.reduce(vector, dst=owner)
            if self.owns(name):
                getattr(self._sums[name], field).add_(vector)
            return
        step = reduce_block_rows(n, dtype.itemsize)
        for start in range(0, n, step):
            stop = min(n, start + step)
            if part is None:
                block = torch.zeros(stop - start, n - start, dtype=dtype, device=device)
            else:
                block = part[:, start:stop].T @ part[:, start:]
            dist.reduce(block, dst=owner)
            if self.owns(name):
                getattr(self._sums[name], field)[start:stop, start:] += block

    # -- commits -------------------------------------------------------------------------------

    def commit(self, next_step: int, kind: Kind = "commit") -> Path:
        """Make the statistics of the steps before ``next_step`` durable: under the local
        schedule, reduce the running sums to the owners first (a collective: every rank
        commits at the same steps); each owner writes its layers' fp64 totals
        (``kind``: ``"commit"``, ``"checkpoint"`` or ``"final"``), and the running sums
        restart from zero. Committing twice at one step writes nothing new; a commit of
        another kind at the step of this accumulator's last commit, with no micro-batch
        since (the end of a run whose last step a trainer checkpoint saved), links that
        commit's file rather than writing the same bytes again."""
        target = snapshot_path(rank_dir(self.root, self.rank), kind, next_step)
        unchanged = not self._dirty and self._base_step == next_step
        if unchanged and target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        if unchanged and self._committed is not None and self._base == [self._committed]:
            link_statistics(self._committed, target, durable=self.durability.per_step)
        else:
            self._write(target, next_step)
        if self.durability.deferred:
            self._end_syncs.append(
                sync_later(f"the K-FAC statistics {target}", target, target.parent)
            )
        self._base, self._base_step, self._sums, self._dirty = [target], next_step, {}, False
        self._committed = target
        if kind == "commit":
            prune_commits(target.parent, keep=target)
        return target

    def _write(self, target: Path, next_step: int) -> None:
        """Write the owned layers' totals of the steps before ``next_step`` to ``target``
        (under the local schedule, the running sums reduced to their owners first)."""
        if self._dirty and self.schedule == "local" and self.world_size > 1:
            self._reduce_running_sums()
        names = self._owned_names()
        shapes = {n: self._shape(n) for n in names}
        units = sorted({spec.unit for spec in self._specs.values() if spec.unit})
        metadata = {
            "next_step": str(next_step),
            "rank": str(self.rank),
            "world_size": str(self.world_size),
            "owners": json.dumps(self.owners, sort_keys=True),
            "excluded": json.dumps(self.excluded, sort_keys=True),
            "units": json.dumps(units),
        }
        write_statistics(target, shapes, self._total, metadata, durable=self.durability.per_step)

    def flush(self) -> None:
        """Wait until every commit so far is on disk (``"end"``: for its fsyncs on their
        own thread), raising a failure of theirs."""
        for end_sync in self._end_syncs:
            end_sync.wait()

    def _shape(self, name: str) -> FactorSpec:
        if name in self._specs:
            return self._specs[name]
        return spec_of(sum_files(self._base, [name])[name])

    def _reduce_running_sums(self) -> None:
        """Local schedule: every layer's running sums, in the planned order, reduced to
        its owner; the other ranks' running sums restart from zero."""
        assert self.shapes is not None
        for name, spec in self.shapes.items():
            running = self._sums.get(name)
            if running is None:
                dtype = next((s.g_sum.dtype for s in self._sums.values()), torch.float32)
                device = next((s.g_sum.device for s in self._sums.values()), torch.device("cpu"))
                running = _zeros(spec, self.product_dtype or dtype, device)
            for tensor in (running.a_sum, running.g_sum, running.tokens):
                if tensor.numel():
                    dist.reduce(tensor, dst=self.owners[name])
            if self.owns(name):
                self._sums[name] = running
            else:
                self._sums.pop(name, None)


def spec_of(stats: KroneckerFactors) -> FactorSpec:
    """The :class:`~tda_plugins.precondition.forms.FactorSpec` of statistics read back
    (their forms are their shapes; the unit is not known from them)."""
    a, s = stats.a_sum, stats.g_sum
    return FactorSpec(a.shape[0], s.shape[0], form_of(a), form_of(s))


def _add(total: Tensor, part: Tensor | None, form: Form) -> None:
    """Add one micro-batch's ``part`` (:class:`~tda_plugins.precondition.products.
    Contribution`) to a factor's running sum of ``form``."""
    if form == "dense":
        assert part is not None
        add_upper_gram(total, part)
    elif form == "diagonal":
        assert part is not None
        total += part.to(total.dtype)


def _mirrored_on_host(upper: Tensor) -> Tensor:
    """:func:`mirrored` of a running sum (a dense factor; a diagonal one as it is), in
    fp64 on the CPU (one temporary)."""
    if upper.dim() < 2:
        return upper.to("cpu", torch.float64)
    out = upper.to("cpu", torch.float64).triu_()
    return out.add_(out.triu(1).T)


def _zeros(spec: FactorSpec, dtype: torch.dtype, device: torch.device) -> KroneckerFactors:
    a_shape, s_shape = spec.shapes()
    return KroneckerFactors(
        torch.zeros(a_shape, dtype=dtype, device=device),
        torch.zeros(s_shape, dtype=dtype, device=device),
        torch.zeros((), dtype=torch.float64, device=device),
    )
