"""K-FAC, EK-FAC and LoGra agree with their closed-form, dense definitions.

Every reference here is built without the code under test: Kronecker factors from the
layer inputs and output gradients of an ordinary autograd pass, per-example gradients
from one backward per unpadded example, and preconditioning as a dense solve against the
full damped Kronecker (or eigen-corrected) curvature matrix (docs/design.md section 7).

Row-major ``vec`` throughout: a layer's ``(N_o, N_i')`` gradient ``G`` flattens to
``vec(G)``, and then ``vec(S G A) = (S kron A) vec(G)`` for symmetric ``A``, and
``(U_S kron U_A)^T vec(G) = vec(U_S^T G U_A)``.
"""

from __future__ import annotations

import shutil
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_outputs import CausalLMOutput

from tda_plugins import CaptureEngine, LayerSelection, ProjectionConfig, RecordCollector
from tda_plugins.capture import content_hash
from tda_plugins.grads import Route, TokenFactors, choose_route
from tda_plugins.grads.projection import Projector
from tda_plugins.methods import method_by_name
from tda_plugins.methods.base import QUERY_CACHE_BYTES, SCORE_GROUP_BYTES
from tda_plugins.precondition import (
    PRECONDITIONERS,
    CurvatureAccumulator,
    EKFACPreconditioner,
    KroneckerFactors,
    PlanInputs,
    fitting,
    load_curvature,
    plan_capture,
    snapshots,
)
from tda_plugins.precondition.fit_cache import CACHE_FOLDER
from tda_plugins.precondition.statistics import add_upper_gram, mirrored
from tda_plugins.store import GradientStore, StoreError, StoreReader
from tests import ekfac_routes
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import LossFn, capture_store, run_captured, summed_loss

# fp64 end to end (fp64 loss included): only summation order differs from the references.
TOL = 1e-10
#: fp32 products of a few hundred token rows, summed in fp64.
FP32_PRODUCT_TOL = 1e-6
# Scores come back in fp32 (unit roundoff 6e-8), and the Llama stores' loss
# (causal_lm_example_losses) runs the cross-entropy in fp32 even for fp64 logits.
SCORE_TOL = 1e-6
# fp32 gradients rotated in fp32 against the same gradients rotated in fp64 (measured:
# 2.3e-7 for the eigenvalues, 3.5e-7 for the preconditioned queries).
FP32_TOL = 2e-6
DAMPING = 0.1
TOY_VOCAB = 8
TOY_LAYERS = ["fc1", "fc2"]
LOGRA = ProjectionConfig(kind="factor", k_a=4, k_g=4)


# -- models, batches, losses -------------------------------------------------------------


class ToyLM(nn.Module):
    """Embedding -> LayerNorm -> Linear(4, 5, bias) -> tanh -> Linear(5, V, no bias).

    Each position is computed on its own, so padding changes nothing at real tokens;
    padding rows still carry non-zero layer inputs, which K-FAC must leave out.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(TOY_VOCAB, 4)
        self.norm = nn.LayerNorm(4)
        self.fc1 = nn.Linear(4, 5)
        self.fc2 = nn.Linear(5, TOY_VOCAB, bias=False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> CausalLMOutput:
        hidden = torch.tanh(self.fc1(self.norm(self.emb(input_ids))))
        return CausalLMOutput(logits=self.fc2(hidden))


class SharedLayerLM(ToyLM):
    """:class:`ToyLM` with one more ``Linear(5, 5)`` called twice after ``fc1``."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(5, 5)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> CausalLMOutput:
        hidden = torch.tanh(self.fc1(self.norm(self.emb(input_ids))))
        hidden = torch.tanh(self.shared(torch.tanh(self.shared(hidden))))
        return CausalLMOutput(logits=self.fc2(hidden))


def toy_model() -> ToyLM:
    return ToyLM().double()


def toy_batch(seed: int, lengths: tuple[int, ...]) -> dict[str, Tensor]:
    """:func:`lm_batch` folded into the toy vocabulary (padding stays id 0, label -100)."""
    batch = lm_batch(batch=len(lengths), length=10, lengths=lengths, seed=seed)
    labels = batch["labels"]
    return {
        "input_ids": batch["input_ids"] % TOY_VOCAB,
        "attention_mask": batch["attention_mask"],
        "labels": torch.where(labels == -100, labels, labels % TOY_VOCAB),
    }


def toy_batches() -> list[dict[str, Tensor]]:
    return [toy_batch(0, (10, 7, 5)), toy_batch(1, (9, 10, 4))]


def fp64_summed_loss(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """Summed next-token cross-entropy of the batch, in the logits' dtype (fp64 here).

    ``causal_lm_example_losses`` computes it in fp32, which would bound the agreement with
    a reference to ~1e-8; the toy tests hold to :data:`TOL`.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def rel_err(got: Tensor, ref: Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


# -- references built without the engine ---------------------------------------------------


def loss_and_layer_calls(
    model: nn.Module, batch: Mapping[str, Tensor], layers: list[str]
) -> tuple[Tensor, dict[str, list[tuple[Tensor, Tensor]]]]:
    """The batch's fp64 summed loss, and layer -> (input, output) of each forward call."""
    seen: dict[str, list[tuple[Tensor, Tensor]]] = {n: [] for n in layers}

    def keep(name: str) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], None]:
        def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
            seen[name].append((args[0], output))

        return hook

    handles = [model.get_submodule(n).register_forward_hook(keep(n)) for n in layers]
    try:
        return fp64_summed_loss(model, batch), seen
    finally:
        for handle in handles:
            handle.remove()


