"""K-FAC, EK-FAC and LoGra on every layer type the engine captures (``layers="all"``):
embeddings, norm scales and the LM head tied to the input embedding, beside the linear
layers, on tiny GPT-2 (tied), Llama (untied) and Llama with ``tie_word_embeddings``.

Every reference is built without the code under test (``tests/curvature_reference.py``):
per-example gradients by one backward per unpadded example (a tied weight's as the one
parameter it is, whose gradient is the sum of its two uses'), Kronecker factors from an
ordinary autograd pass, and the damped curvature of each embedding, norm scale and tied
weight formed as a dense matrix and solved in fp64 (docs/design.md sections 7.4-7.6, 8).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from tda_plugins import LayerSelection, ProjectionConfig
from tda_plugins.capture.normalization import SummedLoss
from tda_plugins.cli import main
from tda_plugins.grads.dense import sum_of_uses
from tda_plugins.grads.projection import Projector
from tda_plugins.live.influence import InfluenceLogger
from tda_plugins.methods import Scores, method_by_name
from tda_plugins.precondition import (
    PRECONDITIONERS,
    PlanInputs,
    load_curvature,
    plan_capture,
)
from tda_plugins.precondition.snapshots import read_set
from tda_plugins.session.batch import capture_batch
from tda_plugins.session.capture import CaptureSession
from tda_plugins.session.settings import CaptureSettings
from tda_plugins.store import StoreError, StoreReader
from tests import ekfac_routes
from tests.curvature_reference import (
    Factors,
    closed_form_factors,
    is_norm,
    preconditioned,
    reference_scores,
    unit_grads,
    units_of,
)
from tests.models import VOCAB, lm_batch, tiny_causal_lm
from tests.stores import capture_store, rel_error, scores_by_id, summed_loss

#: fp64 throughout: only the order of summation differs from the references.
TOL = 1e-9
#: Scores come back in fp32.
SCORE_TOL = 1e-6
#: Llama's RMSNorm computes in fp32 inside an fp64 model, so a backward of the loss
#: divided by a token count (and the count multiplied back) differs from the summed
#: loss's at fp32 rounding (measured 1.1e-7).
MEAN_LOSS_TOL = 1e-6
MODELS = {"gpt2-tied": ("gpt2", None), "llama": ("llama", False), "llama-tied": ("llama", True)}
ALL = LayerSelection("all")


def train_batches() -> list[dict[str, Tensor]]:
    return [lm_batch(lengths=(10, 7, 5), seed=1), lm_batch(lengths=(8, 10, 6), seed=2)]


def query_batches() -> list[dict[str, Tensor]]:
    return [lm_batch(batch=2, lengths=(10, 4), seed=3)]


@dataclass
class Captured:
    """A model's stores of every layer type, and the references of their examples."""

    name: str
    model: nn.Module
    store: StoreReader
    queries: StoreReader
    units: list[tuple[str, ...]]
    train: dict[tuple[str, ...], Tensor]
    query: dict[tuple[str, ...], Tensor]
    factors: dict[str, Factors]

    def scores(self, method: str) -> Tensor:
        return reference_scores(
            method, self.model, self.units, self.factors, self.train, self.query
        )


def capture(name: str, root: Path) -> Captured:
    arch, tied = MODELS[name]
    model = tiny_causal_lm(arch, tie_word_embeddings=tied)
    store = capture_store(model, train_batches(), root / "train", ALL)
    queries = capture_store(model, query_batches(), root / "query", ALL, curvature=False)
    units = units_of(model, store.layer_names)
    train = unit_grads(model, train_batches(), units)
    return Captured(
        name,
        model,
        store,
        queries,
        units,
        train,
        unit_grads(model, query_batches(), units),
        closed_form_factors(model, train_batches(), units, train),
    )


