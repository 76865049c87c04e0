"""Random projections of per-example gradients, applied inside the capture hook.

* **Factor projection** (LoGra): random ``P_a`` (``k_a x N_i``) and ``P_g`` (``k_g x N_o``)
  turn ``sum_t g_it a_it^T`` into ``sum_t (P_g g_it)(P_a a_it)^T``, a ``k_g x k_a``
  gradient, without ever forming ``N_o x N_i``. The result is again per-token factors,
  so every operation of :mod:`tda_plugins.grads.ops` applies to it.
* **Dense projection**: a random map ``P`` (``k x D``) on the flattened gradient.

Maps are Gaussian, Rademacher or sparse JL, scaled so that ``E[P^T P] = I`` (inner
products are preserved in expectation), and deterministic from ``(seed, layer name,
side)``: they are drawn on the CPU with a generator seeded from a SHA-256 of that key,
then moved to the layer's device, so the same seed gives the same map bit for bit on
every device and run.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import singledispatch
from typing import Literal

import torch
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.embedding import EmbeddingFactors
from tda_plugins.grads.tokens import TokenFactors

MapKind = Literal["gaussian", "rademacher", "sparse_jl"]

#: Largest dense map (elements) built in memory; beyond it, use sparse JL or factors.
MAX_DENSE_MAP_ELEMENTS = 1 << 28


@dataclass(frozen=True)
class ProjectionConfig:
    """How captured gradients are projected before anything is stored.

    Attributes:
        kind: ``"factor"`` projects the two factors of each linear/embedding layer
            separately (LoGra; a side no wider than its ``k``, such as a LoRA rank, and
            layers captured materialized, such as norm scales, are kept exact);
            ``"dense"`` projects each layer's flattened gradient.
        k_a: rows of ``P_a`` (factor projection of layer inputs).
        k_g: rows of ``P_g`` (factor projection of output gradients).
        k: output dimension of a dense projection, per layer.
        map: ``"gaussian"`` (N(0, 1/k)), ``"rademacher"`` (+-1/sqrt(k)) or ``"sparse_jl"``
            (``nnz`` random +-1/sqrt(nnz) entries per column).
        nnz: non-zeros per column of a sparse JL map.
        seed: base seed; maps are deterministic from ``(seed, layer name)``.
    """

    kind: Literal["factor", "dense"] = "factor"
    k_a: int = 16
    k_g: int = 16
    k: int = 256
    map: MapKind = "gaussian"
    nnz: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("factor", "dense"):
            raise ValueError(
                f"ProjectionConfig.kind must be 'factor' or 'dense', got {self.kind!r}"
            )
        if self.map not in ("gaussian", "rademacher", "sparse_jl"):
            raise ValueError(
                f"ProjectionConfig.map must be 'gaussian', 'rademacher' or 'sparse_jl', "
                f"got {self.map!r}"
            )
        for name in ("k_a", "k_g", "k", "nnz"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProjectionConfig.{name} must be >= 1, got {getattr(self, name)}")


def projected_tie(unit: tuple[str, ...], projection: ProjectionConfig | None) -> str:
    """Why the uses of a weight tied between the layers ``unit`` cannot be scored as one
    under ``projection`` (``""``: unprojected, they can): each layer's maps are its own
    (drawn from its name), so the uses' projected gradients add up to no projection of
    the weight's, and the terms between the uses have no projected form."""
    if projection is None:
        return ""
    return (
        f"the weight tied between {' and '.join(unit)} is projected with other maps at each "
        f"use ({projection.kind}), so the terms between its uses cannot be scored; capture "
        "without projection"
    )