def closed_form_factors(
    model: nn.Module, batches: list[dict[str, Tensor]], layers: list[str]
) -> dict[str, tuple[Tensor, Tensor, int]]:
    """Layer -> (A, S, rows): means over real tokens of ``[a;1][a;1]^T`` and ``g g^T``.

    ``a`` is the layer input seen by a forward hook, ``g`` the gradient of the batch's
    summed fp64 loss w.r.t. the layer output, by ``torch.autograd.grad``. A layer called
    several times per forward contributes the real-token rows of every call.
    """
    a_rows: dict[str, list[Tensor]] = {n: [] for n in layers}
    g_rows: dict[str, list[Tensor]] = {n: [] for n in layers}
    for batch in batches:
        loss, seen = loss_and_layer_calls(model, batch, layers)
        calls = [(n, a) for n in layers for a, _ in seen[n]]
        g_out = torch.autograd.grad(loss, [y for n in layers for _, y in seen[n]])
        real = batch["attention_mask"].bool()
        for (n, a), g in zip(calls, g_out, strict=True):
            a = a.detach()
            if model.get_submodule(n).bias is not None:
                a = torch.cat([a, a.new_ones(*a.shape[:2], 1)], dim=2)
            a_rows[n].append(a[real])
            g_rows[n].append(g[real])
    out = {}
    for n in layers:
        a, g = torch.cat(a_rows[n]), torch.cat(g_rows[n])
        out[n] = (a.T @ a / a.shape[0], g.T @ g / g.shape[0], a.shape[0])
    return out


def oracle_layer_grads(
    model: nn.Module, batches: list[dict[str, Tensor]], layers: list[str], loss_fn: LossFn
) -> dict[str, Tensor]:
    """Layer -> ``(N, N_o, N_i')`` each example's own gradient (bias as the last column),
    by one backward of ``loss_fn`` per example on its unpadded tokens."""
    modules = [model.get_submodule(n) for n in layers]
    params = [p for m in modules for p in (m.weight, m.bias) if p is not None]
    rows: dict[str, list[Tensor]] = {n: [] for n in layers}
    for batch in batches:
        for i, real in enumerate(batch["attention_mask"].bool()):
            example = {k: batch[k][i][real][None] for k in ("input_ids", "labels")}
            grads = iter(torch.autograd.grad(loss_fn(model, example), params))
            for n, m in zip(layers, modules, strict=True):
                dw = next(grads)
                if m.bias is not None:
                    dw = torch.cat([dw, next(grads).unsqueeze(1)], dim=1)
                rows[n].append(dw)
    return {n: torch.stack(r) for n, r in rows.items()}


def as_matrix(x: Tensor) -> Tensor:
    """A factor as a dense matrix (a diagonal one, the LM head's ``S``, given as a vector)."""
    return x if x.dim() == 2 else torch.diag(x)


def damped(x: Tensor, damping: float) -> Tensor:
    """``X + damping * mean eig(X) * I`` (the mean eigenvalue is the trace over n)."""
    x = as_matrix(x)
    n = x.shape[0]
    return x + damping * x.trace() / n * torch.eye(n, dtype=x.dtype)


def factor_basis(x: Tensor) -> Tensor:
    """A factor's eigenvectors; the identity for a diagonal one (given as a vector)."""
    if x.dim() == 1:
        return torch.eye(len(x), dtype=x.dtype)
    return torch.linalg.eigh(x)[1].contiguous()


def eigenbasis(stats: KroneckerFactors) -> Tensor:
    """``Q = U_S kron U_A`` from the eigendecompositions of the stored ``S`` and ``A``."""
    return torch.kron(factor_basis(stats.g_cov), factor_basis(stats.a_cov))


def dense_curvature(
    method: str, stats: KroneckerFactors, train_grads: Tensor, damping: float
) -> Tensor:
    """The ``D x D`` damped curvature matrix a method inverts, formed densely.

    K-FAC: ``(S + l_S I) kron (A + l_A I)``. EK-FAC: ``Q diag(Lambda + l) Q^T`` with
    ``Lambda = diag(Q^T F Q)``, ``F`` the empirical Fisher of ``train_grads``
    (``(N, N_o, N_i')``), computed as ``mean_n (Q^T vec dW_n)^2`` without forming ``F``.
    """
    if method == "kfac":
        return torch.kron(damped(stats.g_cov, damping), damped(stats.a_cov, damping))
    q = eigenbasis(stats)
    lam = (train_grads.flatten(1) @ q).pow(2).mean(dim=0)
    return (q * (lam + damping * lam.mean())) @ q.T


def dense_scores(
    method: str,
    train: dict[str, Tensor],
    queries: dict[str, Tensor],
    curvature: dict[str, KroneckerFactors],
    damping: float = DAMPING,
) -> Tensor:
    """``(N, M)`` sum over layers of ``vec(dW_z) . C^{-1} vec(G_q)``, by dense solves."""
    per_layer = []
    for name, dw in train.items():
        matrix = dense_curvature(method, curvature[name], dw, damping)
        per_layer.append(dw.flatten(1) @ torch.linalg.solve(matrix, queries[name].flatten(1).T))
    return torch.stack(per_layer).sum(dim=0)


