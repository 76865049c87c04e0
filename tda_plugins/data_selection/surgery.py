"""Removing the dropped examples' contributions from ``.grad`` (this rank's part of it).

For one kept mask over the global batch, each captured parameter's ``.grad`` becomes

    G_new = (G - sum_{dropped} c_i / F) * N_all / N_kept    (= sum_{kept} c_i / F * N_all / N_kept)

with ``c_i`` example ``i``'s captured contribution to its rank's backward, ``F`` the
trainer's gradient divisor over ranks (:func:`~tda_plugins.data_selection.parallel.
divide_factor`; 1 in one process) and ``N`` the loss tokens of all / the kept examples of
the global batch. Whichever side (kept or dropped) has fewer examples over all ranks is
summed; the kept side whenever a dropped example's gradient is not finite (``G`` holds its
NaN, which no subtraction removes); a parameter the backward left without ``.grad`` (one
process, ``parameter_grads=False``) gets the rebuild directly.

Over several ranks each rank builds only the rows of ``.grad`` it holds (all of them under
DDP, its dim-0 shard under FSDP/HSDP). Per layer, the sum over the global batch's summed
rows travels by the cheaper of two exact routes, by the bytes a rank receives (the same
choice on every rank, from the exchanged row and token counts):

* ``gather``: all-gather the summed examples' captured gradients (per-token factors:
  ``tokens x (N_i + N_o)`` values per example for a linear layer, padded to the largest
  rank's) and build this rank's rows of the sum from them (a linear layer's rows from
  ``g``'s matching columns, an embedding's from the tokens that look those rows up);
* ``reduce``: this rank's own summed examples as a dense ``(D,)`` sum, then a
  reduce-scatter to the shards (FSDP; HSDP adds an all-reduce of the shard over the
  replicas) or an all-reduce (DDP). Replicated parameters' sums are all-reduced in
  buckets of up to :data:`REDUCE_BUCKET_BYTES`, one collective per bucket: a LoRA run's
  hundreds of small adapters would otherwise pay one collective's latency each.

``gather`` moves what the summed examples hold, ``reduce`` what the layer's parameters
hold: few summed examples or short sequences against a wide layer gather. The peak extra
memory this adds per rank is one layer at a time (the gathered gradients or the one
full-size sum) or one bucket, tracked in :attr:`Surgery.peak_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.capture.adapters.embedding import EmbeddingAdapter
from tda_plugins.capture.adapters.linear import LinearAdapter
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.data_selection.outcome import Decision
from tda_plugins.data_selection.parallel import (
    Ranks,
    local,
    reduce_bytes,
    reduced_to_local,
    rows_of,
)
from tda_plugins.grads.base import PerExampleGrad, tensors_of, values_dtype
from tda_plugins.grads.dense import stack_examples
from tda_plugins.grads.embedding import EmbeddingFactors
from tda_plugins.grads.ops import rows_sums
from tda_plugins.grads.tokens import PerTokenGrad, TokenFactors

Layers = dict[str, tuple[nn.Module, LayerAdapter]]


@dataclass
class _Side:
    """The summed side of one kept mask on this rank."""

    rebuild: bool
    factor: Tensor  # N_all / N_kept, 0-dim fp64
    rows: list[Tensor | None]  # per record, the (n,) local rows summed
    global_rows: int


def _rows_sum_linear(
    grads: TokenFactors, rows: slice, params: dict[str, nn.Parameter]
) -> dict[str, Tensor]:
    """Rows ``rows`` of a linear layer's weight (and bias) sum: ``g``'s matching columns."""
    count = rows.stop - rows.start
    part = TokenFactors(grads.a, grads.g[..., rows], grads.bias).total().view(count, -1)
    n_i = grads.a.shape[-1]
    out = {"weight": part[:, :n_i]}
    if "bias" in params:
        out["bias"] = part[:, n_i]
    return out


def _rows_sum_embedding(grads: EmbeddingFactors, rows: slice) -> dict[str, Tensor]:
    """Rows ``rows`` of an embedding table's sum: the tokens that look those rows up."""
    count = rows.stop - rows.start
    inside = (grads.ids >= rows.start) & (grads.ids < rows.stop)
    ids = (grads.ids - rows.start).clamp(0, max(count - 1, 0))
    g = grads.g * inside.unsqueeze(2).to(grads.g.dtype)
    return {"weight": EmbeddingFactors(ids, g, count).total().view(count, -1)}


