"""Projections: exact algebra, determinism from (seed, layer), and the JL inner-product bound."""

from __future__ import annotations

import math

import pytest
import torch

from tda_plugins import LayerSelection, ProjectionConfig
from tda_plugins.capture import CaptureEngine, RecordCollector
from tda_plugins.grads import (
    DenseGrad,
    EmbeddingFactors,
    Projector,
    RandomMap,
    TokenFactors,
    cross_gram,
)
from tests.models import lm_batch, tiny_causal_lm

MAPS = ["gaussian", "rademacher", "sparse_jl"]
gen = torch.Generator().manual_seed(1)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("kind", MAPS)
@pytest.mark.parametrize("bias", [False, True])
def test_factor_projection_is_pg_dw_pat(kind: str, bias: bool) -> None:
    """Projected factors materialize to ``P_g dW P_a^T`` with the layer's own maps."""
    grads = TokenFactors(_randn(3, 5, 10), _randn(3, 5, 8), bias=bias)
    projector = Projector(ProjectionConfig(k_a=4, k_g=3, map=kind))
    projected = projector("layer", grads)
    p_a = projector.map_for("layer", "a", grads.in_dim, 4).matrix(grads.a)
    p_g = projector.map_for("layer", "g", grads.out_dim, 3).matrix(grads.g)
    dw = grads.materialize().view(3, 8, grads.in_dim)
    torch.testing.assert_close(projected.materialize().view(3, 3, 4), p_g @ dw @ p_a.T)


@pytest.mark.parametrize("kind", MAPS)
def test_embedding_factor_projection_is_pg_dw_pat(kind: str) -> None:
    grads = EmbeddingFactors(torch.randint(0, 9, (3, 5), generator=gen), _randn(3, 5, 6), 9)
    projector = Projector(ProjectionConfig(k_a=4, k_g=3, map=kind))
    projected = projector("emb", grads)
    p_a = projector.map_for("emb", "a", 9, 4).matrix(grads.g)
    p_g = projector.map_for("emb", "g", 6, 3).matrix(grads.g)
    dw = grads.materialize().view(3, 9, 6)  # (V, D): rows are ids, so P_a acts on rows
    torch.testing.assert_close(projected.materialize().view(3, 3, 4), p_g @ dw.mT @ p_a.T)


@pytest.mark.parametrize("kind", MAPS)
def test_dense_projection_is_p_vec(kind: str) -> None:
    grads = TokenFactors(_randn(3, 5, 10), _randn(3, 5, 8), bias=True)
    projector = Projector(ProjectionConfig(kind="dense", k=32, map=kind))
    projected = projector("layer", grads)
    p = projector.map_for("layer", "dense", grads.dim, 32).matrix(grads.a)
    torch.testing.assert_close(projected.materialize(), grads.materialize() @ p.T)


@pytest.mark.parametrize("kind", MAPS)
def test_maps_are_deterministic_per_seed_and_layer(kind: str) -> None:
    like = torch.zeros(1)
    first = RandomMap(kind, in_dim=50, out_dim=8, key="0/h.0.mlp/a").matrix(like)
    assert torch.equal(first, RandomMap(kind, in_dim=50, out_dim=8, key="0/h.0.mlp/a").matrix(like))
    assert not torch.equal(
        first, RandomMap(kind, in_dim=50, out_dim=8, key="1/h.0.mlp/a").matrix(like)
    )
    assert not torch.equal(
        first, RandomMap(kind, in_dim=50, out_dim=8, key="0/h.1.mlp/a").matrix(like)
    )


def test_engine_projection_is_bit_identical_across_runs() -> None:
    """Same seed and inputs: same projected gradients, bit for bit, from two fresh engines."""
    batch = lm_batch(lengths=(10, 6, 8))
    config = ProjectionConfig(k_a=4, k_g=4, map="sparse_jl", seed=7)

    def capture() -> dict[str, torch.Tensor]:
        model = tiny_causal_lm("llama", torch.float32)
        collector = RecordCollector()
        with CaptureEngine(
            model, layers=LayerSelection("all"), projection=config, consumers=[collector]
        ):
            model(**batch).loss.backward()
        (record,) = collector.records
        return {n: r.grads.materialize() for n, r in record.layers.items()}

    first, second = capture(), capture()
    assert first.keys() == second.keys() and len(first) > 0
    assert all(torch.equal(first[n], second[n]) for n in first)


