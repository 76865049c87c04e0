"""Operations on per-example gradients, routed per layer by the cost model.

All results are in the accumulation dtype (fp32, or fp64 for fp64 captures). Each
function takes an optional ``route`` to force a computation path (tests and benchmarks
use it); by default :func:`~tda_plugins.grads.routing.choose_route` picks the cheaper.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad, row_form, values_dtype
from tda_plugins.grads.blocks import (
    TensorKey,
    accumulation_dtype,
    output_blocks,
    row_runs,
    summed,
    tensor_key,
)
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.routing import Route, choose_route
from tda_plugins.grads.tokens import TokenFactors


def cross_gram(train: PerExampleGrad, query: PerExampleGrad, route: Route | None = None) -> Tensor:
    """``(B1, B2)`` matrix of inner products ``<dW_i, dW_j>`` (the "ghost dot").

    Cost: factorized ``~ B1 B2 T1 T2 (N_i + N_o)``; materialized
    ``~ (B1 T1 + B2 T2) N_i N_o + B1 B2 N_i N_o`` (docs/design.md section 3.1).
    """
    chosen = choose_route(train.gram_costs(query), route)
    if chosen is Route.FACTORIZED:
        return train.gram_factorized(query)
    return train.gram_materialized(query)


def sq_norms(grads: PerExampleGrad, route: Route | None = None) -> Tensor:
    """``(B,)`` squared Frobenius norms of the per-example gradients."""
    chosen = choose_route(grads.sq_norm_costs(), route)
    if chosen is Route.FACTORIZED:
        return grads.sq_norms_factorized()
    return grads.sq_norms_materialized()


def layer_sum(parts: list[Tensor]) -> Tensor:
    """Sum of per-layer contributions of one shape (layers may differ in dtype)."""
    dtype = parts[0].dtype
    for p in parts[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    return torch.stack([p.to(dtype) for p in parts]).sum(dim=0)


def example_sq_norms(layers: Mapping[str, PerExampleGrad]) -> Tensor:
    """``(B,)`` squared gradient norms over all layers together."""
    return layer_sum([sq_norms(g) for g in layers.values()])


def safe_norms(sq: Tensor) -> Tensor:
    """Norms from squared norms, zero norms as 1 (so that a cosine against a zero
    gradient is 0, not NaN)."""
    norms = sq.sqrt()
    return torch.where(norms > 0, norms, torch.ones_like(norms))


def example_norms(layers: Mapping[str, PerExampleGrad]) -> Tensor:
    """``(B,)`` gradient norms over all layers together (:func:`safe_norms`)."""
    return safe_norms(example_sq_norms(layers))


@dataclass
class _BiasApart:
    """A layer's materialized queries kept with their bias column apart.

    Training sides that give their own bias apart (:meth:`PerExampleGrad.split_bias`:
    per-token factors) are then scored as the Gram of their weight parts plus one
    ``(B1, N_o) x (N_o, B2)`` product of the bias gradients: no block of their
    materialized gradients is copied beside its bias column.

    Attributes:
        weights: ``(B2, N_o N_i)`` weight gradients of the queries.
        bias: ``(B2, N_o)`` bias gradients of the queries.
    """

    weights: DenseGrad
    bias: Tensor

    @classmethod
    def of(cls, query: PerExampleGrad, out_dim: int) -> _BiasApart:
        """``query`` materialized with its bias apart, for a layer of ``out_dim`` outputs
        (a dense query, as preconditioned, is copied once into the two parts)."""
        split = query.split_bias()
        if split is not None:
            weights, bias = split
            return cls(DenseGrad(weights.materialize()), bias)
        values = query.materialize().view(query.batch_size, out_dim, -1)
        return cls(DenseGrad(values[:, :, :-1].flatten(1)), values[:, :, -1].clone())

    def whole(self) -> DenseGrad:
        """The ``(B2, N_o (N_i + 1))`` gradients with the bias column interleaved."""
        batch, out_dim = self.bias.shape
        weights = self.weights.values.view(batch, out_dim, -1)
        bias = self.bias.to(weights.dtype).unsqueeze(2)
        return DenseGrad(torch.cat([weights, bias], dim=2).flatten(1))

    def gram(self, train_weights: PerExampleGrad, train_bias: Tensor) -> Tensor:
        """``(B1, B2)`` inner products with a training side given apart the same way."""
        out = cross_gram(train_weights, self.weights)
        return out.addmm_(train_bias.to(out.dtype), self.bias.to(out.dtype).T)

    def sq_norms(self) -> Tensor:
        """``(B2,)`` squared norms, bias included."""
        weights = sq_norms(self.weights)
        return weights + self.bias.to(weights.dtype).square().sum(dim=1)


class QueryGradients:
    """Fixed query gradients of several layers, scored against many training batches.

    Each layer's query side is prepared once. The first training batch whose cross-Gram
    the cost model routes through materialized gradients materializes that layer's
    queries, and every later batch reuses them: the same route and the same numbers as
    :func:`cross_gram`, without materializing the ``(B2, D)`` queries again per batch
    (which costs as much as materializing a training batch of the same size). Against
    training factors of a layer with a bias, the materialized queries keep their bias
    column apart (:class:`_BiasApart`; dense queries, as preconditioned, are split once).

    Materialized queries are kept only within ``cache_bytes``; a layer whose queries do
    not fit stays as it is, and each training batch then builds its query blocks again
    (:meth:`TokenFactors.gram_materialized`): the same numbers, a bounded memory, and the
    queries' materialization once per training batch.

    Args:
        layers: layer name -> that layer's ``(B2, ...)`` query gradients.
        cache_bytes: most bytes of materialized queries kept (``None``: no limit; the live
            paths, which score every micro-batch against the same queries).
    """

    def __init__(self, layers: Mapping[str, PerExampleGrad], cache_bytes: int | None = None):
        self._layers: dict[str, PerExampleGrad | _BiasApart] = dict(layers)
        self._sq_norms: Tensor | None = None
        self._cache_left = cache_bytes

    def scores(self, train: Mapping[str, PerExampleGrad]) -> Tensor:
        """``(B1, B2)`` inner products ``<g_i, g_j>`` summed over the layers, for training
        gradients ``train`` of the same layers."""
        if train.keys() != self._layers.keys():
            raise ValueError(
                "training and query gradients were captured on different layers: "
                f"{sorted(set(train) ^ set(self._layers))[:3]} are on one side only"
            )
        return layer_sum([self._gram(name, grads) for name, grads in train.items()])

    def sq_norms(self) -> Tensor:
        """``(B2,)`` squared query norms over all layers, computed once."""
        if self._sq_norms is None:
            self._sq_norms = layer_sum(
                [
                    q.sq_norms() if isinstance(q, _BiasApart) else sq_norms(q)
                    for q in self._layers.values()
                ]
            )
        return self._sq_norms

    def norms(self) -> Tensor:
        """``(B2,)`` query norms over all layers (as :func:`example_norms`)."""
        return safe_norms(self.sq_norms())

    def _gram(self, name: str, train: PerExampleGrad) -> Tensor:
        query = self._layers[name]
        if isinstance(query, _BiasApart):
            apart = train.split_bias()
            if apart is not None:
                return query.gram(*apart)
            # a training side held whole (a dense chunk of a mixed store)
            query = self._layers[name] = query.whole()
        if choose_route(train.gram_costs(query)) is not Route.MATERIALIZED:
            return cross_gram(train, query)
        dense = isinstance(query, DenseGrad)
        # a dense query is only ever split, in place of itself: nothing more is kept
        if not dense and not self._reserve(
            query.batch_size * query.dim * values_dtype(query).itemsize
        ):
            return cross_gram(train, query)
        apart = train.split_bias()
        if apart is not None:
            prepared = self._layers[name] = _BiasApart.of(query, apart[1].shape[1])
            return prepared.gram(*apart)
        if not dense:
            query = self._layers[name] = DenseGrad(query.materialize())
        return cross_gram(train, query)

    def _reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` of the cache budget if they fit."""
        if self._cache_left is None:
            return True
        if nbytes > self._cache_left:
            return False
        self._cache_left -= nbytes
        return True