def local_rows_sums(
    grads: PerExampleGrad, module: nn.Module, adapter: LayerAdapter
) -> dict[str, Tensor]:
    """Local parameter name -> the sum of ``grads``' examples over this rank's rows of it
    (only those rows computed for linear and embedding layers)."""
    params = adapter.captured_parameters(module)
    first = rows_of(next(iter(params.values())))
    same = all(rows_of(p) == first for p in params.values())
    if type(adapter) is LinearAdapter and isinstance(grads, TokenFactors) and same:
        return _rows_sum_linear(grads, first, params)
    if type(adapter) is EmbeddingAdapter and isinstance(grads, EmbeddingFactors):
        return _rows_sum_embedding(grads, first)
    full = adapter.unflatten(module, grads.total())
    return {k: v[rows_of(params[k])] for k, v in full.items()}


def _zero_sum(grads: PerExampleGrad, device: torch.device) -> Tensor:
    """A ``(D,)`` sum over no rows of ``grads``, in the dtype its rows sum in (the ranks
    reduce it with the other ranks' sums, which must match it in size)."""
    return torch.zeros(grads.dim, dtype=values_dtype(grads), device=device)


#: Most bytes of replicated parameters' sums all-reduced together (DDP's own default
#: bucket is 25 MiB).
REDUCE_BUCKET_BYTES = 25 * 2**20