def projected(grads: dict[str, Tensor], config: ProjectionConfig) -> dict[str, Tensor]:
    """``P_g dW P_a^T`` per layer, with the capture's deterministic maps."""
    projector = Projector(config)
    out = {}
    for name, dw in grads.items():
        n_o, n_i = dw.shape[1:]
        p_a = projector.map_for(name, "a", n_i, config.k_a).matrix(dw)
        p_g = projector.map_for(name, "g", n_o, config.k_g).matrix(dw)
        out[name] = p_g @ dw @ p_a.T
    return out


def store_ids(batches: list[dict[str, Tensor]]) -> Tensor:
    """The ids the engine gives these examples, in capture order."""
    return torch.cat([content_hash(b["input_ids"], b["attention_mask"].bool()) for b in batches])


def uncached(store: StoreReader) -> StoreReader:
    """``store`` without its fit cache, so that the next fit factorizes every layer."""
    shutil.rmtree(store.root / CACHE_FOLDER, ignore_errors=True)
    return store


# -- fixtures ------------------------------------------------------------------------------


@dataclass
class Toy:
    """The toy model, its two padded training batches, its store and a query store."""

    model: ToyLM
    batches: list[dict[str, Tensor]]
    store: Path
    queries: Path


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Toy:
    root = tmp_path_factory.mktemp("toy")
    model, batches = toy_model(), toy_batches()
    capture_store(model, batches, root / "train", loss_fn=fp64_summed_loss)
    query = [toy_batch(7, (10, 6))]
    capture_store(
        model, query, root / "query", loss_fn=fp64_summed_loss, keep_tokens=True, curvature=False
    )
    return Toy(model, batches, root / "train", root / "query")


@dataclass
class Llama:
    """A tiny fp64 Llama, padded train and query batches, stores captured on demand."""

    model: nn.Module
    train: list[dict[str, Tensor]]
    queries: list[dict[str, Tensor]]
    root: Path
    references: dict[str, Tensor] = field(default_factory=dict)

    def store(
        self, kind: str, projection: ProjectionConfig | None = None, curvature_head: bool = False
    ) -> StoreReader:
        """Train (with curvature; ``curvature_head``: the head's ``S`` dense) or query
        store, captured once per projection."""
        path = self.root / f"{kind}-{'exact' if projection is None else projection.kind}"
        path = path.with_name(path.name + "-dense-head") if curvature_head else path
        if not path.exists():
            batches = self.train if kind == "train" else self.queries
            capture_store(
                self.model,
                batches,
                path,
                LayerSelection("linear"),
                projection,
                curvature=kind == "train",
                curvature_head=curvature_head,
            )
        return StoreReader(path)

    def oracle(self, kind: str) -> dict[str, Tensor]:
        batches = self.train if kind == "train" else self.queries
        layers = self.store("train").layer_names
        return oracle_layer_grads(self.model, batches, layers, summed_loss)

    def dense_reference(self, method: str) -> Tensor:
        """``dense_scores`` of the exact stores' oracle gradients, computed once per
        method (the dense solves are most of these tests' time)."""
        if method not in self.references:
            curvature = load_curvature(self.store("train").root)
            self.references[method] = dense_scores(
                method, self.oracle("train"), self.oracle("query"), curvature
            )
        return self.references[method]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Llama:
    train = [lm_batch(lengths=(10, 7, 5), seed=1), lm_batch(lengths=(8, 10, 6), seed=2)]
    queries = [lm_batch(batch=2, lengths=(10, 4), seed=3)]
    return Llama(tiny_causal_lm("llama"), train, queries, tmp_path_factory.mktemp("llama"))


# -- the factors ---------------------------------------------------------------------------


def assert_closed_form_factors(
    store: Path, model: nn.Module, batches: list[dict[str, Tensor]], calls: dict[str, int]
) -> None:
    """The store's factors of every layer in ``calls`` (name -> forward calls per batch)
    are the closed-form ones, over ``calls`` x the real tokens of ``batches``."""
    curvature = load_curvature(store)
    expected = closed_form_factors(model, batches, list(calls))
    real_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    all_tokens = sum(b["attention_mask"].numel() for b in batches)
    assert real_tokens < all_tokens, "the batches must contain padding"
    assert set(curvature) == set(calls)
    for name, (a_cov, g_cov, rows) in expected.items():
        stats = curvature[name]
        assert rows == calls[name] * real_tokens
        assert stats.tokens.item() == rows, f"{name}: padding rows counted"
        assert rel_err(stats.a_cov, a_cov) < TOL, name
        assert rel_err(stats.g_cov, g_cov) < TOL, name


# How one set of batches reaches the store: (which batches, capture_store options) per run.
CAPTURE_PLANS = {
    "one run": [(slice(None), {})],
    "trainer mean loss": [(slice(None), {"mean_loss": True})],
    "two ranks": [(slice(0, 1), {"rank": 0}), (slice(1, None), {"rank": 1})],
    "resumed run": [(slice(0, 1), {}), (slice(1, None), {"append": True})],
}


@pytest.mark.parametrize("plan", list(CAPTURE_PLANS))
def test_kfac_factors_equal_closed_form_covariances_over_real_tokens(
    plan: str, tmp_path: Path
) -> None:
    """The inline A and S are the means of [a;1][a;1]^T and g g^T over non-padding token
    rows of every batch, with g under the summed per-example loss whatever loss was
    backpropagated, summed over ranks and across a resumed capture."""
    model, batches = toy_model(), toy_batches()
    for part, options in CAPTURE_PLANS[plan]:
        capture_store(model, batches[part], tmp_path, loss_fn=fp64_summed_loss, **options)
    assert_closed_form_factors(tmp_path, model, batches, {"fc1": 1, "fc2": 1})


