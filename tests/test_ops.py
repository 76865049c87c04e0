"""Routed operations equal the materialized reference; routing follows the cost model."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from tda_plugins.grads import (
    DenseGrad,
    EmbeddingFactors,
    PerExampleGrad,
    QueryGradients,
    Route,
    TokenFactors,
    choose_route,
    cross_gram,
    dots_with,
    per_token_scores,
    rotated,
    rows_sums,
    sq_norms,
)
from tda_plugins.grads import blocks as grad_blocks
from tda_plugins.grads.blocks import row_runs
from tests.memory import peak_growth

gen = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _pair(kind: str) -> tuple[PerExampleGrad, PerExampleGrad]:
    """A train (B1=3, T1=5) and query (B2=2, T2=4) capture of the same layer."""
    if kind in ("linear", "linear-bias"):
        bias = kind == "linear-bias"
        return (
            TokenFactors(_randn(3, 5, 6), _randn(3, 5, 4), bias=bias),
            TokenFactors(_randn(2, 4, 6), _randn(2, 4, 4), bias=bias),
        )
    if kind == "embedding":
        ids = lambda b, t: torch.randint(0, 7, (b, t), generator=gen)  # noqa: E731
        return (
            EmbeddingFactors(ids(3, 5), _randn(3, 5, 4), num_embeddings=7),
            EmbeddingFactors(ids(2, 4), _randn(2, 4, 4), num_embeddings=7),
        )
    return DenseGrad(_randn(3, 11)), DenseGrad(_randn(2, 11))


KINDS = ["linear", "linear-bias", "embedding", "dense"]


def _explicit_materialize(x: PerExampleGrad) -> torch.Tensor:
    """Per-example gradients built token by token, independently of the library's kernels."""
    if isinstance(x, TokenFactors):
        rows = []
        for b in range(x.batch_size):
            a = x.a[b]
            if x.bias:
                a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1)
            rows.append(sum(torch.outer(x.g[b, t], a[t]) for t in range(a.shape[0])).flatten())
        return torch.stack(rows)
    if isinstance(x, EmbeddingFactors):
        out = torch.zeros(x.batch_size, x.num_embeddings, x.g.shape[2], dtype=x.g.dtype)
        for b in range(x.batch_size):
            for t in range(x.tokens):
                out[b, x.ids[b, t]] += x.g[b, t]
        return out.flatten(1)
    return x.values


@pytest.mark.parametrize("kind", KINDS)
def test_materialize_matches_explicit_sum(kind: str) -> None:
    train, _ = _pair(kind)
    torch.testing.assert_close(train.materialize(), _explicit_materialize(train))


@pytest.mark.parametrize("kind", KINDS)
def test_every_gram_route_equals_materialized_dot(kind: str) -> None:
    """The ghost dot (factorized) and the materialized route give the same Gram."""
    train, query = _pair(kind)
    reference = _explicit_materialize(train) @ _explicit_materialize(query).T
    routes = train.gram_costs(query)
    if kind != "dense":
        assert Route.FACTORIZED in routes
    for route in routes:
        torch.testing.assert_close(cross_gram(train, query, route=route), reference)


@contextmanager
def _blocks_of_32_rows() -> Iterator[None]:
    """Blocked products take 32 output rows at a time, whatever a row's bytes."""
    with (
        mock.patch("tda_plugins.grads.blocks.CPU_BLOCK_BYTES", 1),
        mock.patch("tda_plugins.grads.blocks.MIN_BLOCK_ROWS", 32),
    ):
        yield


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("query_kind", ["dense-fp32", "factors"])
def test_blocked_materialized_gram_spans_every_output_row(bias: bool, query_kind: str) -> None:
    """The materialized Gram builds both sides a block of output rows at a time; with
    blocks of 32 rows over 70 (the last one partial), against fp32 dense queries or
    per-token query factors, it still equals the product of the explicit gradients."""
    train = TokenFactors(_randn(3, 5, 6), _randn(3, 5, 70), bias=bias)
    query: PerExampleGrad = (
        DenseGrad(_randn(2, train.dim).float())
        if query_kind == "dense-fp32"
        else TokenFactors(_randn(2, 4, 6), _randn(2, 4, 70), bias=bias)
    )
    reference = _explicit_materialize(train) @ _explicit_materialize(query).double().T
    with _blocks_of_32_rows():
        scores = cross_gram(train, query, route=Route.MATERIALIZED)
    assert scores.dtype == torch.float64
    torch.testing.assert_close(scores, reference)