@pytest.fixture(scope="module", params=list(MODELS))
def captured(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Captured:
    return capture(request.param, tmp_path_factory.mktemp(request.param))


def new_units(c: Captured) -> list[tuple[str, ...]]:
    """The embeddings, norm scales and tied weights (not the linear layers)."""
    return [
        u
        for u in c.units
        if len(u) > 1
        or isinstance(c.model.get_submodule(u[0]), nn.Embedding)
        or is_norm(c.model.get_submodule(u[0]))
    ]


# -- the statistics ------------------------------------------------------------------------


def assert_closed_form(root: Path, c: Captured, tol: float = TOL) -> None:
    """The stored statistics of every layer are the closed-form ones, in their forms."""
    stored = load_curvature(root)
    assert set(stored) == {n for u in c.units for n in u}
    for name, expected in c.factors.items():
        stats = stored[name]
        assert stats.tokens.item() == expected.rows, name
        if expected.a is None:
            assert stats.a_sum.shape == (0,), name
        else:
            assert rel_error(stats.a_cov, expected.a) < tol, name
        assert rel_error(stats.g_cov, expected.s) < tol, name


def test_statistics_of_every_layer_type_equal_their_closed_forms(captured: Captured) -> None:
    """Embeddings keep the token counts (a diagonal ``A``) and ``S``; the head use of a
    tied weight a diagonal ``S``; norm scales one dense factor of their per-example
    gradients; the store names the tied units. No vocabulary-wide dense factor is built
    for an embedding or a head, tied or not: an untied head keeps the diagonal of its
    ``S`` too (its ``V x V`` is the opt-in ``curvature_head=True``)."""
    assert_closed_form(captured.store.root, captured)
    stored = load_curvature(captured.store.root)
    tied = [u for u in captured.units if len(u) > 1]
    assert read_set(captured.store.root).units == tied
    for name in (n for u in captured.units for n in u):
        module = captured.model.get_submodule(name)
        if isinstance(module, nn.Embedding):
            assert stored[name].a_sum.shape == (module.num_embeddings,), name
        if name.endswith("lm_head"):
            assert stored[name].g_sum.shape == (VOCAB,), name
    kinds = {type(captured.model.get_submodule(n)).__name__ for u in new_units(captured) for n in u}
    assert "Embedding" in kinds and any(k.endswith("Norm") for k in kinds)


CAPTURE_PLANS = {
    "two ranks": [(slice(0, 1), {"rank": 0}), (slice(1, None), {"rank": 1})],
    "resumed run": [(slice(0, 1), {}), (slice(1, None), {"append": True})],
    "trainer mean loss": [(slice(None), {"mean_loss": True})],
}


@pytest.mark.parametrize("plan", list(CAPTURE_PLANS))
def test_statistics_summed_over_ranks_resumes_and_loss_scales(
    captured: Captured, plan: str, tmp_path: Path
) -> None:
    """The same closed forms when the batches are captured as two ranks' parts, across a
    resumed capture, or under a trainer's mean loss (``g`` under the summed-loss
    convention)."""
    batches = train_batches()
    for part, options in CAPTURE_PLANS[plan]:
        capture_store(captured.model, batches[part], tmp_path, ALL, **options)
    assert_closed_form(tmp_path, captured, MEAN_LOSS_TOL if "mean" in plan else TOL)


def test_a_capture_session_plans_the_bytes_it_allocates(captured: Captured, tmp_path: Path) -> None:
    """Through a capture session (shapes from the memory plan) the statistics are the
    same, and the plan's statistics bytes are those of the running sums it allocates (a
    diagonal counted as a vector, a norm scale's one factor alone), from shapes alone:
    the plan of the model on the meta device is the same."""
    arch, tied = MODELS[captured.name]
    settings = CaptureSettings.from_options(store_dir=str(tmp_path), layers="all", curvature=True)
    session = CaptureSession(settings, model=captured.model, normalization=SummedLoss())
    assert session.curvature is not None
    for batch in train_batches():
        summed_loss(captured.model, batch).backward()
        sums = session.curvature._sums.values()
        assert session.plan.statistics_bytes() == sum(s.a_sum.nbytes + s.g_sum.nbytes for s in sums)
        session.step()
    session.end()
    captured.model.zero_grad(set_to_none=True)
    assert_closed_form(tmp_path, captured)
    inputs = PlanInputs(ALL)
    with torch.device("meta"):
        meta = tiny_causal_lm(arch, tie_word_embeddings=tied)
    assert plan_capture(meta, inputs).layers == session.plan.layers


# -- preconditioning and scores --------------------------------------------------------------


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_new_layer_types_are_preconditioned_by_dense_damped_solves(
    captured: Captured, method: str
) -> None:
    """Each embedding's, norm scale's and tied weight's preconditioned queries are
    ``C^{-1} vec(G_q)`` with ``C`` the dense damped curvature: K-FAC's Kronecker
    matrix (a tied weight's the sum of its two uses' terms, each factor damped on its
    own), EK-FAC's ``Q diag(Lambda + l) Q^T``. A tied weight's query is the sum of its two
    uses' query gradients: the gradient of the one parameter. Compared through their dots
    with the training gradients, as scoring takes them (EK-FAC may keep a query in its
    basis and rotate the training side instead): ``sum over uses <P G_q, G_z^use>``."""
    preconditioner = PRECONDITIONERS[method](0.1)
    preconditioner.fit(captured.store)
    assert preconditioner.tied_units == [u for u in captured.units if len(u) > 1]
    loaded = captured.queries.load_all().layers
    train = captured.store.load_all().layers
    units = new_units(captured)
    assert len(units) >= 5  # the embedding (or tied weight), and 2 norms per block
    for unit in units:
        side = preconditioner(unit[0], sum_of_uses([loaded[n] for n in unit])).materialize()
        assert side.dtype == torch.float64
        got = sum(preconditioner.train_side(n, train[n]).materialize() @ side.T for n in unit)
        expected = preconditioned(
            method,
            captured.model,
            unit,
            captured.factors,
            captured.train[unit],
            captured.query[unit],
        )
        assert rel_error(got, captured.train[unit] @ expected.T) < TOL, unit


SCORINGS = {
    "default": {},
    # one layer group per layer (a tied weight's two uses kept in one), no query cache,
    # one training example a chunk
    "tight": {
        "tda_plugins.methods.base.SCORE_GROUP_BYTES": 1,
        "tda_plugins.methods.base.QUERY_CACHE_BYTES": 0,
    },
}
#: EK-FAC's routes besides the default (the rotated training gradients kept from the
#: correction): the store read again, queries rotated back or left in the basis.
EKFAC_ROUTES = {"stored": ekfac_routes.stored, "eigenbasis": ekfac_routes.prefer_the_eigenbasis}


@pytest.mark.parametrize(
    ("method", "scoring"),
    [(m, s) for m in ("kfac", "ekfac") for s in SCORINGS] + [("ekfac", r) for r in EKFAC_ROUTES],
)
def test_scores_on_all_layers_equal_the_dense_reference(
    captured: Captured, method: str, scoring: str
) -> None:
    """K-FAC and EK-FAC scores over every layer equal the sum over parameters of
    ``vec(G_z) . C^{-1} vec(G_q)`` from oracle gradients (a tied weight's gradient and
    curvature once, for both its uses); also scored layer by layer with nothing cached,
    and EK-FAC through each route: its rotated training gradients kept from the
    correction, read again from the store, or read again and scored in its basis (the
    training gradients of each use rotated)."""
    patches = [mock.patch(target, value) for target, value in SCORINGS.get(scoring, {}).items()]
    if scoring in EKFAC_ROUTES:
        patches.append(EKFAC_ROUTES[scoring]())
    chunk = 1 if scoring == "tight" else None
    method_ = method_by_name(method)
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        scores = method_.score(captured.store, captured.queries, chunk)
    names = set(captured.store.layer_names)
    if method == "ekfac":
        kept = method_.preconditioner._kept
        assert kept == (set() if scoring in EKFAC_ROUTES else names)
        in_basis = method_.preconditioner._in_eigenbasis
        assert scoring != "eigenbasis" or in_basis == names
    ids = [s.load_all().example_ids for s in (captured.store, captured.queries)]
    got = scores_by_id(scores, *ids)
    assert rel_error(got, captured.scores(method)) < SCORE_TOL


@pytest.mark.parametrize("method", ["graddot", "tracin"])
def test_first_order_scores_count_a_tied_weight_once(captured: Captured, method: str) -> None:
    """GradDot (and TracIn at learning rate 1) over every layer equal the dot product of
    the oracle per-example gradients of every parameter, a tied weight's once: its two
    uses share one query side, so the terms between them are counted."""
    scores = method_by_name(method).score(captured.store, captured.queries)
    ids = [s.load_all().example_ids for s in (captured.store, captured.queries)]
    expected = sum(captured.train[u] @ captured.query[u].T for u in captured.units)
    assert rel_error(scores_by_id(scores, *ids), expected) < SCORE_TOL


@pytest.mark.parametrize(
    ("method", "options"), [("gradcos", {}), ("less", {}), ("graddot", {"normalize_layers": True})]
)
def test_per_layer_normalizing_methods_refuse_a_tied_weight(
    captured: Captured, method: str, options: dict[str, Any]
) -> None:
    """A method that normalizes or transforms each layer on its own cannot count a tied
    weight once: it refuses a store that holds both uses, with the way out."""
    tied = any(len(u) > 1 for u in captured.units)
    assert bool(captured.store.config.tied) == tied
    if not tied:
        return  # an untied model: nothing to refuse (GradCos is scored in test_methods.py)
    with pytest.raises(StoreError, match=r"share one weight.*capture one of the two uses"):
        method_by_name(method, **options).score(captured.store, captured.queries)


def test_live_graddot_counts_a_tied_weight_once_and_cosine_refuses_it(
    captured: Captured,
) -> None:
    """Live influence (``InfluenceLogger``) over every layer: GradDot equals the oracle
    dot of every parameter's gradient, a tied weight's once; a cosine, which would count
    the two uses apart, is refused when the logger attaches, before any step."""
    model = captured.model
    logger = InfluenceLogger("graddot")
    logger.on_attach(captured.store.config)
    logger.set_queries([capture_batch(model, b, layers=ALL) for b in query_batches()])
    logger.on_optimizer_step(0, [capture_batch(model, b, layers=ALL) for b in train_batches()])
    expected = sum(captured.train[u] @ captured.query[u].T for u in captured.units)
    assert rel_error(logger.history[0].scores.double(), expected) < SCORE_TOL
    if captured.store.config.tied:
        with pytest.raises(ValueError, match="share one weight"):
            InfluenceLogger("gradcos").on_attach(captured.store.config)


# -- LoGra -------------------------------------------------------------------------------------

LOGRA = ProjectionConfig(kind="factor", k_a=4, k_g=4)


def projected_side(name: str, side: str, width: int, k: int, like: Tensor) -> Tensor:
    """The capture's deterministic map of one factor side, or the identity where a side no
    wider than ``k`` is kept exact."""
    if k >= width:
        return torch.eye(width, dtype=like.dtype)
    return Projector(LOGRA).map_for(name, side, width, k).matrix(like)


@dataclass
class Projected:
    """A reference under :data:`LOGRA`: per unit the projected oracle gradients and
    factors, and which units are embeddings (then in the linear layout)."""

    units: list[tuple[str, ...]]
    train: dict[tuple[str, ...], Tensor]
    query: dict[tuple[str, ...], Tensor]
    factors: dict[str, Factors]
    embeddings: frozenset[tuple[str, ...]]

    def scores(self, model: nn.Module) -> Tensor:
        return reference_scores(
            "kfac", model, self.units, self.factors, self.train, self.query, self.embeddings
        )


def projected_reference(
    model: nn.Module,
    layers: list[str],
    train_data: list[dict[str, Tensor]],
    query_data: list[dict[str, Tensor]],
) -> Projected:
    """The oracle of an untied model's layers under :data:`LOGRA`: a linear layer's
    gradient ``P_g dW P_a^T`` and factors ``P_a A P_a^T``, ``P_g S P_g^T``; an embedding's
    ``P_g dE^T P_a^T`` and ``P_a diag(counts / rows) P_a^T``, ``P_g S P_g^T``; a norm
    scale's as without projection."""
    units = units_of(model, layers)
    assert all(len(u) == 1 for u in units)
    train, query = unit_grads(model, train_data, units), unit_grads(model, query_data, units)
    factors = closed_form_factors(model, train_data, units, train, projected=True)
    embeddings = frozenset(u for u in units if isinstance(model.get_submodule(u[0]), nn.Embedding))
    for unit in units:
        name, f = unit[0], factors[unit[0]]
        if f.a is None:  # a norm scale: kept exact
            continue
        embedding = unit in embeddings
        a = torch.diag(f.a) if embedding else f.a
        p_a = projected_side(name, "a", a.shape[0], LOGRA.k_a, f.s)
        p_g = projected_side(name, "g", f.s.shape[0], LOGRA.k_g, f.s)
        factors[name] = Factors(p_a @ a @ p_a.T, p_g @ f.s @ p_g.T, f.rows)
        for grads in (train, query):
            g = grads[unit].view(-1, a.shape[0], f.s.shape[0])
            g = g.mT if embedding else g.view(-1, f.s.shape[0], a.shape[0])
            grads[unit] = (p_g @ g @ p_a.T).flatten(1)
    return Projected(units, train, query, factors, embeddings)


def test_logra_projects_embeddings_like_linear_layers_and_keeps_norm_scales_exact(
    tmp_path: Path,
) -> None:
    """Under factor projection (LoGra) an embedding is per-token factors like a linear
    layer's: its gradient is ``P_g dE^T P_a^T`` (``k_g x k_a``), its statistics
    ``P_a diag(counts / rows) P_a^T`` and ``P_g S P_g^T`` (dense, no vocabulary-wide
    factor); norm scales are kept exact, with the statistics of an exact capture. LoGra's
    scores over every layer equal the dense K-FAC reference on the projected oracle
    gradients and factors."""
    model = tiny_causal_lm("llama")
    store = capture_store(model, train_batches(), tmp_path / "train", ALL, LOGRA)
    queries = capture_store(model, query_batches(), tmp_path / "query", ALL, LOGRA, curvature=False)
    reference = projected_reference(model, store.layer_names, train_batches(), query_batches())
    stored = load_curvature(store.root)
    for name, f in reference.factors.items():
        stats = stored[name]
        if f.a is None:
            assert stats.a_sum.shape == (0,), name
        else:
            assert stats.a_sum.shape == f.a.shape and rel_error(stats.a_cov, f.a) < TOL, name
        assert rel_error(stats.g_cov, f.s) < TOL, name
    (embedding,) = reference.embeddings
    assert stored[embedding[0]].a_sum.shape == (LOGRA.k_a, LOGRA.k_a)
    scores = method_by_name("logra").score(store, queries)
    ids = [s.load_all().example_ids for s in (store, queries)]
    assert rel_error(scores_by_id(scores, *ids), reference.scores(model)) < SCORE_TOL


@pytest.mark.parametrize("method", ["logra", "ekfac", "graddot"])
def test_a_tied_weight_under_factor_projection_is_refused(tmp_path: Path, method: str) -> None:
    """Each use of a tied weight is projected with its own maps, so the two projected
    gradients do not add up to one projected gradient of the weight, and the terms between
    the uses cannot be scored: every method refuses the store (GradDot summed the two
    uses' projected sides, cross terms in unrelated coordinates: 0.95 off the true dot),
    naming the weight and the ways out; with both uses left out of the scores it runs."""
    model = tiny_causal_lm("gpt2")
    store = capture_store(model, train_batches(), tmp_path / "train", ALL, LOGRA)
    assert {"transformer.wte", "lm_head"} <= set(store.layer_names)
    with pytest.raises(StoreError, match="projected with other maps at each use") as error:
        method_by_name(method).score(store, store)
    assert "transformer.wte and lm_head" in str(error.value)
    assert "capture without projection" in str(error.value)
    if method == "graddot":
        both = ("transformer.wte.weight", "lm_head.weight")
        scores = method_by_name(method, exclude_params=both).score(store, store)
        assert bool(torch.isfinite(scores.values).all())


class SharedWeightLM(nn.Module):
    """Embedding -> Linear(4, 4) -> Linear(4, 4) sharing the first's weight -> head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 4)
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)
        self.fc2.weight = self.fc1.weight
        self.head = nn.Linear(4, VOCAB, bias=False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Any:
        hidden = torch.tanh(self.fc2(torch.tanh(self.fc1(self.emb(input_ids)))))
        return SimpleNamespace(logits=self.head(hidden))


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_a_weight_tied_between_two_linear_layers_is_refused(tmp_path: Path, method: str) -> None:
    """Only an embedding tied to a linear head has a combined K-FAC form; a weight shared
    by two linear layers gets no statistics, and K-FAC/EK-FAC refuse the store naming it."""
    model = SharedWeightLM().double()
    store = capture_store(model, train_batches(), tmp_path, ALL)
    assert {"fc1", "fc2"} <= set(store.layer_names)
    with pytest.raises(StoreError, match="only an embedding tied to a linear head") as error:
        method_by_name(method).score(store, store)
    assert "'fc1'" in str(error.value)


# -- the command line --------------------------------------------------------------------------


def padded(sequences: list[list[int]]) -> dict[str, Tensor]:
    """One right-padded batch of ``sequences`` (pad 0, label -100)."""
    length = max(map(len, sequences))
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def sequences(ids: range, seed: int) -> dict[int, list[int]]:
    """Example id -> 3..12 random token ids (no padding token)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 13, (len(ids),), generator=gen).tolist()
    return {
        i: torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        for i, n in zip(ids, lengths, strict=True)
    }


