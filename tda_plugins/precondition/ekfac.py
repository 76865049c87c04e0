"""The EK-FAC preconditioner: the Kronecker eigenbasis, eigenvalues corrected on the store.

Per layer, with its gradient ``G`` in its layout and a basis ``(B_r, B_c)``
(:mod:`~tda_plugins.precondition.sides`): the eigenbases of its dense row and column
factors, the identity for a diagonal row factor (an embedding's token counts) or none (a
norm scale), and for a tied weight the identity and the eigenbasis of its column marginal
(:func:`~tda_plugins.precondition.sides.tied_eigenbasis`). The eigenvalues are corrected
on the stored training gradients (one pass over the store; a tied weight's gradient is
the sum of its uses'):

    Lambda = E_n[(B_r^T G_n B_c)^2]
    G_q -> B_r [(B_r^T G_q B_c) / (Lambda + l)] B_c^T,      l = damping * mean(Lambda)

(or, where that is cheaper, the queries stay in the basis and the training gradients
are rotated into it, ``B_r^T G B_c``: the same dot products).

Eigendecompositions are computed in fp64, and so are the correction's sums across
micro-batches and the division by ``Lambda + l`` (each entry's square and its sum over one
micro-batch's examples are in the gradients' accumulation dtype, built a block of rows at
a time while in cache). The rotations themselves (:func:`~tda_plugins.grads.ops.rotated`:
of the per-token factors where that is cheaper, ``B_r^T g_t`` and ``B_c^T a_t``) run in
the gradients' accumulation dtype: a rotation keeps norms, so fp32 adds only fp32
rounding to what fp32 gradients carry. So the bases are kept in that dtype once computed.

The eigendecompositions stay in fp64 even for fp32 gradients, though fp32 would halve
their time: an fp32 eigensolver's vectors are accurate to about ``eps_32 ||F|| / gap``,
and the corrected eigenvalues, each measured along one of them, turn that into errors
far above fp32 rounding (SmolLM2-135M's factors, 32 and 128 rows: EK-FAC-preconditioned
queries 2-6 % off, scores up to 0.3 %, at the default damping;
``benchmarks/eigh_precision.py``).
Batching the factors of one size into one call gains nothing on the CPU (LAPACK solves
them one by one), so each is decomposed as the fit reaches it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from math import prod
from typing import Literal

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tda_plugins.grads.base import (
    PerExampleGrad,
    row_cost,
    row_form,
    tensors_of,
    values_dtype,
)
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.ops import add_squared_entries_of_sum, rotated_grads
from tda_plugins.parallel.ranks import LayerTensors, Ranks, on_device
from tda_plugins.precondition.base import (
    Preconditioner,
    TrainingChunks,
    register_preconditioner,
)
from tda_plugins.precondition.fitting import (
    ABSENT,
    SharedInput,
    check_shape,
    fit_layers,
    present,
)
from tda_plugins.precondition.sides import (
    Basis,
    Sides,
    damping_scale,
    divided,
    tied_eigenbasis,
)
from tda_plugins.store.reader import StoreChunk, StoreReader

#: Most bytes of training gradients rotated into the EK-FAC basis that scoring keeps from
#: the eigenvalue correction of one layer group (the whole store's, materialized): layers
#: are grouped to fit, and a layer over it alone is scored from the store again.
KEPT_BYTES = 1 << 29
#: Examples read at a time in the EK-FAC fit: a chunk is held in memory whole, and the fit
#: gains nothing from larger ones, so stored micro-batches of 8 or more are read one by one.
_FIT_CHUNK = 8


@dataclass
class _Eigen:
    """Eigendecompositions of one layer's factors: ``A = U_A diag(d_A) U_A^T``, same for
    ``S``; ``U = None`` for a diagonal factor (its basis is the identity, ``d`` its
    diagonal) or an absent one (``d`` empty).

    ``rows``: which factor is the row side of the layer's gradient (``"S"`` for a linear
    layer, ``"A"`` for an embedding, ``"none"`` for a norm scale's vector). A diagonal row
    factor is filed as ``"A"`` whichever side it is (an LM head's diagonal ``S`` too):
    ``u_a = None``, ``d_a`` the diagonal, ``u_s``/``d_s`` the column factor's.
    """

    u_a: Tensor | None
    d_a: Tensor
    u_s: Tensor | None
    d_s: Tensor
    rows: Literal["S", "A", "none"]

    @classmethod
    def shared(cls, tensors: LayerTensors) -> _Eigen:
        """From the tensors a rank exchange carried (see :meth:`tensors`)."""
        u_a, d_a, u_s, d_s = tensors
        rows: Literal["S", "A", "none"] = (
            "none" if d_a.numel() == 0 else "A" if u_a.numel() == 0 else "S"
        )
        return cls(present(u_a), d_a, present(u_s), d_s, rows)

    def tensors(self) -> LayerTensors:
        """``(U_A, d_A, U_S, d_S)``, an absent basis as an empty tensor."""
        return tuple(ABSENT if t is None else t for t in (self.u_a, self.d_a, self.u_s, self.d_s))

    @property
    def basis(self) -> Basis:
        """The layer's basis ``(B_r, B_c)`` in its gradient's layout."""
        if self.rows == "S":
            assert self.u_a is not None
            return Basis(self.u_s, self.u_a, self.shape)
        assert self.u_s is not None
        return Basis(None, self.u_s, self.shape)

    @property
    def shape(self) -> tuple[int, int]:
        """``(R, C)`` of the layer's gradient."""
        if self.rows == "S":
            return self.d_s.shape[0], self.d_a.shape[0]
        return (1 if self.rows == "none" else self.d_a.shape[0]), self.d_s.shape[0]


def _decomposed(sides: Sides, eigh_col: SharedInput, dtype: torch.dtype) -> _Eigen:
    """The eigendecompositions of one untied layer's factors: computed in fp64, the bases
    kept in ``dtype`` (the gradients' accumulation dtype: every rotation casts them to
    it), the eigenvalues in fp64."""
    d_col, u_col = eigh_col(sides.col)
    d_col, u_col = d_col.clamp_min(0), u_col.to(dtype)
    if sides.row is None:
        return _Eigen(None, ABSENT, u_col, d_col, "none")
    if sides.row.dim() == 1:  # diagonal rows (an embedding's counts, a head's S): identity
        return _Eigen(None, sides.row, u_col, d_col, "A")
    d_row, u_row = torch.linalg.eigh(sides.row)
    return _Eigen(u_col, d_col, u_row.to(dtype), d_row.clamp_min(0), "S")


@register_preconditioner("ekfac")
class EKFACPreconditioner(Preconditioner):
    """Eigenvalue-corrected K-FAC: Kronecker eigenbasis, per-entry corrected eigenvalues.

    After :meth:`fit`: ``eigen`` (untied layer -> its factors' eigendecompositions),
    ``bases`` (layer -> its basis; the uses of a tied weight share one) and
    ``eigenvalues`` (layer -> ``(R, C)`` corrected eigenvalues, fp64).
    """

    needs_curvature = True
    dense_queries = True

    def fit(
        self, store: StoreReader, progress: bool = False, *, ranks: Ranks | None = None
    ) -> None:
        ranks = ranks or Ranks()
        self.fit_for_scoring(store, progress, ranks=ranks)
        part = ranks.part(store, _FIT_CHUNK)
        chunks = [] if part is None else part.iter_chunks(_FIT_CHUNK)
        show = progress and ranks.rank == 0
        bar = tqdm(chunks, desc="EK-FAC eigenvalue correction", disable=not show)
        self._correct(
            (_on(chunk, ranks.device) for chunk in bar), store.layer_names, store, ranks, False
        )

    def fit_for_scoring(
        self, store: StoreReader, progress: bool = False, *, ranks: Ranks | None = None
    ) -> None:
        """The eigendecompositions; the eigenvalues are corrected a layer group at a time
        (:meth:`training_chunks`)."""
        ranks = ranks or Ranks()
        dtype = store.values_dtype()
        eigh_col = SharedInput(torch.linalg.eigh)
        fitted = fit_layers(
            store,
            ranks,
            lambda sides: _decomposed(sides, eigh_col, dtype).tensors(),
            "ekfac-eigh",
            progress,
            "EK-FAC eigendecompositions",
        )
        self.eigen = {n: _Eigen.shared(t) for n, t in fitted.untied().items()}
        self.bases = {n: e.basis for n, e in self.eigen.items()}
        self.tied_units = list(dict.fromkeys(fitted.units.values()))
        for unit in self.tied_units:
            basis = tied_eigenbasis(fitted.tied_uses(unit))
            self.bases.update(dict.fromkeys(unit, _in_dtype(basis, dtype)))
        self._members = {n: fitted.units.get(n, (n,)) for n in store.layer_names}
        self.eigenvalues: dict[str, Tensor] = {}
        self._train_rotation: dict[str, float] = {}
        self._in_eigenbasis: set[str] = set()
        self._kept: set[str] = set()

    def split_groups(self, groups: list[list[str]], store: StoreReader) -> list[list[str]]:
        """Each group cut into consecutive runs of tied units whose rotated training
        gradients, the whole store's, fit :data:`KEPT_BYTES`; a unit over it alone is a
        group of its own (scored from the store)."""
        out: list[list[str]] = []
        for group in groups:
            used = None
            for unit in dict.fromkeys(self._members[n] for n in group):
                size = self._kept_bytes(store, unit)
                if used is None or used + size > KEPT_BYTES:
                    out.append([])
                    used = 0
                out[-1].extend(unit)
                used += size
        return out

    def training_chunks(
        self, source: TrainingChunks, layers: list[str], ranks: Ranks, progress: bool
    ) -> TrainingChunks:
        """Corrects the eigenvalues of ``layers`` in one pass over ``source``. Where their
        rotated training gradients fit :data:`KEPT_BYTES` they are kept from that pass and
        scored as they are (the queries then stay in the basis): the training gradients
        are read and rotated once for both the correction and the scores, and no query is
        rotated back. Otherwise they are scored from ``source`` again."""
        keep = self._kept_bytes(source.store, layers) <= KEPT_BYTES
        show = progress and ranks.rank == 0
        desc = "EK-FAC eigenvalue correction"
        with tqdm(total=source.examples, desc=desc, disable=not show, leave=False) as bar:
            kept = self._correct(
                _counted(source.chunks(layers), bar), layers, source.store, ranks, keep
            )
        return KeptChunks(source.store, source.chunk, source.device, kept) if keep else source

    def _kept_bytes(self, store: StoreReader, layers: Iterable[str]) -> int:
        """Bytes of the whole store's training gradients of ``layers`` rotated into the
        basis and materialized (what scoring keeps from the correction)."""
        width = sum(prod(self.bases[n].shape) for n in layers)
        return store.num_examples * store.values_dtype().itemsize * width

    def _correct(
        self,
        chunks: Iterable[StoreChunk],
        layers: list[str],
        store: StoreReader,
        ranks: Ranks,
        keep: bool,
    ) -> list[StoreChunk]:
        """``Lambda`` of ``layers`` (whole tied units; a tied weight's once, for all its
        uses) from one pass over this rank's ``chunks`` of ``store``, the sums all-reduced.
        ``keep``: returns each chunk's gradients rotated into the basis, materialized."""
        targets = list(dict.fromkeys(self._members[n] for n in layers))
        totals = {
            t: torch.zeros(self.bases[t[0]].shape, dtype=torch.float64, device=ranks.device)
            for t in targets
        }
        rotation = dict.fromkeys(layers, 0.0)
        kept: list[StoreChunk] = []
        for chunk in chunks:
            in_basis: dict[str, PerExampleGrad] = {}
            for target in targets:
                basis = self.bases[target[0]]
                rotated = []
                for name in target:
                    grads = chunk.layers[name]
                    check_shape(grads, basis.shape, name)
                    routes = grads.rotation_costs(*basis.shape, out_form=row_form(basis.row))
                    rotation[name] += min(routes.values())
                    rotated.append(rotated_grads(grads, basis.row, basis.col))
                into = [_values_for(g, basis.shape) for g in rotated] if keep else []
                add_squared_entries_of_sum(rotated, totals[target], into)
                if keep:
                    in_basis.update(
                        (n, DenseGrad(v.flatten(1))) for n, v in zip(target, into, strict=True)
                    )
            if keep:
                kept.append(StoreChunk(chunk.example_ids, chunk.steps, in_basis))
        costs = torch.tensor(list(rotation.values()), dtype=torch.float64, device=ranks.device)
        ranks.sum([*totals.values(), costs])
        self._train_rotation.update(zip(rotation, costs.tolist(), strict=True))
        for target in targets:
            self.eigenvalues.update(dict.fromkeys(target, totals[target] / store.num_examples))
        if keep:
            self._kept.update(layers)
        else:
            self._kept.difference_update(layers)
        return kept

    def __call__(self, layer: str, query: PerExampleGrad) -> PerExampleGrad:
        # (Lambda + l)^-1 applies in the basis. Rotating it back, B_r X B_c^T, costs
        # B2 R C (R + C) (C alone with no row basis); where the training gradients were
        # kept in the basis by the correction, or rotating the stored ones into it costs
        # less (many queries, few training examples), the queries stay there (and
        # train_side rotates each stored training chunk).
        basis, lam = self.bases[layer], self.eigenvalues[layer]
        check_shape(query, basis.shape, layer)
        damping = self.damping * damping_scale(lam.mean())
        scaled = divided(basis.into(query), lam + damping)
        rows, cols = basis.shape
        back = query.batch_size * cols * (row_cost(rows, row_form(basis.row)) + rows * cols)
        members = self._members[layer]
        if layer in self._kept or sum(self._train_rotation[n] for n in members) < back:
            self._in_eigenbasis.update(members)
            return DenseGrad(scaled)
        self._in_eigenbasis.difference_update(members)
        return basis.back(scaled)

    def train_side(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        if layer in self._kept or layer not in self._in_eigenbasis:
            return grads
        basis = self.bases[layer]
        return rotated_grads(grads, basis.row, basis.col)


@dataclass
class KeptChunks:
    """Training chunks kept in memory, their gradients already in the EK-FAC basis."""

    store: StoreReader
    chunk: int
    device: torch.device
    kept: list[StoreChunk]

    @property
    def examples(self) -> int:
        return sum(chunk.size for chunk in self.kept)

    def chunks(self, layers: list[str]) -> Iterator[StoreChunk]:
        for chunk in self.kept:
            yield StoreChunk(chunk.example_ids, chunk.steps, {n: chunk.layers[n] for n in layers})


def _values_for(grads: PerExampleGrad, shape: tuple[int, int]) -> Tensor:
    """An empty ``(B, R, C)`` tensor for ``grads`` materialized, in their accumulation
    dtype and on their device."""
    like = tensors_of(grads)[0]
    return torch.empty(grads.batch_size, *shape, dtype=values_dtype(grads), device=like.device)


def _counted(chunks: Iterable[StoreChunk], bar: tqdm) -> Iterator[StoreChunk]:
    """``chunks``, each counted on ``bar`` (in examples) as it is read."""
    for chunk in chunks:
        yield chunk
        bar.update(chunk.size)


def _on(chunk: StoreChunk, device: torch.device) -> StoreChunk:
    """``chunk`` with its gradients moved to ``device``."""
    chunk.layers = on_device(chunk.layers, device)
    return chunk


def _in_dtype(basis: Basis, dtype: torch.dtype) -> Basis:
    """``basis`` with its matrices in ``dtype`` (every rotation casts them to it)."""
    row = None if basis.row is None else basis.row.to(dtype)
    return Basis(row, basis.col.to(dtype), basis.shape)