@pytest.mark.parametrize("width", [5, 200, 201, 601, 1537])
def test_add_upper_gram_adds_the_full_gram_from_its_halves(width: int) -> None:
    """``add_upper_gram`` adds ``x^T x`` onto the symmetric sum that ``out`` held, read
    through ``mirrored``: one product up to the widest, one halving just past it, and
    several levels of unequal halves (an odd width too). ``mirrored`` reads the upper
    triangle only: junk below the diagonal does not reach the sum."""
    torch.manual_seed(0)
    x = torch.randn(40, width, dtype=torch.float64)
    start = torch.randn(width, width, dtype=torch.float64)
    start = start + start.T
    out = start + torch.randn(width, width, dtype=torch.float64).tril(-1)
    add_upper_gram(out, x)
    assert rel_err(mirrored(out), start + x.T @ x) < TOL


@pytest.mark.parametrize(
    ("product_dtype", "tol"),
    [(None, FP32_PRODUCT_TOL), (torch.float64, TOL)],
    ids=["fp32-products", "fp64-products"],
)
def test_kfac_factors_of_fp32_gradients_equal_their_fp64_sums(
    product_dtype: torch.dtype | None, tol: float
) -> None:
    """For fp32 captures, A and S are the sums of the captured factors' products over the
    real tokens (the untied head's S its diagonal), summed in fp64: to fp32 precision with
    the default fp32 products, to fp64 precision with ``product_dtype=torch.float64``. The
    closed-form tests above are fp64 captures. Layers sharing an input (q/k/v, gate/up)
    share its product."""
    model = tiny_causal_lm("llama", torch.float32)
    batches = [lm_batch(lengths=(10, 7, 5), seed=1), lm_batch(lengths=(8, 10, 6), seed=2)]
    accumulator = CurvatureAccumulator("unused", product_dtype=product_dtype)
    collector = RecordCollector()
    with CaptureEngine(model, layers=LayerSelection("linear"), consumers=[accumulator, collector]):
        for batch in batches:
            summed_loss(model, batch).backward()
    assert len(collector.records) == len(batches)
    names = list(collector.records[0].layers)
    assert len(names) == 15 and set(accumulator.factors) == set(names)
    for name in names:
        a_sum = g_sum = 0
        for record in collector.records:
            grads = record.layers[name].grads
            assert isinstance(grads, TokenFactors) and grads.g.dtype == torch.float32
            real = record.token_mask
            a, g = grads.augmented_a().double()[real], grads.g.double()[real]
            # the head keeps the diagonal of its vocabulary-wide S
            g_product = (g * g).sum(0) if name == "lm_head" else g.T @ g
            a_sum, g_sum = a_sum + a.T @ a, g_sum + g_product
        stats = accumulator.factors[name]
        assert stats.a_sum.dtype == stats.g_sum.dtype == torch.float64
        assert rel_err(stats.a_sum, a_sum) < tol, name
        assert rel_err(stats.g_sum, g_sum) < tol, name


def test_kfac_factors_of_a_module_called_twice_cover_the_real_tokens_of_both_calls(
    tmp_path: Path,
) -> None:
    """A module called twice per forward adds both calls' rows to its factors, and still
    only their non-padding rows."""
    model, batches = SharedLayerLM().double(), toy_batches()
    capture_store(model, batches, tmp_path, loss_fn=fp64_summed_loss)
    assert_closed_form_factors(tmp_path, model, batches, {"fc1": 1, "shared": 2, "fc2": 1})


def test_ekfac_eigenvalues_are_the_empirical_fisher_diagonal_in_the_kronecker_basis(
    toy: Toy,
) -> None:
    """Lambda = diag(Q^T F Q), Q = U_S kron U_A, F = mean_n vec(dW_n) vec(dW_n)^T over the
    stored examples, with dW_n from one backward per unpadded example; the eigenbases
    diagonalize the store's A and S."""
    ekfac = EKFACPreconditioner(DAMPING)
    ekfac.fit(StoreReader(toy.store))
    curvature = load_curvature(toy.store)
    grads = oracle_layer_grads(toy.model, toy.batches, TOY_LAYERS, fp64_summed_loss)
    assert set(ekfac.eigenvalues) == set(grads)
    for name, dw in grads.items():
        assert dw.shape[0] == StoreReader(toy.store).num_examples
        flat = dw.flatten(1)
        fisher = flat.T @ flat / flat.shape[0]
        q = eigenbasis(curvature[name])
        expected = torch.diagonal(q.T @ fisher @ q).reshape(dw.shape[1:])
        assert rel_err(ekfac.eigenvalues[name], expected) < TOL, name
        e = ekfac.eigen[name]
        stats = curvature[name]
        assert rel_err(e.u_a @ torch.diag(e.d_a) @ e.u_a.T, stats.a_cov) < TOL, name
        assert rel_err(e.u_s @ torch.diag(e.d_s) @ e.u_s.T, stats.g_cov) < TOL, name


# -- preconditioning -----------------------------------------------------------------------