def cli(*args: object) -> int:
    return main([str(a) for a in args])


@pytest.mark.slow
def test_cli_capture_all_layers_then_kfac_ekfac_and_logra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tda capture --layers all --curvature`` then ``tda attribute --method kfac|ekfac``
    on a tied GPT-2 (fp64), and ``--projection factor`` then ``--method logra`` on a
    Llama: the scores, keyed by the JSONL ids, equal the dense references over every
    layer; LoGra on the tied model's factor-projected store is refused (exit 2), naming
    the tied weight."""
    train, queries = sequences(range(100, 106), 1), sequences(range(900, 902), 2)
    for name, rows in (("train", train), ("queries", queries)):
        lines = [json.dumps({"input_ids": s, "id": i}) for i, s in rows.items()]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    data = [padded(list(rows.values())) for rows in (train, queries)]
    ids = [torch.tensor(list(rows)) for rows in (train, queries)]

    def capture_both(model: nn.Module, tag: str, *options: object) -> tuple[Path, Path]:
        model.save_pretrained(tmp_path / tag)
        common = ["--model", tmp_path / tag, "--dtype", "float64", "--layers", "all", *options]
        for name, extra in (("train", ["--curvature", "--batch-size", 4]), ("queries", [])):
            out = tmp_path / f"{tag}-{name}"
            assert (
                cli("capture", *common, "--data", tmp_path / f"{name}.jsonl", "--out", out, *extra)
                == 0
            )
        return tmp_path / f"{tag}-train", tmp_path / f"{tag}-queries"

    def attribute(store: Path, query_store: Path, method: str) -> Tensor:
        out = tmp_path / f"{store.name}-{method}"
        assert (
            cli(
                "attribute",
                "--store",
                store,
                "--queries",
                query_store,
                "--method",
                method,
                "--out",
                out,
            )
            == 0
        )
        saved = load_file(out / "scores.safetensors")
        return scores_by_id(
            Scores(saved["train_ids"], saved["query_ids"], saved["values"], method), *ids
        )

    gpt2 = tiny_causal_lm("gpt2")
    store, query_store = capture_both(gpt2, "gpt2")
    units = units_of(gpt2, StoreReader(store).layer_names)
    assert ("transformer.wte", "lm_head") in units
    grads = [unit_grads(gpt2, [batch], units) for batch in data]
    factors = closed_form_factors(gpt2, data[:1], units, grads[0])
    for method in ("kfac", "ekfac"):
        expected = reference_scores(method, gpt2, units, factors, *grads)
        assert rel_error(attribute(store, query_store, method), expected) < SCORE_TOL, method

    projected = capture_both(gpt2, "gpt2-logra", "--projection", "factor", "--k-a", 4, "--k-g", 4)
    options = ["--store", projected[0], "--queries", projected[1], "--out", tmp_path / "refused"]
    assert cli("attribute", *options, "--method", "logra") == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "transformer.wte" in error and "capture without projection" in error

    llama = tiny_causal_lm("llama")
    store, query_store = capture_both(
        llama, "llama", "--projection", "factor", "--k-a", 4, "--k-g", 4
    )
    reference = projected_reference(llama, StoreReader(store).layer_names, data[:1], data[1:])
    assert rel_error(attribute(store, query_store, "logra"), reference.scores(llama)) < SCORE_TOL