def _seed_for(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


class RandomMap:
    """A random linear map ``x -> P x`` with ``P`` of shape ``(out_dim, in_dim)``."""

    def __init__(self, kind: MapKind, *, in_dim: int, out_dim: int, key: str, nnz: int = 4):
        self.kind, self.in_dim, self.out_dim = kind, in_dim, out_dim
        gen = torch.Generator().manual_seed(_seed_for(key))
        if kind == "sparse_jl":
            nnz = min(nnz, out_dim)
            # Each input coordinate lands on ``nnz`` random output rows with random signs;
            # a repeated row only adds its two signs, so ``E[P^T P] = I`` still holds.
            self._rows = torch.randint(0, out_dim, (in_dim, nnz), generator=gen)
            signs = torch.randint(0, 2, (in_dim, nnz), generator=gen) * 2 - 1
            self._signs = signs.to(torch.float32) / math.sqrt(nnz)
            self._dense: Tensor | None = None
        else:
            if in_dim * out_dim > MAX_DENSE_MAP_ELEMENTS:
                raise ValueError(
                    f"a {kind} map of {out_dim} x {in_dim} is too large to build "
                    f"(> {MAX_DENSE_MAP_ELEMENTS} elements); use map='sparse_jl' or "
                    "kind='factor' projection for this layer"
                )
            if kind == "gaussian":
                p = torch.randn(out_dim, in_dim, generator=gen)
            else:
                p = torch.randint(0, 2, (out_dim, in_dim), generator=gen).to(torch.float32) * 2 - 1
            self._dense = p / math.sqrt(out_dim)
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[Tensor, ...]] = {}

    def _on(self, like: Tensor) -> tuple[Tensor, ...]:
        key = (like.device, like.dtype)
        if key not in self._cache:
            if self._dense is not None:
                self._cache[key] = (self._dense.to(like.device, like.dtype),)
            else:
                self._cache[key] = (
                    self._rows.to(like.device),
                    self._signs.to(like.device, like.dtype),
                )
        return self._cache[key]

    def matrix(self, like: Tensor) -> Tensor:
        """``P`` as a dense ``(out_dim, in_dim)`` tensor on ``like``'s device and dtype."""
        return self.columns(torch.arange(self.in_dim, device=like.device), like).T

    def apply(self, x: Tensor, bias_column: bool = False) -> Tensor:
        """``(..., in_dim [- 1]) -> (..., out_dim)``.

        With ``bias_column`` the input lacks its last coordinate, a constant 1 (the bias
        of a linear layer): its column of ``P`` is added instead of concatenating ones.
        """
        parts = self._on(x)
        width = self.in_dim - int(bias_column)
        if x.shape[-1] != width:
            raise ValueError(f"projection expects inputs of size {width}, got {x.shape[-1]}")
        if len(parts) == 1:
            p = parts[0]
            out = x @ p[:, :width].T
            return out + p[:, width] if bias_column else out
        rows, signs = parts
        out = x.new_zeros(*x.shape[:-1], self.out_dim)
        for j in range(rows.shape[1]):
            out.index_add_(-1, rows[:width, j], x * signs[:width, j])
        if bias_column:
            out.index_add_(-1, rows[width], signs[width].expand(*x.shape[:-1], -1))
        return out

    def columns(self, idx: Tensor, like: Tensor) -> Tensor:
        """``(*idx.shape, out_dim)``: the columns ``P[:, idx]``, for one-hot inputs."""
        parts = self._on(like)
        if len(parts) == 1:
            return parts[0].T[idx]
        rows, signs = parts
        out = like.new_zeros(*idx.shape, self.out_dim)
        out.scatter_add_(-1, rows[idx], signs[idx].expand(*idx.shape, -1))
        return out