@dataclass
class Surgery:
    """Applies kept masks to the captured parameters' ``.grad`` (see the module doc).

    Attributes:
        layers: the engine's captured layers.
        ranks: the data-parallel ranks.
        divide: ``F`` (1 in one process).
        peak_bytes: the most bytes of gathered gradients or full-size layer sums held at
            once so far (0 in one process).
        routes: per layer, the route of the last step (empty in one process).
        summed_share: share of a step's local rows the last surgery summed (before the
            first step: half), for the cost model of the next step.
        forced: ``"gather"`` or ``"reduce"`` for every layer instead of the cheaper (both
            are exact; tests compare them).
    """

    layers: Layers
    ranks: Ranks
    divide: float = 1.0
    peak_bytes: int = 0
    routes: dict[str, str] = field(default_factory=dict)
    summed_share: float = 0.5
    forced: str | None = None
    _captured: list[MicroBatchRecord] = field(default_factory=list, repr=False)

    def apply(
        self,
        records: list[MicroBatchRecord],
        masks: dict[str, Tensor],
        decision: Decision,
        missing: set[int],
        force_rebuild: bool,
        captured: list[MicroBatchRecord] | None = None,
    ) -> None:
        """Make every captured parameter's ``.grad`` (this rank's rows) the normalized sum
        of its layers' kept rows. ``masks``: layer -> global ``(N,)`` kept mask (layers of
        one kept set share one mask object). ``captured``: the engine's own records, when
        ``records`` hold some layers built once (local sums read ``records``; what ranks
        exchange is the captured form, the same representation on every rank)."""
        self._captured = captured if captured is not None else records
        by_mask: dict[int, list[str]] = {}
        for name, keep in masks.items():
            by_mask.setdefault(id(keep), []).append(name)
        touched: dict[int, tuple[nn.Parameter, Tensor]] = {}
        for names in by_mask.values():
            built = [n for n in names if self._param_ids(n) & missing]
            rest = [n for n in names if n not in built]
            for group, rebuild in ((rest, force_rebuild), (built, True)):
                if group:
                    side = self._side(records, masks[group[0]], decision, rebuild)
                    for param, part in self._sums(records, group, side):
                        self._add(param, part, side, missing, touched)
        for param, factor in touched.values():
            if param.grad is not None:
                grad = local(param.grad)
                grad.mul_(factor.to(grad.dtype))

    def _param_ids(self, name: str) -> set[int]:
        module, adapter = self.layers[name]
        return {id(p) for p in adapter.captured_parameters(module).values()}

    def _side(
        self, records: list[MicroBatchRecord], keep: Tensor, decision: Decision, rebuild: bool
    ) -> _Side:
        counts = decision.counts
        kept_tokens = counts[keep].sum()
        factor = counts.sum() / kept_tokens if kept_tokens > 0 else torch.zeros_like(kept_tokens)
        kept = int(keep.sum())
        rebuild = rebuild or kept < keep.numel() - kept
        summed = decision.local(keep if rebuild else ~keep)
        rows: list[Tensor | None] = []
        start = 0
        for r in records:
            picked = summed[start : start + r.batch_size].nonzero().flatten()
            start += r.batch_size
            rows.append(picked.to(r.example_ids.device) if picked.numel() else None)
        self.summed_share = int(summed.sum()) / max(len(summed), 1)
        return _Side(rebuild, factor, rows, kept if rebuild else keep.numel() - kept)

    def _add(
        self,
        param: nn.Parameter,
        part: Tensor,
        side: _Side,
        missing: set[int],
        touched: dict[int, tuple[nn.Parameter, Tensor]],
    ) -> None:
        """Fold one layer's ``part`` of ``param``'s sum into its ``.grad``; the factor is
        applied once per parameter, after every layer that shares it."""
        first = id(param) not in touched
        touched[id(param)] = (param, side.factor)
        if param.grad is None:
            if id(param) in missing:  # rebuild: G = sum_kept c_i * N_all / N_kept
                param.grad = part.to(param.dtype)
            return
        grad = local(param.grad)
        if not side.rebuild:  # G - sum_dropped c_i
            grad.sub_(part.to(grad.dtype))
        elif first:  # sum_kept c_i
            grad.copy_(part)
        else:
            grad.add_(part.to(grad.dtype))

    def _sums(
        self, records: list[MicroBatchRecord], names: list[str], side: _Side
    ) -> list[tuple[nn.Parameter, Tensor]]:
        """Per parameter of ``names``' layers, this rank's rows of the side's sum / F."""
        out: list[tuple[nn.Parameter, Tensor]] = []
        if self.ranks.world == 1:
            for name, total in self._local_sums(records, names, side).items():
                module, adapter = self.layers[name]
                params = adapter.captured_parameters(module)
                out += [(params[k], v) for k, v in adapter.unflatten(module, total).items()]
            return out
        if side.global_rows == 0:
            return out
        sides = {name: self._local_side(self._captured, name, side) for name in names}
        shapes = self._largest_shapes(sides)
        bucket: list[tuple[nn.Parameter, Tensor]] = []
        filled = 0  # bytes in the bucket
        for name in names:
            module, adapter = self.layers[name]
            params = adapter.captured_parameters(module)
            gather = self._gather_bytes(sides[name], shapes[name])
            reduce = sum(reduce_bytes(p, self.ranks) for p in params.values())
            if self.forced == "gather" or (self.forced is None and gather <= reduce):
                self.routes[name] = "gather"
                every = self._gathered(sides[name], shapes[name])
                self._hold(sum(t.numel() * t.element_size() for t in tensors_of(every)))
                parts = local_rows_sums(every, module, adapter)
            else:
                self.routes[name] = "reduce"
                total = self._local_sums(records, [name], side)[name]
                self._hold(total.numel() * total.element_size())
                full = adapter.unflatten(module, total)
                if not any(isinstance(p, DTensor) for p in params.values()):
                    bucket += [(params[k], v) for k, v in full.items()]
                    filled += total.numel() * total.element_size()
                    if filled >= REDUCE_BUCKET_BYTES:
                        out += self._all_reduced(bucket)
                        bucket, filled = [], 0
                    continue
                parts = {
                    k: reduced_to_local(v.contiguous(), params[k], self.ranks)
                    for k, v in full.items()
                }
            out += [(params[k], v / self.divide) for k, v in parts.items()]
        return out + self._all_reduced(bucket)

    def _all_reduced(
        self, bucket: list[tuple[nn.Parameter, Tensor]]
    ) -> list[tuple[nn.Parameter, Tensor]]:
        """Replicated parameters' full-size sums, each summed over the ranks and divided by
        ``F``: one all-reduce per dtype of one flat buffer (every rank cuts the same
        buckets, from the same layers and routes)."""
        out: list[tuple[nn.Parameter, Tensor]] = []
        for dtype in dict.fromkeys(v.dtype for _, v in bucket):
            same = [(p, v) for p, v in bucket if v.dtype == dtype]
            flat = torch.cat([v.reshape(-1) for _, v in same])
            self._hold(flat.numel() * flat.element_size())
            self.ranks.all_reduce(flat)
            parts = flat.split([v.numel() for _, v in same])
            out += [
                (p, part.view_as(v) / self.divide) for (p, v), part in zip(same, parts, strict=True)
            ]
        return out

    def _local_sums(
        self, records: list[MicroBatchRecord], names: list[str], side: _Side
    ) -> dict[str, Tensor]:
        """Per layer, the ``(D,)`` sum over this rank's side rows (zeros without one)."""
        totals: dict[str, Tensor] = {}
        for r, rows in zip(records, side.rows, strict=True):
            if rows is None:
                continue
            for name, part in rows_sums({n: r.layers[n].grads for n in names}, rows).items():
                totals[name] = totals[name].add_(part) if name in totals else part
        device = records[0].example_ids.device
        return {
            name: totals.get(name, _zero_sum(records[0].layers[name].grads, device))
            for name in names
        }

    def _local_side(
        self, records: list[MicroBatchRecord], name: str, side: _Side
    ) -> PerExampleGrad:
        """This rank's side examples of layer ``name``, stacked (possibly none)."""
        parts = [
            r.layers[name].grads.select(rows)
            for r, rows in zip(records, side.rows, strict=True)
            if rows is not None
        ]
        if not parts:
            empty = torch.zeros(0, dtype=torch.long, device=records[0].example_ids.device)
            return records[0].layers[name].grads.select(empty)
        return stack_examples(parts)

    def _largest_shapes(self, sides: dict[str, PerExampleGrad]) -> dict[str, tuple[int, int]]:
        """Per layer, the largest side ``(rows, tokens)`` of any rank (one all-gather)."""
        mine = torch.tensor(
            [
                [g.batch_size, g.tokens if isinstance(g, PerTokenGrad) else 1]
                for g in sides.values()
            ],
            dtype=torch.int64,
        )
        largest = torch.stack(self.ranks.gather_padded(mine, tuple(mine.shape))).amax(0)
        return {
            name: (int(s[0]), int(s[1])) for name, s in zip(sides, largest.tolist(), strict=True)
        }

    def _gather_bytes(self, grads: PerExampleGrad, shape: tuple[int, int]) -> float:
        """Bytes a rank receives all-gathering every rank's side padded to ``shape``."""
        lead = 2 if isinstance(grads, PerTokenGrad) else 1
        per_row = sum(
            int(torch.Size(t.shape[lead:]).numel()) * t.element_size() for t in tensors_of(grads)
        )
        return (self.ranks.world - 1) * shape[0] * shape[1] * per_row

    def _gathered(self, grads: PerExampleGrad, shape: tuple[int, int]) -> PerExampleGrad:
        """Every rank's side of one layer, in rank order (zero padding adds nothing)."""
        lead = shape if isinstance(grads, PerTokenGrad) else shape[:1]

        def gather(t: Tensor) -> Tensor:
            return torch.cat(self.ranks.gather_padded(t, (*lead, *t.shape[len(lead) :])))

        return grads.map_tensors(gather)

    def _hold(self, nbytes: int) -> None:
        self.peak_bytes = max(self.peak_bytes, nbytes)