@pytest.mark.parametrize("damping", [DAMPING, 1e-2])
@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_preconditioned_query_equals_dense_damped_inverse(
    toy: Toy, method: str, damping: float
) -> None:
    """Each preconditioned query is C^{-1} vec(G_q) with C the dense damped curvature:
    ((S + l_S I) kron (A + l_A I)) for K-FAC, Q diag(Lambda + l) Q^T for EK-FAC."""
    preconditioner = PRECONDITIONERS[method](damping)
    preconditioner.fit(StoreReader(toy.store))
    curvature = load_curvature(toy.store)
    train = oracle_layer_grads(toy.model, toy.batches, TOY_LAYERS, fp64_summed_loss)
    queries = StoreReader(toy.queries).load_all().layers
    for name in TOY_LAYERS:
        query = queries[name].materialize()
        matrix = dense_curvature(method, curvature[name], train[name], damping)
        expected = torch.linalg.solve(matrix, query.T).T
        got = preconditioner(name, queries[name]).materialize()
        assert got.dtype == torch.float64
        assert rel_err(got, expected) < TOL, name


def test_kfac_needs_no_eigendecomposition(toy: Toy) -> None:
    """K-FAC damps by trace / n and inverts through Cholesky: fitting and preconditioning
    never call ``eigh`` (the test above checks the result against the dense solve)."""
    kfac = PRECONDITIONERS["kfac"](DAMPING)
    queries = StoreReader(toy.queries).load_all().layers
    with mock.patch("torch.linalg.eigh", side_effect=AssertionError("eigh called")):
        kfac.fit(StoreReader(toy.store))
        preconditioned = [kfac(name, queries[name]) for name in TOY_LAYERS]
    assert len(preconditioned) == len(TOY_LAYERS) > 0


def fp32_llama_stores(root: Path) -> tuple[StoreReader, StoreReader]:
    """Train (with curvature) and query stores of a tiny fp32 Llama's linear layers."""
    model = tiny_causal_lm("llama", torch.float32)
    train = [lm_batch(lengths=(10, 7, 5), seed=1), lm_batch(lengths=(8, 10, 6), seed=2)]
    layers = LayerSelection("linear")
    store = capture_store(model, train, root / "train", layers)
    queries = capture_store(
        model, [lm_batch(batch=2, lengths=(10, 4), seed=3)], root / "q", layers, curvature=False
    )
    return store, queries


def test_kfac_on_fp32_gradients_keeps_fp32_inverses_of_the_fp64_factorization(
    tmp_path: Path, llama: Llama
) -> None:
    """K-FAC factorizes in fp64 and keeps each damped inverse in the store's accumulation
    dtype (fp32 for fp32 gradients: the products cast them to it anyway, so no fp64 copy
    is held); the preconditioned fp32 query equals the fp64 dense solve to fp32
    precision. An fp64 store keeps fp64 inverses."""
    store, queries = fp32_llama_stores(tmp_path)
    assert store.values_dtype() == torch.float32
    kfac = PRECONDITIONERS["kfac"](DAMPING)
    kfac.fit(store)
    curvature = load_curvature(store.root)
    query = queries.load_all().layers
    for name in store.layer_names:
        s_inv, a_inv = kfac.inverses[name]
        assert s_inv.dtype == a_inv.dtype == torch.float32
        stats = curvature[name]
        q = (
            query[name]
            .materialize()
            .double()
            .view(-1, *stats.g_sum.shape[:1], stats.a_sum.shape[0])
        )
        s, a = damped(stats.g_cov, DAMPING), damped(stats.a_cov, DAMPING)
        expected = torch.linalg.solve(s, torch.linalg.solve(a, q.transpose(1, 2)).transpose(1, 2))
        got = kfac(name, query[name]).materialize()
        assert got.dtype == torch.float32
        assert rel_err(got, expected.flatten(1)) < FP32_TOL, name
    fp64 = PRECONDITIONERS["kfac"](DAMPING)
    fp64.fit(llama.store("train"))
    assert llama.store("train").values_dtype() == torch.float64
    assert all(s.dtype == a.dtype == torch.float64 for s, a in fp64.inverses.values())


def test_ekfac_on_fp32_gradients_matches_the_fp64_rotation(tmp_path: Path) -> None:
    """On fp32 gradients EK-FAC rotates the per-token factors in fp32 (``U_S^T g_t``,
    ``U_A^T a_t``) and squares and sums in fp64. Its eigenvalues and preconditioned queries
    equal those of the fp64 path (``U_S^T dW U_A`` of the materialized gradients, every
    product in fp64, with the bases of fp64 eigendecompositions of the stored factors) to
    fp32 precision; the fit keeps its bases in fp32, the gradients' accumulation dtype."""
    store, queries = fp32_llama_stores(tmp_path)
    ekfac = EKFACPreconditioner(DAMPING)
    ekfac.fit(store)
    chunk, query = store.load_all(), queries.load_all()
    curvature = load_curvature(store.root)
    routes = []
    for name, e in ekfac.eigen.items():
        bases = [u for u in (e.u_a, e.u_s) if u is not None]  # none for a diagonal factor
        assert len(bases) == (1 if name == "lm_head" else 2)
        assert all(u.dtype == torch.float32 for u in bases)
        u_s = factor_basis(curvature[name].g_cov.double())
        u_a = factor_basis(curvature[name].a_cov.double())
        grads = chunk.layers[name]
        routes.append(choose_route(grads.rotation_costs(*e.shape)))
        dw = grads.materialize().double().view(-1, *e.shape)
        lam = (u_s.T @ dw @ u_a).pow(2).mean(dim=0)
        assert rel_err(ekfac.eigenvalues[name], lam) < FP32_TOL, name
        q = query.layers[name].materialize().double().view(-1, *e.shape)
        expected = u_s @ ((u_s.T @ q @ u_a) / (lam + DAMPING * lam.mean())) @ u_a.T
        got = ekfac(name, query.layers[name]).materialize()
        assert got.dtype == torch.float32
        assert rel_err(got, expected.flatten(1)) < FP32_TOL, name
    assert len(routes) == 15 and Route.FACTORIZED in routes