class Projector:
    """Applies a :class:`ProjectionConfig` to captured per-example gradients, per layer."""

    def __init__(self, config: ProjectionConfig):
        self.config = config
        self._maps: dict[tuple[str, str, int], RandomMap] = {}

    def map_for(self, layer: str, side: str, in_dim: int, out_dim: int) -> RandomMap:
        """The deterministic map of ``layer``'s ``side`` (``"a"``, ``"g"`` or ``"dense"``)."""
        key = (layer, side, in_dim)
        if key not in self._maps:
            seed_key = f"{self.config.seed}/{layer}/{side}/{in_dim}x{out_dim}"
            self._maps[key] = RandomMap(
                self.config.map, in_dim=in_dim, out_dim=out_dim, key=seed_key, nnz=self.config.nnz
            )
        return self._maps[key]

    def __call__(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        """Project one layer's captured gradients as configured."""
        if self.config.kind == "dense":
            values = grads.materialize()
            dense = self.map_for(layer, "dense", values.shape[1], self.config.k)
            return DenseGrad(dense.apply(values))
        return _factor_project(grads, self, layer)

    def project_vector(self, layer: str, grads: PerExampleGrad, vector: Tensor) -> Tensor:
        """A ``(D,)`` vector in ``grads``' layout (a target gradient) with the maps that
        :meth:`__call__` applies to ``grads`` (factor projection): the result's inner
        product with each projected gradient is the projected inner product."""
        if self.config.kind != "factor":
            raise ValueError("project_vector supports factor projection only")
        return _vector_project(grads, self, layer, vector)


@singledispatch
def _factor_project(grads: PerExampleGrad, projector: Projector, layer: str) -> PerExampleGrad:
    """Per representation: how factor projection applies (registered below)."""
    raise TypeError(f"factor projection does not support {type(grads).__name__}")


@_factor_project.register
def _(grads: TokenFactors, projector: Projector, layer: str) -> PerExampleGrad:
    # A side no wider than its k stays exact: projecting it would only enlarge it (LoRA's
    # rank-r sides), and costs a product for nothing.
    cfg = projector.config
    a, bias = grads.a, grads.bias
    if cfg.k_a < grads.in_dim:
        a = projector.map_for(layer, "a", grads.in_dim, cfg.k_a).apply(a, bias_column=bias)
        bias = False
    g = grads.g
    if cfg.k_g < grads.out_dim:
        g = projector.map_for(layer, "g", grads.out_dim, cfg.k_g).apply(g)
    return TokenFactors(a, g, bias)


@_factor_project.register
def _(grads: EmbeddingFactors, projector: Projector, layer: str) -> PerExampleGrad:
    cfg = projector.config
    p_a = projector.map_for(layer, "a", grads.num_embeddings, cfg.k_a)
    p_g = projector.map_for(layer, "g", grads.g.shape[2], cfg.k_g)
    return TokenFactors(p_a.columns(grads.ids, grads.g), p_g.apply(grads.g))


@_factor_project.register
def _(grads: DenseGrad, projector: Projector, layer: str) -> PerExampleGrad:
    # Materialized layers (norm scales) are small: factor projection keeps them in full.
    return grads


def _side(projector: Projector, layer: str, side: str, dim: int, k: int, like: Tensor) -> Tensor:
    """``P`` of one factor side as a ``(k, dim)`` matrix, or the identity where a side no
    wider than ``k`` stays exact (as :func:`_factor_project` keeps it)."""
    if k >= dim:
        return torch.eye(dim, dtype=like.dtype, device=like.device)
    return projector.map_for(layer, side, dim, k).matrix(like)


@singledispatch
def _vector_project(
    grads: PerExampleGrad, projector: Projector, layer: str, vector: Tensor
) -> Tensor:
    """Per representation: a layer-layout vector under the factor projection."""
    raise TypeError(f"factor projection does not support {type(grads).__name__}")


@_vector_project.register
def _(grads: TokenFactors, projector: Projector, layer: str, vector: Tensor) -> Tensor:
    cfg = projector.config
    p_a = _side(projector, layer, "a", grads.in_dim, cfg.k_a, vector)
    p_g = _side(projector, layer, "g", grads.out_dim, cfg.k_g, vector)
    return (p_g @ vector.view(grads.out_dim, grads.in_dim) @ p_a.T).flatten()


@_vector_project.register
def _(grads: EmbeddingFactors, projector: Projector, layer: str, vector: Tensor) -> Tensor:
    # The projected embedding gradient is sum_t (P_g g_t)(P_a e_{id_t})^T = P_g dW^T P_a^T.
    cfg = projector.config
    p_a = projector.map_for(layer, "a", grads.num_embeddings, cfg.k_a).matrix(vector)
    p_g = projector.map_for(layer, "g", grads.g.shape[2], cfg.k_g).matrix(vector)
    return (p_g @ vector.view(grads.num_embeddings, -1).T @ p_a.T).flatten()


@_vector_project.register
def _(grads: DenseGrad, projector: Projector, layer: str, vector: Tensor) -> Tensor:
    return vector  # kept in full, as _factor_project keeps the gradients