def _jl_epsilon(n_vectors: int, k: int, delta: float = 0.01) -> float:
    """JL inner-product bound: with prob. >= 1 - delta, |<Px,Py> - <x,y>| <= eps |x||y|."""
    return math.sqrt(8 * math.log(2 * n_vectors**2 / delta) / k)


@pytest.mark.parametrize("kind", MAPS)
def test_dense_maps_preserve_inner_products_within_jl_bound(kind: str) -> None:
    n, dim, k = 16, 3000, 1024
    x = _randn(n, dim)
    p = RandomMap(kind, in_dim=dim, out_dim=k, key=f"jl/{kind}")
    gram, projected = x @ x.T, p.apply(x) @ p.apply(x).T
    norms = x.norm(dim=1)
    worst = ((projected - gram).abs() / torch.outer(norms, norms)).max().item()
    assert worst <= _jl_epsilon(n, k)


def test_factor_projection_converges_as_k_grows() -> None:
    """Projected Gram errors shrink with k (the LoGra estimator is unbiased)."""
    train = TokenFactors(_randn(6, 4, 64), _randn(6, 4, 48))
    exact = cross_gram(train, train)
    errors = []
    for k in (4, 16, 48):
        proj = Projector(ProjectionConfig(k_a=k, k_g=k, seed=3))("l", train)
        errors.append(((cross_gram(proj, proj) - exact).norm() / exact.norm()).item())
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.5


def test_oversized_dense_map_is_refused_with_a_fix() -> None:
    with pytest.raises(ValueError, match="sparse_jl"):
        RandomMap("gaussian", in_dim=1 << 20, out_dim=1 << 10, key="big")


@pytest.mark.parametrize("field,value", [("kind", "tucker"), ("map", "srht"), ("k_a", 0)])
def test_bad_projection_config_is_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ProjectionConfig(**{field: value})  # type: ignore[arg-type]


def test_factor_sides_no_wider_than_k_stay_exact() -> None:
    """A rank-4 LoRA side (N_i = 4 <= k_a) is not projected: the result is ``P_g dW``."""
    grads = TokenFactors(_randn(3, 5, 4), _randn(3, 5, 8), bias=True)
    projector = Projector(ProjectionConfig(k_a=16, k_g=3))
    projected = projector("lora_B", grads)
    p_g = projector.map_for("lora_B", "g", grads.out_dim, 3).matrix(grads.g)
    dw = grads.materialize().view(3, 8, grads.in_dim)
    torch.testing.assert_close(projected.materialize().view(3, 3, grads.in_dim), p_g @ dw)


@pytest.mark.parametrize("case", ["linear", "linear-bias", "exact-a-side", "embedding", "dense"])
def test_projected_vector_scores_as_the_projected_gradients(case: str) -> None:
    """A target ``V`` under :meth:`Projector.project_vector` is ``P_g V P_a^T`` (embedding:
    ``P_g V^T P_a^T``; dense layers and sides no wider than k: unchanged), so its dot with
    each projected gradient is the projected inner product ``<P_g dW_i P_a^T, P_g V P_a^T>``."""
    projector = Projector(ProjectionConfig(k_a=4, k_g=3))
    v_out, v_in = 8, 10
    if case == "embedding":
        grads = EmbeddingFactors(torch.randint(0, 9, (3, 5), generator=gen), _randn(3, 5, 6), 9)
        vector = _randn(9 * 6)
        p_a = projector.map_for("l", "a", 9, 4).matrix(vector)
        p_g = projector.map_for("l", "g", 6, 3).matrix(vector)
        expected_vector = p_g @ vector.view(9, 6).T @ p_a.T
    elif case == "dense":
        grads = DenseGrad(_randn(3, 11))
        vector = expected_vector = _randn(11)
    else:
        v_in = 3 if case == "exact-a-side" else v_in
        grads = TokenFactors(_randn(3, 5, v_in), _randn(3, 5, v_out), bias=case == "linear-bias")
        vector = _randn(grads.dim)
        p_a = (
            torch.eye(grads.in_dim, dtype=vector.dtype)
            if case == "exact-a-side"
            else projector.map_for("l", "a", grads.in_dim, 4).matrix(vector)
        )
        p_g = projector.map_for("l", "g", v_out, 3).matrix(vector)
        expected_vector = p_g @ vector.view(v_out, grads.in_dim) @ p_a.T
    projected_vector = projector.project_vector("l", grads, vector)
    torch.testing.assert_close(projected_vector, expected_vector.flatten())
    projected = projector("l", grads)
    torch.testing.assert_close(
        projected.dot(projected_vector), projected.materialize() @ expected_vector.flatten()
    )