# -- methods end to end on Llama -----------------------------------------------------------


@pytest.mark.parametrize("cache", ["default", "none", "uneven"])
@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_method_scores_equal_dense_reference_on_llama(
    llama: Llama, method: str, cache: str
) -> None:
    """K-FAC/EK-FAC scores on every linear layer of a tiny Llama (padded batches) equal
    sum over layers of vec(dW_z) . C^{-1} vec(G_q), from oracle gradients and dense solves;
    also with no memory to spare: one layer per pass over the store, no cache of
    materialized queries (K-FAC's preconditioned per-token query factors are then built
    block by block for each training chunk), and EK-FAC's dense queries preconditioned
    and scored one query at a time, or in groups that differ from layer to layer."""
    store, queries = llama.store("train"), llama.store("query")
    budget = {
        "default": QUERY_CACHE_BYTES,
        "none": 0,
        # one query of the widest layer: EK-FAC takes 1 query at a time there, 2 elsewhere
        "uneven": max(g.dim for g in queries.load_all().layers.values()) * 8,
    }[cache]
    group = SCORE_GROUP_BYTES if cache == "default" else 1
    with (
        mock.patch("tda_plugins.methods.base.QUERY_CACHE_BYTES", budget),
        mock.patch("tda_plugins.methods.base.SCORE_GROUP_BYTES", group),
    ):
        scored = method_by_name(method)
        scores = scored.score(store, queries, chunk_examples=1)
    if method == "ekfac":  # the default route: the correction's rotated gradients kept
        assert scored.preconditioner._kept == set(store.layer_names)
    assert torch.equal(scores.train_ids, store_ids(llama.train))
    assert torch.equal(scores.query_ids, store_ids(llama.queries))
    expected = llama.dense_reference(method)
    assert len(store.layer_names) == 15  # 7 linears in each of 2 blocks, and lm_head
    assert rel_err(scores.values, expected) < SCORE_TOL


@pytest.mark.parametrize("route", ["stored", "eigenbasis", "mixed"])
def test_ekfac_routes_equal_the_dense_reference(llama: Llama, route: str) -> None:
    """EK-FAC's scores equal the dense reference through each route besides keeping the
    correction's rotated training gradients: read again from the store, the queries
    rotated back (``stored``) or left in the basis, each training chunk rotated instead
    (``eigenbasis``: forced for every layer); and ``mixed``, where the memory for kept
    gradients holds the narrow layers' but not the MLP's."""
    store, queries = llama.store("train"), llama.store("query")
    method = method_by_name("ekfac")
    widths = {n.split(".")[-1]: g.dim for n, g in queries.load_all().layers.items()}
    itemsize = store.values_dtype().itemsize
    between = store.num_examples * itemsize * (widths["q_proj"] + widths["gate_proj"]) // 2
    patch = {
        "stored": ekfac_routes.stored,
        "eigenbasis": ekfac_routes.prefer_the_eigenbasis,
        "mixed": lambda: ekfac_routes.kept_bytes(between),
    }[route]
    with patch():
        scores = method.score(store, queries, chunk_examples=1)
    kept, names = method.preconditioner._kept, set(store.layer_names)
    if route == "mixed":
        assert {n for n in names if "self_attn" in n} <= kept
        assert not {n for n in names if "mlp" in n} & kept
    else:
        assert kept == set()
    assert route != "eigenbasis" or method.preconditioner._in_eigenbasis == names
    expected = llama.dense_reference("ekfac")
    assert rel_err(scores.values, expected) < SCORE_TOL


def test_ekfac_holds_one_groups_kept_gradients_at_a_time(llama: Llama) -> None:
    """With the memory for kept rotated gradients holding one MLP layer's, the layers are
    scored in several kept groups; each group's are released before the next group's
    correction builds its own, so at most that memory is held (and the scores stay
    the dense reference's)."""
    store, queries = llama.store("train"), llama.store("query")
    widest = max(g.dim for g in queries.load_all().layers.values())
    limit = store.num_examples * store.values_dtype().itemsize * widest
    method = method_by_name("ekfac")
    real = EKFACPreconditioner.training_chunks
    built: list[weakref.ref[Any]] = []
    held: list[int] = []

    def watched(self: EKFACPreconditioner, *args: Any, **kwargs: Any) -> Any:
        held.append(sum(ref() is not None for ref in built))  # earlier groups still alive
        source = real(self, *args, **kwargs)
        built.append(weakref.ref(source))
        return source

    with (
        ekfac_routes.kept_bytes(limit),
        mock.patch.object(EKFACPreconditioner, "training_chunks", watched),
    ):
        scores = method.score(store, queries, chunk_examples=1)
    assert method.preconditioner._kept == set(store.layer_names)
    assert len(built) > 2 and held == [0] * len(built)
    assert rel_err(scores.values, llama.dense_reference("ekfac")) < SCORE_TOL


