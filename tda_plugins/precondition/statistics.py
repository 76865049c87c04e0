"""Inline K-FAC statistics, accumulated from the captured factors during training.

Per factorized layer (linear, Conv1D, LoRA, factor-projected):

    A = sum over token rows of [a;1][a;1]^T      (N_i' x N_i')
    S = sum over token rows of g g^T              (N_o x N_o)

divided by the number of real (non-padding) token rows when read. ``g`` is scaled by the
record's ``loss_scale``, i.e. taken under the store's per-example summed-loss convention.
Padding rows are excluded through the record's token mask, by multiplication (no host
sync). Layers fed by one input (q/k/v, gate/up) share one ``A`` product per micro-batch,
and each product adds to the upper triangle of the symmetric sum only (mirrored when read).

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
:mod:`~tda_plugins.precondition.plan` for when each is chosen). Embedding and norm layers
get no K-FAC factors.
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
from tda_plugins.grads.blocks import TensorKey, accumulation_dtype, tensor_key
from tda_plugins.grads.tokens import TokenFactors
from tda_plugins.precondition.plan import Schedule, assign_owners, reduce_block_rows
from tda_plugins.precondition.snapshots import (
    Kind,
    KroneckerFactors,
    latest_set,
    prune_commits,
    read_set,
    snapshot_path,
    sum_files,
    write_statistics,
)
from tda_plugins.store.layout import StoreError, rank_dir

__all__ = [
    "CurvatureAccumulator",
    "KroneckerFactors",
    "add_upper_gram",
    "load_curvature",
    "mirrored",
]


def _token_rows(t: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(B, T', N)`` factor -> its ``(rows, N)`` token rows with padding rows zeroed, and
    their count (fp64 scalar).

    A module called ``k`` times on the sequence holds ``k T`` token rows (the calls are
    concatenated), so the ``(B, T)`` mask is tiled ``k`` times; rows of calls on other
    lengths cannot be matched to tokens and all count.
    """
    if mask is not None and mask.shape[0] == t.shape[0] and t.shape[1] % mask.shape[1] == 0:
        keep = mask.to(t.dtype).repeat(1, t.shape[1] // mask.shape[1]).unsqueeze(2)
        t, count = t * keep, keep.sum(dtype=torch.float64)
    else:
        count = torch.tensor(float(t.shape[0] * t.shape[1]), dtype=torch.float64, device=t.device)
    return t.reshape(-1, t.shape[2]), count


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
    """Consumer that accumulates :class:`KroneckerFactors` per factorized layer.

    Args:
        path: the gradient store directory the statistics are saved into.
        rank: this process's rank (its files go to ``rank-<rank>/``).
        product_dtype: dtype of each micro-batch's products and of the running sums;
            ``None`` (default): the gradients' accumulation dtype (fp32 unless the model
            is fp64); ``torch.float64``: exact fp64 products, at about twice the cost.
        shapes: layer -> ``(n_a, n_s)`` of the layers to accumulate
            (:attr:`~tda_plugins.precondition.plan.CapturePlan.curvature_shapes`); every
            other layer gets none. ``None``: every factorized layer, found as it arrives
            (one process only: ranks must agree on the layers they reduce).
        excluded: layer -> why it has no statistics, saved for readers' error messages.
        world_size: ranks that capture together (default: ``torch.distributed``'s world,
            else 1); each layer's statistics are reduced to, and saved by, its owner.
        schedule: ``"local"`` (reduce at each commit) or ``"owner"`` (reduce each
            micro-batch); see :mod:`~tda_plugins.precondition.plan`.
    """

    def __init__(
        self,
        path: str | Path,
        rank: int = 0,
        product_dtype: torch.dtype | None = None,
        *,
        shapes: Mapping[str, tuple[int, int]] | None = None,
        excluded: Mapping[str, str] | None = None,
        world_size: int | None = None,
        schedule: Schedule = "local",
    ):
        self.root = Path(path)
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
        self.shapes = None if shapes is None else dict(shapes)
        self.excluded = dict(excluded or {})
        sizes = {n: a * a + s * s for n, (a, s) in (self.shapes or {}).items()}
        #: layer -> the rank that owns (reduces to, saves) its statistics
        self.owners = assign_owners(sizes, self.world_size)
        self._member = dist.get_rank() if self.world_size > 1 else 0
        # running sums since the last commit, exact in their upper triangles only (see
        # add_upper_gram); under "owner", of the owned layers only
        self._sums: dict[str, KroneckerFactors] = {}
        #: files whose sums (of the owned layers) the running sums add to
        self._base: list[Path] = []
        self._base_step: int | None = None
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
            n_a, n_s = self._shape(name)
            return _zeros(n_a, n_s, torch.float64, torch.device("cpu"))
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
        groups: dict[tuple[TensorKey, bool], list[tuple[str, TokenFactors]]] = {}
        for name, grads in self._factored(record).items():
            groups.setdefault((tensor_key(grads.a), grads.bias), []).append((name, grads))
        for group in groups.values():
            a, count = self._rows(group[0][1].augmented_a(), record)
            stats = [self._running(name, grads) for name, grads in group]
            if len(stats) == 1:
                add_upper_gram(stats[0].a_sum, a)
            else:
                a_sum = torch.zeros_like(stats[0].a_sum)
                add_upper_gram(a_sum, a)
                for s in stats:
                    s.a_sum += a_sum
            for (_, grads), s in zip(group, stats, strict=True):
                add_upper_gram(s.g_sum, self._g_rows(grads, record))
                s.tokens += count

    def on_end(self) -> None:
        self.commit(self._next_step, "final")

    # -- products ------------------------------------------------------------------------------

    def _factored(self, record: MicroBatchRecord) -> dict[str, TokenFactors]:
        return {
            name: layer.grads
            for name, layer in record.layers.items()
            if isinstance(layer.grads, TokenFactors)
            and (self.shapes is None or name in self.shapes)
        }

    def _dtype(self, grads: TokenFactors) -> torch.dtype:
        return self.product_dtype or accumulation_dtype(grads.g)

    def _rows(self, t: Tensor, record: MicroBatchRecord) -> tuple[Tensor, Tensor]:
        return _token_rows(
            t if self.product_dtype is None else t.to(self.product_dtype), record.token_mask
        )

    def _g_rows(self, grads: TokenFactors, record: MicroBatchRecord) -> Tensor:
        g = grads.g.to(accumulation_dtype(grads.g)) * record.loss_scale
        return self._rows(g, record)[0]

    def _running(self, name: str, grads: TokenFactors) -> KroneckerFactors:
        """Layer ``name``'s running sums, zero ones first."""
        if name not in self._sums:
            self._sums[name] = _zeros(
                grads.in_dim, grads.out_dim, self._dtype(grads), grads.g.device
            )
        return self._sums[name]

    def _reduce_products(self, record: MicroBatchRecord) -> None:
        """Owner schedule: each layer's products of this micro-batch, in the planned
        order on every rank, reduced to its owner (zeros for a layer this rank did not
        see), which adds them to its running sums. Each product is taken and reduced a
        block of rows at a time (at most
        :data:`~tda_plugins.precondition.plan.REDUCE_BLOCK_BYTES`; the upper triangle's
        rows only), so no rank holds a whole ``(n, n)`` product beside its sums; an input
        shared by several layers (q/k/v) is multiplied again for each of them."""
        assert self.shapes is not None
        factored = self._factored(record)
        some = next(iter(factored.values()), None)
        dtype = self.product_dtype or (
            accumulation_dtype(some.g) if some is not None else torch.float32
        )
        device = some.g.device if some is not None else torch.device("cpu")
        counts = torch.zeros(len(self.shapes), dtype=torch.float64, device=device)
        for i, (name, (n_a, n_s)) in enumerate(self.shapes.items()):
            grads = factored.get(name)
            if self.owns(name) and name not in self._sums:
                self._sums[name] = _zeros(n_a, n_s, dtype, device)
            a_rows = g_rows = None
            if grads is not None:
                a_rows, counts[i] = self._rows(grads.augmented_a(), record)
                g_rows = self._g_rows(grads, record)
            self._reduce_gram(name, "a_sum", a_rows, n_a, dtype, device)
            del a_rows
            self._reduce_gram(name, "g_sum", g_rows, n_s, dtype, device)
        dist.all_reduce(counts)
        for i, name in enumerate(self.shapes):
            if self.owns(name):
                self._sums[name].tokens += counts[i]

    def _reduce_gram(
        self,
        name: str,
        field: str,
        rows: Tensor | None,
        n: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """``rows^T rows`` (zeros for ``None``), upper block rows at a time, reduced to
        the owner of ``name``, which adds each block to its running ``field``."""
        owner, step = self.owners[name], reduce_block_rows(n, dtype.itemsize)
        for start in range(0, n, step):
            stop = min(n, start + step)
            if rows is None:
                block = torch.zeros(stop - start, n - start, dtype=dtype, device=device)
            else:
                block = rows[:, start:stop].T @ rows[:, start:]
            dist.reduce(block, dst=owner)
            if self.owns(name):
                getattr(self._sums[name], field)[start:stop, start:] += block

    # -- commits -------------------------------------------------------------------------------

    def commit(self, next_step: int, kind: Kind = "commit") -> Path:
        """Make the statistics of the steps before ``next_step`` durable: under the local
        schedule, reduce the running sums to the owners first (a collective: every rank
        commits at the same steps); each owner writes its layers' fp64 totals
        (``kind``: ``"commit"``, ``"checkpoint"`` or ``"final"``), and the running sums
        restart from zero. Committing twice at one step writes nothing new."""
        target = snapshot_path(rank_dir(self.root, self.rank), kind, next_step)
        if not self._dirty and self._base_step == next_step and target.exists():
            return target
        if self._dirty and self.schedule == "local" and self.world_size > 1:
            self._reduce_running_sums()
        names = self._owned_names()
        shapes = {n: self._shape(n) for n in names}
        metadata = {
            "next_step": str(next_step),
            "rank": str(self.rank),
            "world_size": str(self.world_size),
            "owners": json.dumps(self.owners, sort_keys=True),
            "excluded": json.dumps(self.excluded, sort_keys=True),
        }
        target.parent.mkdir(parents=True, exist_ok=True)
        write_statistics(target, shapes, self._total, metadata)
        self._base, self._base_step, self._sums, self._dirty = [target], next_step, {}, False
        if kind == "commit":
            prune_commits(target.parent, keep=target)
        return target

    def _shape(self, name: str) -> tuple[int, int]:
        if self.shapes is not None:
            return self.shapes[name]
        if name in self._sums:
            s = self._sums[name]
            return s.a_sum.shape[0], s.g_sum.shape[0]
        base = sum_files(self._base, [name])[name]
        return base.a_sum.shape[0], base.g_sum.shape[0]

    def _reduce_running_sums(self) -> None:
        """Local schedule: every layer's running sums, in the planned order, reduced to
        its owner; the other ranks' running sums restart from zero."""
        assert self.shapes is not None
        for name, (n_a, n_s) in self.shapes.items():
            running = self._sums.get(name)
            if running is None:
                dtype = next((s.a_sum.dtype for s in self._sums.values()), torch.float32)
                device = next((s.a_sum.device for s in self._sums.values()), torch.device("cpu"))
                running = _zeros(n_a, n_s, self.product_dtype or dtype, device)
            for tensor in (running.a_sum, running.g_sum, running.tokens):
                dist.reduce(tensor, dst=self.owners[name])
            if self.owns(name):
                self._sums[name] = running
            else:
                self._sums.pop(name, None)


def _mirrored_on_host(upper: Tensor) -> Tensor:
    """:func:`mirrored` of a running sum, in fp64 on the CPU (one temporary)."""
    out = upper.to("cpu", torch.float64).triu_()
    return out.add_(out.triu(1).T)


def _zeros(n_a: int, n_s: int, dtype: torch.dtype, device: torch.device) -> KroneckerFactors:
    return KroneckerFactors(
        torch.zeros(n_a, n_a, dtype=dtype, device=device),
        torch.zeros(n_s, n_s, dtype=dtype, device=device),
        torch.zeros((), dtype=torch.float64, device=device),
    )