@pytest.mark.parametrize("kind", ["factors", "factors-bias", "dense"])
def test_squared_entries_add_every_examples_square_in_blocks_of_rows(kind: str) -> None:
    """EK-FAC's correction sum ``total += sum_i dW_i * dW_i``, built 32 output rows at a
    time over 70 (the last block partial), equals the squares of the explicit gradients,
    adds to what ``total`` held, and leaves a dense side's own values unsquared."""
    # N_i = 6 in every case: 6 inputs, or 5 and the bias column
    grads: PerExampleGrad = {
        "factors": TokenFactors(_randn(3, 5, 6), _randn(3, 5, 70)),
        "factors-bias": TokenFactors(_randn(3, 5, 5), _randn(3, 5, 70), bias=True),
        "dense": DenseGrad(_randn(3, 70 * 6)),
    }[kind]
    explicit = _explicit_materialize(grads).clone()
    start = _randn(70, 6)
    with _blocks_of_32_rows():
        total = grads.add_squared_entries(start.clone())
    torch.testing.assert_close(total, start + explicit.square().sum(0).view(70, 6))
    torch.testing.assert_close(_explicit_materialize(grads), explicit)


@pytest.mark.parametrize("row_bytes", [1 << 10, 100 << 10, 1 << 20, 4 << 20])
def test_output_blocks_take_at_least_the_minimum_rows_unless_past_the_byte_cap(
    row_bytes: int,
) -> None:
    """Blocks of output rows cover every row once. They hold a cache's worth of rows,
    and at least ``MIN_BLOCK_ROWS``, as long as that stays within ``MAX_BLOCK_BYTES``;
    wider rows take fewer, down to ``FEWEST_BLOCK_ROWS``."""
    out_dim = 5000
    blocks = grad_blocks.output_blocks(out_dim, row_bytes, torch.empty(0))
    assert [b.start for b in blocks] == [0, *[b.stop for b in blocks[:-1]]]
    assert blocks[-1].stop == out_dim
    rows = blocks[0].stop
    assert rows >= min(grad_blocks.CPU_BLOCK_BYTES // row_bytes, out_dim)
    if grad_blocks.MIN_BLOCK_ROWS * row_bytes <= grad_blocks.MAX_BLOCK_BYTES:
        assert rows >= grad_blocks.MIN_BLOCK_ROWS
    else:
        fewest = grad_blocks.FEWEST_BLOCK_ROWS
        assert rows * row_bytes <= grad_blocks.MAX_BLOCK_BYTES or rows == fewest
        assert rows >= grad_blocks.FEWEST_BLOCK_ROWS
        assert (rows + 1) * row_bytes > grad_blocks.MAX_BLOCK_BYTES  # as many as fit


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads peak memory from /proc")
def test_a_blocked_gram_of_wide_factors_holds_capped_blocks_and_no_input_copy() -> None:
    """The cross-Gram of two 64-example captures of a 1536-input layer with a bias (50 MB
    of inputs a side), with blocks capped at 16 MB, raises the peak memory by less than
    the two ``(B, T, N_i + 1)`` input copies with the bias column appended would take
    (100 MB): it builds its blocks from the inputs as they are. (With those copies and
    128-row blocks it rose by 198 MB; the blocks, their temporaries and the allocator's
    slack measure 40-70 MB.)"""
    setup = """
        import torch
        import tda_plugins.grads.blocks as blocks
        from tda_plugins.grads.tokens import TokenFactors
        blocks.MAX_BLOCK_BYTES = 16 << 20
        g = torch.Generator().manual_seed(0)
        def side():
            a, g_ = torch.randn(64, 128, 1536, generator=g), torch.randn(64, 128, 384, generator=g)
            return TokenFactors(a, g_, bias=True)
        train, query = side(), side()
    """
    inputs = 2 * 64 * 128 * 1536 * 4
    growth = peak_growth(setup, "out = train.gram_materialized(query)")
    assert 16 << 20 < growth < inputs, growth


def test_factor_row_blocks_refuse_another_row_width() -> None:
    """Blocks of output rows only line up between two sides of one layer shape: factors
    asked for rows of another width say so instead of slicing the wrong entries."""
    factors = TokenFactors(_randn(2, 3, 6), _randn(2, 3, 4), bias=True)
    assert factors.row_blocks(7, torch.float64)(slice(0, 4)).shape == (2, 4 * 7)
    with pytest.raises(ValueError, match="same layer shape"):
        factors.row_blocks(6, torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_every_norm_route_equals_materialized_norm(kind: str) -> None:
    train, _ = _pair(kind)
    reference = _explicit_materialize(train).pow(2).sum(dim=1)
    for route in train.sq_norm_costs():
        torch.testing.assert_close(sq_norms(train, route=route), reference)


@pytest.mark.parametrize("kind", ["linear", "linear-bias", "embedding"])
def test_token_scores_sum_to_gram_on_every_route(kind: str) -> None:
    """Per-token scores ``(B1, B2, T1)`` sum over tokens to the sequence-level Gram."""
    train, query = _pair(kind)
    gram = _explicit_materialize(train) @ _explicit_materialize(query).T
    for route in (Route.FACTORIZED, Route.MATERIALIZED):
        scores = per_token_scores(train, query, route=route)
        assert scores.shape == (3, 2, 5)
        torch.testing.assert_close(scores.sum(dim=2), gram)


def _orthogonal(n: int) -> torch.Tensor:
    return torch.linalg.qr(_randn(n, n))[0]


@pytest.mark.parametrize("kind", KINDS)
def test_every_rotation_route_equals_the_rotated_explicit_gradients(kind: str) -> None:
    """``U_out^T dW_i U_in``: rotating the per-token factors and rotating the materialized
    gradient both equal the rotation of the explicit gradients."""
    train, _ = _pair(kind)
    out_dim, in_dim = {"linear": (4, 6), "linear-bias": (4, 7), "embedding": (7, 4)}.get(
        kind, (1, 11)
    )
    u_out, u_in = _orthogonal(out_dim), _orthogonal(in_dim)
    dw = _explicit_materialize(train).view(-1, out_dim, in_dim)
    reference = (u_out.T @ dw @ u_in).flatten(1)
    routes = train.rotation_costs(out_dim, in_dim)
    assert (Route.FACTORIZED in routes) == kind.startswith("linear")
    for route in routes:
        torch.testing.assert_close(rotated(train, u_out, u_in, route=route), reference)


def test_rotation_routing_rotates_factors_only_for_short_sequences() -> None:
    """The factor rotation costs ``T (N_o^2 + N_i^2)`` per example against the dense
    rotation's ``N_o N_i (N_o + N_i)``: it wins for ``T`` below about ``N``, not above."""
    chosen = [
        choose_route(
            TokenFactors(torch.zeros(2, t, 48), torch.zeros(2, t, 40)).rotation_costs(40, 48)
        )
        for t in (8, 512)
    ]
    assert chosen == [Route.FACTORIZED, Route.MATERIALIZED]


def test_token_scores_refused_for_dense() -> None:
    train, query = _pair("dense")
    with pytest.raises(TypeError, match="per-token scores need a per-token representation"):
        per_token_scores(train, query)


def test_mismatched_captures_are_refused() -> None:
    train, _ = _pair("linear")
    _, other = _pair("linear-bias")
    with pytest.raises(ValueError, match="same layers and projection"):
        cross_gram(train, other)


def _design_costs(b1: int, b2: int, t: int, n_i: int, n_o: int) -> dict[Route, float]:
    """docs/design.md section 3.1, written out independently of the library."""
    return {
        Route.FACTORIZED: b1 * b2 * t * t * (n_i + n_o),
        Route.MATERIALIZED: (b1 + b2) * t * n_i * n_o + b1 * b2 * n_i * n_o,
    }


@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_gram_routing_follows_the_design_cost_model(tokens: int) -> None:
    """The chosen route is the argmin of the formulas of docs/design.md section 3.1, on both
    sides of the crossover."""
    b, n_i, n_o = 4, 48, 40
    train = TokenFactors(torch.zeros(b, tokens, n_i), torch.zeros(b, tokens, n_o))
    query = TokenFactors(torch.zeros(b, tokens, n_i), torch.zeros(b, tokens, n_o))
    costs = _design_costs(b, b, tokens, n_i, n_o)
    expected = min(costs, key=costs.__getitem__)
    assert choose_route(train.gram_costs(query)) is expected


def test_routing_takes_both_routes_across_the_sweep() -> None:
    """Guards the sweep above: the crossover lies inside it."""
    chosen = set()
    for tokens in (1, 256):
        x = TokenFactors(torch.zeros(4, tokens, 48), torch.zeros(4, tokens, 40))
        chosen.add(choose_route(x.gram_costs(x)))
    assert chosen == {Route.FACTORIZED, Route.MATERIALIZED}


def test_forcing_an_unavailable_route_is_an_error() -> None:
    train, query = _pair("dense")
    with pytest.raises(ValueError, match="not available"):
        cross_gram(train, query, route=Route.FACTORIZED)


@pytest.mark.parametrize("kind", KINDS)
def test_weighted_sum_equals_weighted_materialized_rows(kind: str) -> None:
    """``sum_i w_i dW_i`` from the factors equals the weighted sum of explicit gradients."""
    train, _ = _pair(kind)
    weights = torch.tensor([0.5, 0.0, -2.0], dtype=torch.float64)
    torch.testing.assert_close(train.weighted_sum(weights), weights @ _explicit_materialize(train))


@pytest.mark.parametrize("kind", [*KINDS, "wide-out", "wide-out-bias"])
def test_dot_with_a_vector_equals_materialized_rows(kind: str) -> None:
    """``<dW_i, v>`` from the factors (no ``(B, D)`` tensor) equals the explicit rows' dot,
    on both product orders (``N_o < N_i`` and ``N_o >= N_i``), with and without bias."""
    if kind.startswith("wide-out"):
        train: PerExampleGrad = TokenFactors(
            _randn(3, 5, 4), _randn(3, 5, 9), bias=kind.endswith("bias")
        )
    else:
        train, _ = _pair(kind)
    vector = _randn(train.dim)
    torch.testing.assert_close(train.dot(vector), _explicit_materialize(train) @ vector)


def test_layers_sharing_an_input_are_scored_and_summed_as_each_alone() -> None:
    """``dots_with`` batches layers that share one input tensor (q/k/v); its dots, and
    ``rows_sums``' sums, equal each layer's explicit rows, grouped layers or not."""
    x = _randn(3, 5, 6)
    grads: dict[str, PerExampleGrad] = {
        "q": TokenFactors(x, _randn(3, 5, 2)),
        "k": TokenFactors(x, _randn(3, 5, 4)),
        "v": TokenFactors(x, _randn(3, 5, 9)),  # wider output: summed with q/k, dotted alone
        "o": TokenFactors(_randn(3, 5, 6), _randn(3, 5, 2)),
        "emb": _pair("embedding")[0],
    }
    vectors = {name: _randn(g.dim) for name, g in grads.items()}
    rows = torch.tensor([0, 2])
    dots, sums = dots_with(grads, vectors), rows_sums(grads, rows)
    for name, g in grads.items():
        explicit = _explicit_materialize(g)
        torch.testing.assert_close(dots[name], explicit @ vectors[name])
        torch.testing.assert_close(sums[name], explicit[rows].sum(0))


@pytest.mark.parametrize("route", [None, Route.FACTORIZED, Route.MATERIALIZED])
def test_dots_with_a_vector_known_as_factors_take_either_route(route: Route | None) -> None:
    """Where a vector is also given as factors whose per-example sum it is, ``dots_with``
    scores against the factors (ghost dot) or the vector; both equal the explicit rows,
    shared-input layers included, and a layer without factors keeps the vector."""
    x = _randn(3, 5, 6)
    grads: dict[str, PerExampleGrad] = {
        "q": TokenFactors(x, _randn(3, 5, 2)),
        "k": TokenFactors(x, _randn(3, 5, 3)),
        "bias": TokenFactors(_randn(3, 5, 6), _randn(3, 5, 4), bias=True),
        "plain": TokenFactors(_randn(3, 5, 6), _randn(3, 5, 2)),
    }
    factors = {
        name: TokenFactors(_randn(1, 7, 6), _randn(1, 7, g.out_dim), bias=g.bias)
        for name, g in grads.items()
        if name != "plain"
    }
    vectors = {name: _explicit_materialize(f)[0] for name, f in factors.items()}
    vectors["plain"] = _randn(grads["plain"].dim)
    dots = dots_with(grads, vectors, factors, route)
    assert list(dots) == list(grads)
    for name, g in grads.items():
        torch.testing.assert_close(dots[name], _explicit_materialize(g) @ vectors[name])


def test_dot_costs_route_to_the_smaller_target_form() -> None:
    """The ghost dot is chosen exactly when the factors are the smaller form of the
    vector: ``S (N_i + N_o) <= N_i N_o`` for ``S`` factor tokens."""
    train = TokenFactors(_randn(2, 3, 8), _randn(2, 3, 8))  # N_i N_o / (N_i + N_o) = 4
    for tokens, expected in ((4, Route.FACTORIZED), (5, Route.MATERIALIZED)):
        target = TokenFactors(_randn(1, tokens, 8), _randn(1, tokens, 8))
        assert choose_route(train.dot_costs(target)) is expected
    assert choose_route(train.dot_costs(DenseGrad(_randn(1, 64)))) is Route.MATERIALIZED


def test_selection_builds_factors_once_when_the_summed_rows_cost_more_than_reading() -> None:
    """Scoring then summing ``rows`` examples: on the factors it costs the cheaper dot
    route plus the rows' share of one weight-gradient product, ``rows T D``; built once,
    ``B T D`` plus ``B D`` reads. So a step that sums no row keeps the factors, one that
    sums every row builds them; a dense capture is never built again; an embedding, whose
    built gradient is vocabulary-wide, stays as it is."""
    b, t, n = 2, 3, 8
    train = TokenFactors(_randn(b, t, n), _randn(b, t, n))
    for rows, expected in ((0, Route.FACTORIZED), (b, Route.MATERIALIZED)):
        costs = train.score_and_sum_costs(None, rows)
        assert costs[Route.FACTORIZED] == b * t * n * n * (1 + rows / b)
        assert costs[Route.MATERIALIZED] == b * t * n * n + b * n * n
        assert choose_route(costs) is expected
    target = TokenFactors(_randn(1, 1, n), _randn(1, 1, n))  # ghost dot: b t (2 n)
    assert train.score_and_sum_costs(target, 1)[Route.FACTORIZED] == b * t * 2 * n + t * n * n
    assert choose_route(DenseGrad(_randn(b, 64)).score_and_sum_costs(None, b)) is (Route.FACTORIZED)
    ids = torch.randint(0, 1000, (b, t), generator=gen)
    embedding = EmbeddingFactors(ids, _randn(b, t, n), num_embeddings=1000)
    assert choose_route(embedding.score_and_sum_costs(None, b)) is Route.FACTORIZED


def _score_counting_materializations(
    prepared: QueryGradients,
    queries: dict[str, TokenFactors],
    trains: list[dict[str, TokenFactors]],
) -> dict[str, int]:
    """Score every training batch against ``prepared``, check each batch's scores against
    the explicit gradients' dots summed over the layers, and return how many times each
    query layer was materialized whole."""
    calls: dict[str, int] = {n: 0 for n in queries}
    original = TokenFactors.materialize

    def counted(self: TokenFactors) -> torch.Tensor:
        for name, q in queries.items():
            calls[name] += self is q
        return original(self)

    with mock.patch.object(TokenFactors, "materialize", counted):
        scored = [prepared.scores(train) for train in trains]
    for train, scores in zip(trains, scored, strict=True):
        reference = sum(
            _explicit_materialize(train[n]) @ _explicit_materialize(q).T for n, q in queries.items()
        )
        torch.testing.assert_close(scores, reference)
    return calls


def test_query_gradients_materialize_each_layer_once_and_score_as_cross_gram() -> None:
    """Scoring many training batches against fixed queries materializes a layer's queries
    only where the cost model routes through materialized gradients, and then once; every
    batch's scores equal the explicit gradients' dots summed over the layers."""
    queries = {
        "long": TokenFactors(_randn(2, 64, 3), _randn(2, 64, 2)),  # materialized route wins
        "short": TokenFactors(_randn(2, 1, 48), _randn(2, 1, 40)),  # factorized route wins
    }
    trains = [
        {
            "long": TokenFactors(_randn(3, 64, 3), _randn(3, 64, 2)),
            "short": TokenFactors(_randn(3, 1, 48), _randn(3, 1, 40)),
        }
        for _ in range(3)
    ]
    routes = {n: choose_route(trains[0][n].gram_costs(q)) for n, q in queries.items()}
    assert routes == {"long": Route.MATERIALIZED, "short": Route.FACTORIZED}
    prepared = QueryGradients(queries)
    assert _score_counting_materializations(prepared, queries, trains) == {"long": 1, "short": 0}
    explicit = torch.cat([_explicit_materialize(q) for q in queries.values()], dim=1)
    torch.testing.assert_close(prepared.norms(), explicit.norm(dim=1))


def test_query_gradients_beyond_their_cache_budget_are_built_per_batch() -> None:
    """With a cache of one layer's materialized queries, the first layer is materialized
    once and kept; the second is never materialized whole (its blocks are built for each
    training batch); every batch's scores still equal the explicit gradients' dots."""
    queries = {n: TokenFactors(_randn(2, 64, 3), _randn(2, 64, 2)) for n in ("first", "second")}
    trains = [{n: TokenFactors(_randn(3, 64, 3), _randn(3, 64, 2)) for n in queries} for _ in "ab"]
    assert {choose_route(trains[0][n].gram_costs(q)) for n, q in queries.items()} == {
        Route.MATERIALIZED
    }
    one_layer = 2 * queries["first"].dim * 8  # fp64
    prepared = QueryGradients(queries, cache_bytes=one_layer)
    calls = _score_counting_materializations(prepared, queries, trains)
    assert calls == {"first": 1, "second": 0}


@pytest.mark.parametrize("query_kind", ["factors", "dense"])
def test_query_gradients_keep_the_bias_column_apart_against_bias_factors(
    query_kind: str,
) -> None:
    """Against training factors of a layer with a bias, materialized queries (factors
    materialized once, or dense ones as preconditioned) keep their bias column apart: no
    training block is built beside its bias column. Every batch's scores, a dense
    training batch between them included, and the query norms equal the explicit
    gradients'."""
    factors = TokenFactors(_randn(2, 64, 3), _randn(2, 64, 2), bias=True)
    query: PerExampleGrad = (
        factors if query_kind == "factors" else DenseGrad(_explicit_materialize(factors))
    )
    trains = [TokenFactors(_randn(3, 64, 3), _randn(3, 64, 2), bias=True) for _ in range(3)]
    trains.insert(2, DenseGrad(_explicit_materialize(trains[1])))
    assert choose_route(trains[0].gram_costs(query)) is Route.MATERIALIZED
    prepared = QueryGradients({"layer": query})
    beside_bias = []
    original = TokenFactors.row_blocks

    def recorded(
        self: TokenFactors, width: int, dtype: torch.dtype
    ) -> Callable[[slice], torch.Tensor]:
        beside_bias.append(self.bias)
        return original(self, width, dtype)

    with mock.patch.object(TokenFactors, "row_blocks", recorded):
        scored = [prepared.scores({"layer": train}) for train in trains]
    assert beside_bias and not any(beside_bias)
    explicit_query = _explicit_materialize(factors)
    for train, scores in zip(trains, scored, strict=True):
        torch.testing.assert_close(scores, _explicit_materialize(train) @ explicit_query.T)
    torch.testing.assert_close(prepared.norms(), explicit_query.norm(dim=1))


def test_query_gradients_refuse_other_layers() -> None:
    train, query = _pair("linear")
    with pytest.raises(ValueError, match="different layers"):
        QueryGradients({"a": query}).scores({"b": train})


@pytest.mark.parametrize("kind", KINDS)
def test_rows_sum_is_the_selected_examples_sum(kind: str) -> None:
    """``rows_sum`` over some rows, and over every row (no gathered copy for factors),
    equals the explicit per-example gradients summed over those rows."""
    train, _ = _pair(kind)
    explicit = _explicit_materialize(train)
    selected: list[object] = []
    original = type(train).select

    def recorded(self: PerExampleGrad, rows: torch.Tensor | slice) -> PerExampleGrad:
        selected.append(rows)
        return original(self, rows)

    cases = (torch.tensor([2, 0]), torch.tensor([0, 1]), torch.arange(train.batch_size))
    with mock.patch.object(type(train), "select", recorded):
        for rows in cases:
            torch.testing.assert_close(train.rows_sum(rows), explicit[rows].sum(0))
    # one view per run of consecutive rows: 2 | 0, then 0-1, then every row
    assert selected == [slice(2, 3), slice(0, 1), slice(0, 2), slice(0, train.batch_size)]
    empty = train.rows_sum(torch.tensor([], dtype=torch.long))
    torch.testing.assert_close(empty, torch.zeros_like(explicit[0]))


def test_row_runs_split_indices_into_consecutive_slices() -> None:
    assert row_runs(torch.tensor([0, 1, 2, 5, 6])) == [slice(0, 3), slice(5, 7)]
    assert row_runs(torch.tensor([3])) == [slice(3, 4)]
    assert row_runs(torch.tensor([], dtype=torch.long)) == [slice(0, 0)]


@pytest.mark.parametrize("bias", [False, True])
def test_rows_sums_over_several_runs_of_rows(bias: bool) -> None:
    """Factors (linear and embedding) add every run of consecutive rows into one output;
    the sums equal the explicit rows' sums whatever the runs (none, one, several), bias
    column included."""
    grads: dict[str, PerExampleGrad] = {
        "q": TokenFactors(_randn(5, 4, 6), _randn(5, 4, 3), bias=bias),
        "o": TokenFactors(_randn(5, 4, 3), _randn(5, 4, 6), bias=bias),
        "emb": EmbeddingFactors(torch.randint(0, 7, (5, 4)), _randn(5, 4, 3), num_embeddings=7),
    }
    for rows in (
        torch.tensor([0, 2, 3]),
        torch.tensor([0, 1, 4]),
        torch.tensor([4]),
        torch.tensor([], dtype=torch.long),
    ):
        sums = rows_sums(grads, rows)
        for name, g in grads.items():
            expected = _explicit_materialize(g)[rows].sum(0)
            torch.testing.assert_close(sums[name], expected)


def test_ghost_dots_take_a_shared_input_gram_once() -> None:
    """Layers whose training factors share one input and whose target factors share one
    input too (q/k/v against a target's q/k/v) are scored together, the input Gram taken
    once; their dots equal the explicit ones, and a layer with its own target input is
    scored alone."""
    x, target_x = _randn(3, 5, 6), _randn(1, 7, 6)
    grads: dict[str, PerExampleGrad] = {
        name: TokenFactors(x, _randn(3, 5, width)) for name, width in (("q", 2), ("k", 3), ("v", 3))
    }
    factors = {
        name: TokenFactors(target_x if name != "v" else _randn(1, 7, 6), _randn(1, 7, g.out_dim))
        for name, g in grads.items()
    }
    vectors = {name: _explicit_materialize(f)[0] for name, f in factors.items()}
    shared = []
    original = TokenFactors.shared_input_dots

    def recorded(grads: list[TokenFactors], targets: list[TokenFactors]) -> list[torch.Tensor]:
        shared.append(len(grads))
        return original(grads, targets)

    with mock.patch.object(TokenFactors, "shared_input_dots", staticmethod(recorded)):
        dots = dots_with(grads, vectors, factors, Route.FACTORIZED)
    assert sorted(shared) == [1, 2]
    for name, g in grads.items():
        torch.testing.assert_close(dots[name], _explicit_materialize(g) @ vectors[name])