@pytest.mark.parametrize(("name", "factorization"), [("kfac", "cholesky"), ("ekfac", "eigh")])
def test_equal_factors_are_factorized_once(llama: Llama, name: str, factorization: str) -> None:
    """Layers fed by one input (q/k/v, gate/up) have equal ``A`` factors: the fit factorizes
    each distinct factor once."""
    store = uncached(llama.store("train"))
    curvature = load_curvature(store.root)
    distinct: list[Tensor] = []
    for stats in curvature.values():
        for factor in (stats.a_cov, stats.g_cov):
            if factor.dim() == 1:  # the head's diagonal S: inverted entrywise
                continue
            if not any(torch.equal(factor, seen) for seen in distinct):
                distinct.append(factor)
    assert len(distinct) < 2 * len(curvature)  # the sharing exists
    real = getattr(torch.linalg, factorization)
    with mock.patch.object(torch.linalg, factorization, side_effect=real) as calls:
        PRECONDITIONERS.create(name, damping=DAMPING).fit(store)
    assert calls.call_count == len(distinct)


@pytest.mark.parametrize(
    ("name", "what"), [("kfac", "K-FAC damped inverses"), ("ekfac", "EK-FAC eigendecompositions")]
)
@pytest.mark.parametrize("progress", [True, False])
def test_the_fit_counts_its_progress_by_each_layers_factorization_work(
    llama: Llama, name: str, what: str, progress: bool
) -> None:
    """With ``progress``, the fit's bar is named for its work and advances by each layer's
    sum of ``n^3`` over its dense factors, to the total over the store's layers."""
    store = uncached(llama.store("train"))
    curvature = load_curvature(store.root)
    work = sum(
        f.shape[0] ** 3 for s in curvature.values() for f in (s.a_cov, s.g_cov) if f.dim() == 2
    )
    made: list[tuple[dict[str, Any], Any]] = []
    real = fitting.tqdm

    def recorded(*args: Any, **kwargs: Any) -> Any:
        made.append((kwargs, real(*args, **kwargs)))
        return made[-1][1]

    with mock.patch.object(fitting, "tqdm", side_effect=recorded):
        PRECONDITIONERS.create(name, damping=DAMPING).fit(store, progress=progress)
    ((kwargs, bar),) = made
    assert kwargs["desc"] == what and kwargs["disable"] is not progress
    if progress:
        n = len(store.layer_names)
        assert bar.n == bar.total == work
        assert bar.postfix == f"{n}/{n} layers"


