"""K-FAC and EK-FAC preconditioners from the store's inline Kronecker statistics.

K-FAC, per layer with ``A = E[a a^T]``, ``S = E[g g^T]``:

    G_q -> (S + l_S I)^{-1} G_q (A + l_A I)^{-1},   l_X = damping * mean eig(X)

with ``mean eig(X) = trace(X) / n``, so K-FAC needs no eigendecomposition: each damped
factor is inverted through its Cholesky factorization.

EK-FAC, with eigenbases ``U_A``, ``U_S`` and corrected eigenvalues
``Lambda = E_n[(U_S^T dW_n U_A)^2]`` over the stored examples (one pass over the store):

    G_q -> U_S [(U_S^T G_q U_A) / (Lambda + l)] U_A^T,      l = damping * mean(Lambda)

(or, where that is cheaper, the queries stay in the eigenbasis and the training gradients
are rotated into it, ``U_S^T dW U_A``: the same dot products).

Factorizations (Cholesky, eigendecompositions) are computed in fp64, and so are the
correction's sums across micro-batches and the division by ``Lambda + l`` (each entry's
square and its sum over one micro-batch's examples are in the gradients' accumulation
dtype, built a block of rows at a time while in cache). The rotations
themselves (:func:`~tda_plugins.grads.ops.rotated`: of the per-token factors where that is
cheaper, ``U_S^T g_t`` and ``U_A^T a_t``) run in the gradients' accumulation dtype: a
rotation keeps norms, so fp32 adds only fp32 rounding to what fp32 gradients carry. K-FAC's
products with the damped inverses take the same route and dtype (the damping bounds their
condition number by ``1 + n / damping``); on the factorized route the preconditioned
queries stay per-token factors, so that scoring can build them block by block instead of
holding ``(M, D)`` dense queries. So the bases and inverses are kept in that dtype once
computed (``StoreReader.values_dtype``), and each layer's statistics are freed once
factorized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.ops import rotated, rotated_grads
from tda_plugins.precondition.base import Preconditioner, register_preconditioner
from tda_plugins.precondition.plan import NOT_FACTORED
from tda_plugins.precondition.snapshots import KroneckerFactors, StatisticsSet, read_set
from tda_plugins.ranks import Ranks, on_device
from tda_plugins.store.layout import StoreError
from tda_plugins.store.reader import StoreReader

#: Examples read at a time in the EK-FAC fit: a chunk is held in memory whole, and the fit
#: gains nothing from larger ones, so stored micro-batches of 8 or more are read one by one.
_FIT_CHUNK = 8


@dataclass
class _Eigen:
    """Eigendecompositions of one layer's factors: ``A = U_A diag(d_A) U_A^T``, same for S."""

    u_a: Tensor
    d_a: Tensor
    u_s: Tensor
    d_s: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(N_o, N_i')`` of the layer's gradient."""
        return self.u_s.shape[0], self.u_a.shape[0]


def _statistics_set(store: StoreReader) -> StatisticsSet:
    """The store's K-FAC statistics, refusing a captured layer that has none: with the
    capture's reason when it left the layer out (the vocabulary-wide head), else because
    only linear/LoRA layers have Kronecker factors."""
    found = read_set(store.root)
    present = set(found.layer_names())
    missing = [n for n in store.layer_names if n not in present]
    left_out = {n: why for n, why in found.excluded.items() if n in missing and why != NOT_FACTORED}
    if left_out:
        name, why = next(iter(left_out.items()))
        raise StoreError(
            f"no K-FAC statistics for {name!r} ({why}); K-FAC, EK-FAC and LoGra need every "
            f"stored layer's: recapture with curvature_head=True, or without that layer "
            f"(exclude={name!r}), or score this store with graddot/gradcos/tracin"
        )
    if missing:
        raise StoreError(
            f"no K-FAC statistics for {missing[:3]}{'...' if len(missing) > 3 else ''}: K-FAC "
            "factors exist only for linear/LoRA layers; capture without embedding and norm "
            "layers (LayerSelection kind='linear' or 'lora') to use K-FAC, EK-FAC or LoGra"
        )
    return found


class _SharedInput:
    """Memoizes the factorization of input factors ``A`` across consecutive layers fed by
    one input (q/k/v, gate/up: captured in model order, so adjacent), which have equal
    ``A``. Only the last factor is kept, so that the statistics of the layers already
    factorized can be freed; output factors ``S`` differ from layer to layer."""

    def __init__(self, factorize: Callable[[Tensor], Any]):
        self.factorize = factorize
        self.last: tuple[Tensor, Any] | None = None

    def __call__(self, x: Tensor) -> Any:
        if self.last is not None and self.last[0].shape == x.shape and torch.equal(self.last[0], x):
            return self.last[1]
        result = self.factorize(x)
        self.last = (x, result)
        return result


def _owned_statistics(store: StoreReader, ranks: Ranks) -> Iterator[tuple[str, KroneckerFactors]]:
    """``(name, statistics)`` of every captured layer this rank factorizes (all of them in
    one process), in store order, each read from disk when reached and released once the
    iterator moves past it (one layer's fp64 factors in memory at a time, beside the
    factorizations kept)."""
    found = _statistics_set(store)
    names = store.layer_names
    for index, name in enumerate(names):
        if ranks.owns(index, len(names)):
            yield name, found.load([name])[name]


def _eigen(store: StoreReader, ranks: Ranks) -> dict[str, _Eigen]:
    """Eigendecompositions in fp64, the bases kept in the store's accumulation dtype (every
    rotation casts them to it); each layer's computed by its owner rank, on every rank."""
    eigh_a = _SharedInput(torch.linalg.eigh)
    dtype = store.values_dtype()
    out = {}
    for name, stats in _owned_statistics(store, ranks):
        d_a, u_a = eigh_a(stats.a_cov.double())
        d_s, u_s = torch.linalg.eigh(stats.g_cov.double())
        out[name] = (u_a.to(dtype), d_a.clamp_min(0), u_s.to(dtype), d_s.clamp_min(0))
    return {name: _Eigen(*e) for name, e in ranks.share(out, store.layer_names).items()}