def per_token_scores(
    train: PerExampleGrad, query: PerExampleGrad, route: Route | None = None
) -> Tensor:
    """``(B1, B2, T1)`` score of each train token's contribution against each query.

    Summed over the token axis this equals :func:`cross_gram`.
    """
    chosen = choose_route(train.token_score_costs(query), route)
    if chosen is Route.FACTORIZED:
        return train.token_scores_factorized(query)
    return train.token_scores_materialized(query)


def rotated_grads(
    grads: PerExampleGrad, u_out: Tensor | None, u_in: Tensor, route: Route | None = None
) -> PerExampleGrad:
    """Per-example gradients ``U_out^T dW_i U_in`` for ``(N_o, N_o)`` ``u_out`` and
    ``(N_i', N_i')`` ``u_in``: Kronecker eigenbases (EK-FAC), or K-FAC's symmetric damped
    inverses. ``u_out`` may also be an ``(N_o,)`` diagonal or ``None`` (the identity), as
    for a vocabulary-wide row side (:func:`~tda_plugins.grads.base.rotate_rows`). Where
    the factorized route is cheaper they stay per-token factors (each token's
    ``(U_out^T g_it, U_in^T [a_it; 1])``, nothing materialized), else dense. In the
    accumulation dtype (the matrices are cast to it: a rotation keeps norms, so fp32 loses
    nothing an fp32 gradient had; a damped inverse scales the fp32 rounding by at most its
    condition number).

    Cost (with one materialization, a dense ``u_out``): factorized
    ``~ B T (N_o^2 + N_i^2 + N_o N_i)``; materialized ``~ B T N_o N_i + B N_o N_i (N_o + N_i)``.
    """
    in_dim = u_in.shape[0]
    costs = grads.rotation_costs(grads.dim // in_dim, in_dim, out_form=row_form(u_out))
    chosen = choose_route(costs, route)
    if chosen is Route.FACTORIZED:
        return grads.rotated_factorized(u_out, u_in)
    return DenseGrad(grads.rotated_materialized(u_out, u_in))


def rotated(
    grads: PerExampleGrad, u_out: Tensor | None, u_in: Tensor, route: Route | None = None
) -> Tensor:
    """``(B, N_o N_i')`` materialized :func:`rotated_grads`."""
    return rotated_grads(grads, u_out, u_in, route).materialize()


def add_squared_entries_of_sum(
    parts: Sequence[PerExampleGrad], total: Tensor, into: Sequence[Tensor] = ()
) -> Tensor:
    """``total += sum_i (sum_u dW_i^u) * (sum_u dW_i^u)`` entrywise, for the per-example
    gradients of several uses ``u`` of one parameter (a tied weight's, all in one
    ``(N_o, N_i)`` layout, ``total``'s); returns ``total``.

    The uses' gradients add before they are squared, so they are built a block of output
    rows at a time (:meth:`~tda_plugins.grads.base.PerExampleGrad.row_blocks`), added,
    squared and summed over the examples: nothing of size ``B N_o N_i`` is held. One use
    alone is :meth:`~tda_plugins.grads.base.PerExampleGrad.add_squared_entries`.

    ``into``: one ``(B, N_o, N_i)`` tensor per use, in the accumulation dtype, that each
    use's blocks are also written to as they are built (its materialized gradients, for
    the cost of a copy of each block while it is in cache).
    """
    if len(parts) == 1 and not into:
        return parts[0].add_squared_entries(total)
    n_o, width = total.shape
    dtype = values_dtype(parts[0])
    batch = parts[0].batch_size
    blocks = [p.row_blocks(width, dtype) for p in parts]
    for rows in output_blocks(n_o, len(parts) * batch * width * dtype.itemsize, total):
        if into:
            for out, part in zip(into, blocks, strict=True):
                out[:, rows] = part(rows).view(batch, -1, width)
            uses = [out[:, rows] for out in into]
            if len(uses) > 1:  # the sum adds into the first: not into a kept tensor
                uses[0] = uses[0].clone()
        else:
            # a fresh first block: a factor side writes each of its blocks into one buffer
            uses = [blocks[0](rows).clone(), *(b(rows) for b in blocks[1:])]
        total[rows] += summed(uses).view(batch, -1, width).square().sum(dim=0)
    return total


Group = list[tuple[str, TokenFactors]]


def _ghost_dots(
    pairs: Mapping[str, tuple[PerExampleGrad, PerExampleGrad]],
) -> dict[str, Tensor]:
    """Per layer ``name -> (grads, factors)``, the ``(B,)`` ghost dots of the examples with
    the summed gradient of ``factors``. Bias-free layers whose training factors share one
    input and whose target factors share one input too (q/k/v, gate/up) take their input
    Gram once (:meth:`TokenFactors.shared_input_dots`)."""
    groups: dict[tuple[TensorKey, TensorKey], list[str]] = {}
    out = {}
    for name, (g, f) in pairs.items():
        if isinstance(g, TokenFactors) and isinstance(f, TokenFactors) and not g.bias:
            groups.setdefault((tensor_key(g.a), tensor_key(f.a)), []).append(name)
        else:
            out[name] = g.gram_factorized(f).sum(dim=1)
    for names in groups.values():
        grads = [cast(TokenFactors, pairs[n][0]) for n in names]
        targets = [cast(TokenFactors, pairs[n][1]) for n in names]
        out.update(zip(names, TokenFactors.shared_input_dots(grads, targets), strict=True))
    return out


def _input_groups(grads: Mapping[str, PerExampleGrad]) -> tuple[list[Group], list[str]]:
    """Layers whose factors share one input tensor and have the narrower output side
    (``N_o < N_i``; LoRA ``A`` adapters of q/k/v, gate/up), as groups of two or more, and
    the other layers. Only bias-free :class:`TokenFactors` group."""
    groups: dict[TensorKey, Group] = {}
    rest = []
    for name, g in grads.items():
        if isinstance(g, TokenFactors) and not g.bias and g.out_dim < g.in_dim:
            groups.setdefault(tensor_key(g.a), []).append((name, g))
        else:
            rest.append(name)
    shared = [group for group in groups.values() if len(group) > 1]
    rest += [group[0][0] for group in groups.values() if len(group) == 1]
    return shared, rest


def dots_with(
    grads: Mapping[str, PerExampleGrad],
    vectors: Mapping[str, Tensor],
    factors: Mapping[str, PerExampleGrad] | None = None,
    route: Route | None = None,
) -> dict[str, Tensor]:
    """Per layer, ``(B,)`` inner products ``<dW_i, v>`` with the layer's ``(D,)`` vector.

    ``factors`` may give a layer's ``v`` also as per-token factors (``v`` = the sum of
    their per-example gradients, e.g. a selection target's tokens). Then the cost model
    picks, per layer, the ghost dot against them (factorized: ``B T B2 T2 (N_i + N_o)``)
    or the product with ``v`` (materialized: ``B T N_i N_o``); ``route`` forces one where
    both exist. Layers that share an input (and have the narrower output side) take the
    product with ``v`` together, ``a [V_1; V_2; ...]^T``, instead of one narrow product
    each."""
    factors = factors or {}
    ghost = _ghost_dots(
        {
            name: (grads[name], f)
            for name, f in factors.items()
            if choose_route(grads[name].dot_costs(f), route) is Route.FACTORIZED
        }
    )
    direct = {name: g for name, g in grads.items() if name not in ghost}
    shared, rest = _input_groups(direct)
    out = {name: grads[name].dot(vectors[name]) for name in rest}
    for group in shared:
        a = group[0][1].a
        a = a.to(accumulation_dtype(a))
        stacked = torch.cat([vectors[n].to(a.dtype).view(f.out_dim, -1) for n, f in group])
        parts = (a @ stacked.T).split([f.out_dim for _, f in group], dim=-1)
        for (name, f), h in zip(group, parts, strict=True):
            out[name] = (h * f.g.to(accumulation_dtype(f.g))).sum(dim=(1, 2))
    out.update(ghost)
    return {name: out[name] for name in grads}


def rows_sums(grads: Mapping[str, PerExampleGrad], rows: Tensor) -> dict[str, Tensor]:
    """Per layer, ``(D,)`` sum of the per-example gradients of examples ``rows``."""
    runs = row_runs(rows)  # one host read of the rows for every layer
    return {name: g.runs_sum(runs) for name, g in grads.items()}