def test_factor_projected_statistics_are_the_projected_exact_ones(llama: Llama) -> None:
    """Under factor projection the inline factors are P_a A P_a^T and P_g S P_g^T (``S``
    dense for the head too: its projected output side is ``k`` wide)."""
    exact = load_curvature(llama.store("train", curvature_head=True).root)
    projected_stats = load_curvature(llama.store("train", LOGRA).root)
    projector = Projector(LOGRA)
    assert set(projected_stats) == set(exact)
    for name, stats in exact.items():
        p_a = projector.map_for(name, "a", stats.a_cov.shape[0], LOGRA.k_a).matrix(stats.a_cov)
        p_g = projector.map_for(name, "g", stats.g_cov.shape[0], LOGRA.k_g).matrix(stats.g_cov)
        got = projected_stats[name]
        assert rel_err(got.a_cov, p_a @ stats.a_cov @ p_a.T) < TOL, name
        assert rel_err(got.g_cov, p_g @ stats.g_cov @ p_g.T) < TOL, name


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_a_lora_at_initialization_scores_as_its_b_layers_alone(tmp_path: Path, method: str) -> None:
    """LoRA as PEFT initializes it (``B = 0``): every ``A`` layer's gradients, and so its
    statistics, are zero. Such a layer scores 0 (its damped inverse stays finite: damped
    by ``damping * tiny``, ``1 / (damping * tiny)`` overflowed and every score was NaN),
    so the scores are those of a store of the ``B`` layers alone."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(tiny_causal_lm("llama"), config)
    train = [lm_batch(lengths=(10, 7, 5), seed=1)]
    queries = [lm_batch(batch=2, lengths=(10, 4), seed=3)]
    scores = []
    for part, include in (("all", None), ("b", "lora_B")):
        layers = LayerSelection("lora", include=include)
        store = capture_store(model, train, tmp_path / part, layers)
        query = capture_store(model, queries, tmp_path / f"q-{part}", layers, curvature=False)
        scores.append(method_by_name(method).score(store, query).values)
    grads = StoreReader(tmp_path / "all").load_all().layers
    assert all(g.materialize().abs().max() == 0 for n, g in grads.items() if "lora_A" in n)
    assert torch.isfinite(scores[0]).all() and scores[1].abs().max() > 0
    assert rel_err(scores[0], scores[1]) < 1e-12


def test_logra_is_kfac_on_the_factor_projected_store(llama: Llama) -> None:
    """LoGra scores on a factor-projected store are K-FAC's on that store, and both equal
    the dense K-FAC reference on the projected oracle gradients P_g dW P_a^T."""
    store, queries = llama.store("train", LOGRA), llama.store("query", LOGRA)
    logra = method_by_name("logra").score(store, queries)
    kfac = method_by_name("kfac").score(store, queries)
    assert torch.equal(logra.values, kfac.values)
    expected = dense_scores(
        "kfac",
        projected(llama.oracle("train"), LOGRA),
        projected(llama.oracle("query"), LOGRA),
        load_curvature(store.root),
    )
    assert rel_err(logra.values, expected) < SCORE_TOL


def test_logra_on_an_unprojected_store_names_the_fix(llama: Llama) -> None:
    """LoGra refuses exact gradients and says to recapture with factor projection."""
    with pytest.raises(StoreError, match="--projection factor, or use kfac"):
        method_by_name("logra").score(llama.store("train"), llama.store("query"))


# -- stores K-FAC cannot use ---------------------------------------------------------------


@pytest.mark.parametrize("layer", ["emb", "norm"])
@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_a_store_whose_statistics_leave_out_a_layer_is_refused(
    tmp_path: Path, method: str, layer: str
) -> None:
    """A store whose statistics leave out a captured embedding or norm layer with no
    reason given (as a capture of an earlier version, which kept factors for linear layers
    only, did) cannot be preconditioned: K-FAC and EK-FAC raise a StoreError naming the
    layer and the linear-only selection. (Captures keep statistics for these layers now:
    ``tests/test_curvature_all_layers.py``.)"""
    selection = LayerSelection("all", include=f"^({layer}|fc1)$")
    linear_only = plan_capture(toy_model(), PlanInputs(LayerSelection("linear", include="^fc1$")))
    consumers = [
        GradientStore(tmp_path),
        CurvatureAccumulator(tmp_path, shapes=linear_only.curvature_shapes),
    ]
    run_captured(toy_model(), toy_batches(), consumers, selection, loss_fn=fp64_summed_loss)
    store = StoreReader(tmp_path)
    assert store.layer_names == [layer, "fc1"]
    with pytest.raises(StoreError, match="keeps factors for linear/LoRA layers only") as error:
        method_by_name(method).score(store, store)
    assert repr(layer) in str(error.value)
    assert "kind='linear'" in str(error.value)


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_store_without_curvature_says_how_to_capture_it(tmp_path: Path, method: str) -> None:
    """A store captured without curvature cannot feed K-FAC/EK-FAC; the error says how to
    capture the statistics."""
    store = capture_store(toy_model(), toy_batches(), tmp_path, curvature=False)
    with pytest.raises(StoreError, match="capture with curvature enabled"):
        method_by_name(method).score(store, store)


def test_kfac_scoring_frees_the_loaded_queries_before_reading_the_store(llama: Llama) -> None:
    """The last pass over a layer group drops each loaded query gradient once its
    preconditioned side exists: no loaded query tensor is alive when the first training
    chunk arrives (K-FAC's preconditioned per-token factors are new tensors, so holding
    the loaded ones too would keep the query side twice)."""
    store, queries = llama.store("train"), llama.store("query")
    loaded: list[weakref.ref[Tensor]] = []
    load_all = StoreReader.load_all

    def load_and_watch(reader: StoreReader, layers: list[str] | None = None) -> Any:
        chunk = load_all(reader, layers)
        for grads in chunk.layers.values():
            grads.map_tensors(lambda t: loaded.append(weakref.ref(t)) or t)
        return chunk

    alive_at_first_chunk: list[int] = []
    method = method_by_name("kfac")
    train_side = method.train_side

    def watch_train_side(layer: str, grads: Any) -> Any:
        if not alive_at_first_chunk:
            alive_at_first_chunk.append(sum(ref() is not None for ref in loaded))
        return train_side(layer, grads)

    with (
        mock.patch.object(StoreReader, "load_all", load_and_watch),
        mock.patch.object(method, "train_side", watch_train_side),
    ):
        scores = method.score(store, queries, chunk_examples=1)
    assert loaded and alive_at_first_chunk == [0]
    expected = llama.dense_reference("kfac")
    assert rel_err(scores.values, expected) < SCORE_TOL


@pytest.mark.parametrize(("name", "factorization"), [("kfac", "cholesky"), ("ekfac", "eigh")])
def test_fit_reads_each_layers_statistics_when_it_factorizes_it(
    llama: Llama, name: str, factorization: str
) -> None:
    """The fit reads the store's Kronecker statistics one layer at a time, as it reaches
    the layer, and frees them once factorized: every factorization finds at most one
    layer's statistics alive (never every layer's fp64 factors beside the factorizations)."""
    store = uncached(llama.store("train"))
    layers: list[tuple[weakref.ref[Tensor], weakref.ref[Tensor]]] = []
    read = snapshots.sum_files

    def read_and_watch(*args: Any, **kwargs: Any) -> dict[str, KroneckerFactors]:
        out = read(*args, **kwargs)
        layers.extend((weakref.ref(s.a_sum), weakref.ref(s.g_sum)) for s in out.values())
        return out

    alive: list[int] = []  # per factorization: layers whose statistics are alive
    real = getattr(torch.linalg, factorization)

    def factorize(x: Tensor) -> Any:
        alive.append(sum(a() is not None or g() is not None for a, g in layers))
        return real(x)

    with (
        mock.patch.object(snapshots, "sum_files", read_and_watch),
        mock.patch.object(torch.linalg, factorization, side_effect=factorize),
    ):
        PRECONDITIONERS.create(name, damping=DAMPING).fit(store)
    assert len(layers) == len(store.layer_names) > 1
    assert alive and max(alive) <= 1