def _check_shape(grads: PerExampleGrad, shape: tuple[int, int], layer: str) -> None:
    if grads.dim != shape[0] * shape[1]:
        raise StoreError(
            f"gradients of {layer} have {grads.dim} entries but the store's "
            f"K-FAC factors describe {shape[0]} x {shape[1]}; capture both with one config"
        )


@register_preconditioner("kfac")
class KFACPreconditioner(Preconditioner):
    """Kronecker-factored damped inverse, each factor damped separately."""

    needs_curvature = True

    def fit(
        self, store: StoreReader, progress: bool = False, *, ranks: Ranks | None = None
    ) -> None:
        ranks = ranks or Ranks()
        inverses = {}
        # factorized in fp64, kept in the store's accumulation dtype (every product casts
        # them to it), so that fp32 gradients need no fp64 copy of every inverse
        dtype = store.values_dtype()
        inverse_a = _SharedInput(lambda a: self._damped_inverse(a).to(dtype))
        for name, stats in _owned_statistics(store, ranks):
            s_inv = self._damped_inverse(stats.g_cov.double()).to(dtype)
            inverses[name] = (s_inv, inverse_a(stats.a_cov.double()))
        shared = ranks.share(inverses, store.layer_names)  # each layer's from its owner
        self.inverses: dict[str, tuple[Tensor, Tensor]] = {
            name: (s_inv, a_inv) for name, (s_inv, a_inv) in shared.items()
        }

    def _damped_inverse(self, x: Tensor) -> Tensor:
        """``(X + l I)^{-1}`` for a ``(n, n)`` fp64 factor, ``l = damping * trace(X) / n``.

        Through the Cholesky factor of the damped matrix (``~n^3 / 3`` against ``~9 n^3``
        for ``eigh``). The inverse is formed once rather than solving per query: a product
        with it is faster than two triangular solves, and the damping bounds the condition
        number by ``1 + n / damping``, well inside fp64.
        """
        n = x.shape[0]
        mean_eig = (x.trace() / n).clamp_min(torch.finfo(x.dtype).tiny)
        damped = x + self.damping * mean_eig * torch.eye(n, dtype=x.dtype, device=x.device)
        return torch.cholesky_inverse(torch.linalg.cholesky(damped))

    def __call__(self, layer: str, query: PerExampleGrad) -> PerExampleGrad:
        # s_inv G_q a_inv = s_inv^T G_q a_inv (both symmetric): the product of a rotation,
        # routed, in the gradients' accumulation dtype; per-token factors (s_inv g_t,
        # a_inv [a_t; 1]) where those are fewer, so that many queries need not be dense
        s_inv, a_inv = self.inverses[layer]
        _check_shape(query, (s_inv.shape[0], a_inv.shape[0]), layer)
        return rotated_grads(query, s_inv, a_inv)


@register_preconditioner("ekfac")
class EKFACPreconditioner(Preconditioner):
    """Eigenvalue-corrected K-FAC: Kronecker eigenbasis, per-entry corrected eigenvalues."""

    needs_curvature = True
    dense_queries = True

    def fit(
        self, store: StoreReader, progress: bool = False, *, ranks: Ranks | None = None
    ) -> None:
        ranks = ranks or Ranks()
        self.eigen = _eigen(store, ranks)
        totals = {
            n: torch.zeros(e.shape, dtype=torch.float64, device=ranks.device)
            for n, e in self.eigen.items()
        }
        rotation = dict.fromkeys(self.eigen, 0.0)
        self._in_eigenbasis: set[str] = set()
        # each rank corrects over its part of the store; the sums are all-reduced
        part = ranks.part(store, _FIT_CHUNK)
        chunks = [] if part is None else part.iter_chunks(_FIT_CHUNK)
        show = progress and ranks.rank == 0
        for chunk in tqdm(chunks, desc="EK-FAC eigenvalue correction", disable=not show):
            layers = on_device(chunk.layers, ranks.device)
            for name, e in self.eigen.items():
                grads = layers[name]
                _check_shape(grads, e.shape, name)
                rotation[name] += min(grads.rotation_costs(*e.shape).values())
                rotated_grads(grads, e.u_s, e.u_a).add_squared_entries(totals[name])
        costs = torch.tensor(list(rotation.values()), dtype=torch.float64, device=ranks.device)
        ranks.sum([*totals.values(), costs])
        self._train_rotation = dict(zip(rotation, costs.tolist(), strict=True))
        self.eigenvalues = {n: t / store.num_examples for n, t in totals.items()}

    def __call__(self, layer: str, query: PerExampleGrad) -> PerExampleGrad:
        # (Lambda + l)^-1 applies in the eigenbasis. Rotating it back, U_S X U_A^T, costs
        # B2 N_o N_i (N_o + N_i); where rotating the stored training gradients into the
        # eigenbasis instead costs less (many queries, few training examples), the
        # queries stay there and train_side rotates each training chunk.
        e, lam = self.eigen[layer], self.eigenvalues[layer]
        _check_shape(query, e.shape, layer)
        rotation = rotated(query, e.u_s, e.u_a)
        damping = self.damping * lam.mean().clamp_min(torch.finfo(lam.dtype).tiny)
        scaled = (rotation.double().view(-1, *e.shape) / (lam + damping)).to(rotation.dtype)
        n_o, n_i = e.shape
        if self._train_rotation[layer] < query.batch_size * n_o * n_i * (n_o + n_i):
            self._in_eigenbasis.add(layer)
            return DenseGrad(scaled.flatten(1))
        self._in_eigenbasis.discard(layer)
        u_s, u_a = e.u_s.to(rotation.dtype), e.u_a.to(rotation.dtype)
        return DenseGrad((u_s @ scaled @ u_a.T).flatten(1))

    def train_side(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        if layer not in self._in_eigenbasis:
            return grads
        e = self.eigen[layer]
        return rotated_grads(grads, e.u_s, e.u_a)
