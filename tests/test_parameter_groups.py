"""Parameter groups (docs/design.md section 7.10): scores with parameters left out, or with
each layer unit-normalized, equal the same formulas on brute-force per-example gradients.

The references never touch the engine or the methods: per-example gradients come from one
backward per example (:func:`tests.oracle.loop_oracle`) of every parameter of the captured
layers; the test leaves parameters out by its own rule on their names (not the patterns'
matcher), groups the rest by layer and writes the dot, the cosine, the per-layer
normalization, the TracIn sum and the Adam update in plain torch. Every case is scored
from a store that keeps per-token factors and from one that keeps the smaller form (the
LoRA layers, with their biases, and the norms are then materialized), with the cost model
free and with each route forced.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import Tensor, nn

from tda_plugins import CaptureEngine, LayerSelection, ProjectionConfig
from tda_plugins.capture import content_hash
from tda_plugins.capture.adapters.base import DEFAULT_REGISTRY
from tda_plugins.cli import main
from tda_plugins.grads import DenseGrad, Route, TokenFactors
from tda_plugins.grads import routing as routing_module
from tda_plugins.grads.parameters import ParameterLayout, keep_parameters
from tda_plugins.live.influence import InfluenceLogger
from tda_plugins.methods import METHODS, Checkpoint, Scores, method_by_name
from tda_plugins.precondition.adam import save_adam_state
from tda_plugins.session.batch import capture_batch
from tda_plugins.store import StoreReader
from tests.models import lm_batch, tiny_causal_lm
from tests.oracle import loop_oracle
from tests.stores import capture_store, label_tokens, rel_error, scores_by_id, summed_loss

REL_TOL = 1e-6
Batch = Mapping[str, Tensor]
TRAIN = (
    lm_batch(3, 10, lengths=(10, 7, 5), seed=1),
    lm_batch(3, 10, lengths=(9, 10, 6), seed=2),
)
QUERIES = (lm_batch(2, 8, lengths=(8, 5), seed=3),)
#: A parameter's layer and its name within the layer -> whether the test leaves it out.
Rule = Callable[[str, str], bool]


# -- the oracle ------------------------------------------------------------------------------


def example_ids(batches: Sequence[Batch]) -> Tensor:
    return torch.cat([content_hash(b["input_ids"], b["attention_mask"]) for b in batches])


def oracle_layers(
    model: nn.Module, batches: Sequence[Batch], layers: Sequence[str]
) -> dict[str, dict[str, Tensor]]:
    """Layer -> its direct trainable parameters' ``(N, numel)`` fp64 per-example gradients,
    one backward per example."""
    params = {
        layer: [n for n, p in model.get_submodule(layer).named_parameters(recurse=False)]
        for layer in layers
    }
    names = [f"{layer}.{local}" for layer, locals_ in params.items() for local in locals_]
    parts = [loop_oracle(model, batch, names) for batch in batches]
    flat = {n: torch.cat([p[n] for p in parts]).flatten(1).double() for n in names}
    return {layer: {lo: flat[f"{layer}.{lo}"] for lo in los} for layer, los in params.items()}


def kept(grads: dict[str, dict[str, Tensor]], excluded: Rule) -> dict[str, Tensor]:
    """Per layer, its kept parameters' gradients side by side; layers that keep none left out."""
    out = {}
    for layer, params in grads.items():
        columns = [g for name, g in params.items() if not excluded(layer, name)]
        if columns:
            out[layer] = torch.cat(columns, dim=1)
    return out


def unit_rows(x: Tensor) -> Tensor:
    norms = x.norm(dim=1, keepdim=True)
    return x / torch.where(norms > 0, norms, torch.ones_like(norms))


def expected_scores(
    train: dict[str, Tensor], query: dict[str, Tensor], method: str, normalize_layers: bool
) -> Tensor:
    """GradDot (the sum over layers of the dots) or GradCos (the cosine of the layers side
    by side), each layer unit-normalized per example first where asked."""
    each = unit_rows if normalize_layers else (lambda x: x)
    t = torch.cat([each(train[n]) for n in train], dim=1)
    q = torch.cat([each(query[n]) for n in train], dim=1)
    if method == "gradcos":
        t, q = unit_rows(t), unit_rows(q)
    return t @ q.T


# -- cases -----------------------------------------------------------------------------------


def lora_with_bias() -> nn.Module:
    """LoRA r=4 on every linear of a tiny Llama, ``lora_B`` with a bias; B non-zero."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, lora_bias=True
    )
    model = get_peft_model(tiny_causal_lm("llama"), config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


@dataclass(frozen=True)
class Case:
    """A model, its captured layers, and a layer pattern with the test's own rule for it."""

    build: Callable[[], nn.Module]
    layers: LayerSelection | None
    layer_pattern: str
    layer_rule: Callable[[str], bool]


CASES = {
    # nn.Linear with a bias (q/k/v) and without (o, MLP, lm_head)
    "qwen2-linear": Case(
        lambda: tiny_causal_lm("qwen2"), None, "*.self_attn.*", lambda n: ".self_attn." in n
    ),
    # GPT-2 Conv1D (weight (N_i, N_o), bias), LayerNorm weight + bias, position embedding
    "gpt2-all": Case(
        lambda: tiny_causal_lm("gpt2"),
        LayerSelection("all", exclude="wte|lm_head"),
        "*.ln_*",
        lambda n: ".ln_" in n,
    ),
    # LoRA A (no bias) and B (bias): stored materialized unless per-token factors are kept
    "lora-bias": Case(lora_with_bias, None, "*lora_A*", lambda n: "lora_A" in n),
}


@dataclass
class Captured:
    store: StoreReader
    queries: StoreReader
    train: dict[str, dict[str, Tensor]]
    query: dict[str, dict[str, Tensor]]
    case: Case


@pytest.fixture(scope="module", params=list(CASES))
def case_model(request: pytest.FixtureRequest) -> tuple[str, nn.Module]:
    return request.param, CASES[request.param].build()


@pytest.fixture(scope="module", params=["factors", "smaller-form"])
def captured(
    request: pytest.FixtureRequest,
    case_model: tuple[str, nn.Module],
    tmp_path_factory: pytest.TempPathFactory,
) -> Captured:
    name, model = case_model
    case = CASES[name]
    root = tmp_path_factory.mktemp(f"{name}-{request.param}")
    tokens = request.param == "factors"
    store = capture_store(model, TRAIN, root / "train", case.layers, None, tokens, False)
    queries = capture_store(model, QUERIES, root / "queries", case.layers, None, tokens, False)
    return Captured(
        store,
        queries,
        oracle_layers(model, TRAIN, store.layer_names),
        oracle_layers(model, QUERIES, store.layer_names),
        case,
    )


def exclusions(case: Case) -> dict[str, tuple[tuple[str, ...], Rule]]:
    """Pattern sets and the test's rule for each (``()``: nothing left out)."""
    return {
        "none": ((), lambda layer, name: False),
        "bias": (("bias",), lambda layer, name: name == "bias"),
        "weight": (("weight",), lambda layer, name: name == "weight"),
        "bias+layers": (
            ("bias", case.layer_pattern),
            lambda layer, name: name == "bias" or case.layer_rule(layer),
        ),
    }


@contextmanager
def forced(route: Route | None) -> Iterator[list[Route]]:
    """Every routed operation of scoring takes ``route`` where it exists (``None``: the
    cost model decides); yields the routes taken."""
    taken: list[Route] = []

    def choose(costs: dict[Route, float], forced_route: Route | None = None) -> Route:
        chosen = route if route in costs else routing_module.choose_route(costs, forced_route)
        taken.append(chosen)
        return chosen

    with mock.patch("tda_plugins.grads.ops.choose_route", side_effect=choose):
        yield taken


def score(c: Captured, method: str, **options: object) -> Tensor:
    scores = method_by_name(method, **options).score(c.store, c.queries)
    return scores_by_id(scores, example_ids(TRAIN), example_ids(QUERIES))


# -- scores against the oracle ---------------------------------------------------------------


@pytest.mark.parametrize("route", [None, Route.FACTORIZED, Route.MATERIALIZED])
@pytest.mark.parametrize("method", ["graddot", "gradcos"])
def test_groups_equal_the_oracle_on_every_route(
    captured: Captured, method: str, route: Route | None
) -> None:
    """GradDot and GradCos with parameters left out (the biases; the weights, which leaves
    the biases alone; the biases and the layers a pattern names), with and without
    per-layer normalization, equal the formulas on the oracle gradients of the kept
    parameters: on factors and materialized stores, with the route free or forced."""
    # a store of materialized layers only (LoRA's smaller form) has no factorized route
    stored = captured.store.load_all().layers.values()
    available = {Route.MATERIALIZED} | {
        Route.FACTORIZED for g in stored if isinstance(g, TokenFactors)
    }
    checked = 0
    for patterns, rule in exclusions(captured.case).values():
        train, query = kept(captured.train, rule), kept(captured.query, rule)
        for normalize_layers in (False, True):
            if not patterns and not normalize_layers:
                continue
            expected = expected_scores(train, query, method, normalize_layers)
            with forced(route) as taken:
                got = score(
                    captured, method, exclude_params=patterns, normalize_layers=normalize_layers
                )
            assert rel_error(got, expected) <= REL_TOL, (patterns, normalize_layers)
            assert route not in available or route in taken
            checked += 1
    assert checked == 7
    # the biases weigh enough here that leaving them out changes the scores
    nothing, no_bias = exclusions(captured.case)["none"][1], exclusions(captured.case)["bias"][1]
    everything = expected_scores(
        kept(captured.train, nothing), kept(captured.query, nothing), method, False
    )
    without = expected_scores(
        kept(captured.train, no_bias), kept(captured.query, no_bias), method, False
    )
    assert rel_error(without, everything) > 1e-3


def test_tracin_sums_the_groups_over_checkpoints(tmp_path: Path) -> None:
    """TracIn with the biases left out and every layer normalized, over two checkpoints
    (before and after an SGD step), is ``lr1 dot1 + lr2 dot2`` of the oracle's kept,
    per-layer-normalized gradients at each checkpoint's weights."""
    model = tiny_causal_lm("qwen2")
    rule: Rule = lambda layer, name: name == "bias"  # noqa: E731
    stores, dots = [], []
    for name in ("before", "after"):
        if name == "after":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            (summed_loss(model, TRAIN[0]) / label_tokens(TRAIN[0])).backward()
            optimizer.step()
            model.zero_grad(set_to_none=True)
        store = capture_store(model, TRAIN, tmp_path / name, curvature=False)
        queries = capture_store(model, QUERIES, tmp_path / f"{name}-q", curvature=False)
        stores.append((store, queries))
        train = kept(oracle_layers(model, TRAIN, store.layer_names), rule)
        query = kept(oracle_layers(model, QUERIES, store.layer_names), rule)
        dots.append(expected_scores(train, query, "graddot", True))
    assert rel_error(dots[1], dots[0]) > 1e-3, "the SGD step barely changed the scores"
    lr1, lr2 = 0.3, 0.05
    tracin = method_by_name(
        "tracin",
        learning_rate=lr1,
        extra=(Checkpoint(*stores[1], lr2),),
        exclude_params=("bias",),
        normalize_layers=True,
    )
    got = scores_by_id(tracin.score(*stores[0]), example_ids(TRAIN), example_ids(QUERIES))
    assert rel_error(got, lr1 * dots[0] + lr2 * dots[1]) <= REL_TOL


@pytest.mark.parametrize("normalize_layers", [False, True])
def test_less_leaves_the_groups_out_of_the_adam_updates(
    tmp_path: Path, normalize_layers: bool
) -> None:
    """LESS with GPT-2's Conv1D biases left out: the cosine between each example's Adam
    update (from a real AdamW state) and the plain query gradient, over the weights only
    (each layer normalized first where asked)."""
    model = tiny_causal_lm("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), eps=1e-6)
    for batch in TRAIN * 2:
        optimizer.zero_grad()
        (summed_loss(model, batch) / label_tokens(batch)).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    store = capture_store(model, TRAIN, tmp_path / "train", curvature=False)
    queries = capture_store(model, QUERIES, tmp_path / "queries", curvature=False)
    with CaptureEngine(model) as engine:
        save_adam_state(store.root, engine, optimizer)
    params = dict(model.named_parameters())
    (b1, b2), eps = optimizer.param_groups[0]["betas"], optimizer.param_groups[0]["eps"]
    grads = oracle_layers(model, TRAIN, store.layer_names)
    updates: dict[str, dict[str, Tensor]] = {}
    for layer, per_param in grads.items():
        updates[layer] = {}
        for local, g in per_param.items():
            state = optimizer.state[params[f"{layer}.{local}"]]
            t = int(state["step"]) + 1
            m = (b1 * state["exp_avg"].double().flatten() + (1 - b1) * g) / (1 - b1**t)
            v = (b2 * state["exp_avg_sq"].double().flatten() + (1 - b2) * g**2) / (1 - b2**t)
            updates[layer][local] = m / (v.sqrt() + eps)
    rule: Rule = lambda layer, name: name == "bias"  # noqa: E731
    query = kept(oracle_layers(model, QUERIES, store.layer_names), rule)
    expected = expected_scores(kept(updates, rule), query, "gradcos", normalize_layers)
    scores = method_by_name("less", exclude_params="bias", normalize_layers=normalize_layers).score(
        store, queries
    )
    got = scores_by_id(scores, example_ids(TRAIN), example_ids(QUERIES))
    assert rel_error(got, expected) <= REL_TOL


def test_live_influence_takes_the_groups(tmp_path: Path) -> None:
    """The influence logger, attached to a training engine with the biases left out and
    every layer normalized, scores each step's examples as the oracle formula does on
    the kept gradients (queries captured at the same, fixed weights)."""
    model = tiny_causal_lm("qwen2")
    rule: Rule = lambda layer, name: name == "bias"  # noqa: E731
    logger = InfluenceLogger("gradcos", exclude_params=("bias",), normalize_layers=True)
    with CaptureEngine(model, consumers=[logger]) as engine:
        layers = engine.layer_names
        for batch in TRAIN:
            logger.set_queries(capture_batch(model, QUERIES[0]))
            summed_loss(model, batch).backward()
            engine.optimizer_step()
            model.zero_grad(set_to_none=True)
    query = kept(oracle_layers(model, QUERIES, layers), rule)
    assert len(logger.history) == len(TRAIN)
    for step, batch in zip(logger.history, TRAIN, strict=True):
        train = kept(oracle_layers(model, [batch], layers), rule)
        assert torch.equal(step.example_ids, example_ids([batch]))
        expected = expected_scores(train, query, "gradcos", True)
        assert rel_error(step.scores, expected) <= 1e-5  # the logger keeps fp32 scores


def test_cli_exclude_params_and_layer_norm_end_to_end(
    captured: Captured, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tda attribute --exclude-params bias <layer pattern> --layer-norm`` writes the
    scores of the oracle formula; a pattern that matches nothing, and a curvature method
    given either option, end with exit code 2 and the reason, before any output."""
    store, queries = str(captured.store.root), str(captured.queries.root)
    patterns = ("bias", captured.case.layer_pattern)
    argv = ["attribute", "--store", store, "--queries", queries, "--method", "gradcos"]
    out = tmp_path / "scores"
    assert main([*argv, "--exclude-params", *patterns, "--layer-norm", "--out", str(out)]) == 0
    rule = exclusions(captured.case)["bias+layers"][1]
    expected = expected_scores(
        kept(captured.train, rule), kept(captured.query, rule), "gradcos", True
    )
    got = scores_by_id(Scores.load(out), example_ids(TRAIN), example_ids(QUERIES))
    assert rel_error(got, expected) <= REL_TOL
    capsys.readouterr()

    bad = tmp_path / "bad"
    assert main([*argv, "--exclude-params", "*.bais", "--out", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "'*.bais' matches no captured parameter" in err and "['bias', 'weight']" in err
    kfac = ["attribute", "--store", store, "--queries", queries, "--method", "kfac"]
    assert main([*kfac, "--layer-norm", "--out", str(bad)]) == 2
    assert "KFAC takes no exclude_params or normalize_layers" in capsys.readouterr().err
    assert not bad.exists()


# -- refusals --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[StoreReader, StoreReader]:
    root = tmp_path_factory.mktemp("qwen2")
    model = tiny_causal_lm("qwen2")
    return (
        capture_store(model, TRAIN, root / "train", curvature=False),
        capture_store(model, QUERIES, root / "queries", curvature=False),
    )


def test_a_pattern_that_matches_nothing_names_the_parameters(
    qwen2_stores: tuple[StoreReader, StoreReader],
) -> None:
    with pytest.raises(
        ValueError, match=r"'norm' matches no captured parameter.*\['bias', 'weight'\]"
    ):
        method_by_name("graddot", exclude_params=("bias", "norm")).score(*qwen2_stores)
    with pytest.raises(ValueError, match="every captured parameter"):
        method_by_name("gradcos", exclude_params="*").score(*qwen2_stores)
    with pytest.raises(ValueError, match="non-empty name patterns"):
        method_by_name("graddot", exclude_params=("bias", ""))


def test_a_tied_weight_is_left_out_whole_or_refused(tmp_path: Path) -> None:
    """GPT-2's head is its input embedding's weight: a pattern naming one use only is
    refused (it would have left the weight in, or dropped both uses, depending on the
    name); naming both leaves the weight out, as the oracle without it."""
    model = tiny_causal_lm("gpt2")
    every = LayerSelection("all")
    store = capture_store(model, TRAIN, tmp_path / "train", every, None, False, False)
    queries = capture_store(model, QUERIES, tmp_path / "queries", every, None, False, False)
    assert ("transformer.wte", "lm_head") in store.config.tied
    for one in ("lm_head.weight", "transformer.wte.weight"):
        with pytest.raises(ValueError, match=r"the same weight \(tied\).*add a pattern"):
            method_by_name("graddot", exclude_params=one).score(store, queries)
    both = ("lm_head.weight", "transformer.wte.weight")
    got = method_by_name("graddot", exclude_params=both).score(store, queries)
    layers = [n for n in store.layer_names if n not in ("lm_head", "transformer.wte")]
    train, query = oracle_layers(model, TRAIN, layers), oracle_layers(model, QUERIES, layers)
    keep_all: Rule = lambda layer, name: False  # noqa: E731
    expected = expected_scores(kept(train, keep_all), kept(query, keep_all), "graddot", False)
    values = scores_by_id(got, example_ids(TRAIN), example_ids(QUERIES))
    assert rel_error(values, expected) <= REL_TOL


@pytest.mark.parametrize("method", ["kfac", "ekfac", "logra"])
@pytest.mark.parametrize(
    "options", [{"exclude_params": ("bias",)}, {"normalize_layers": True}], ids=["exclude", "norm"]
)
def test_curvature_methods_refuse_groups(method: str, options: dict[str, object]) -> None:
    """K-FAC, EK-FAC and LoGra refuse both options when built, naming why (the bias is part
    of the input factor) and the methods that take them."""
    with pytest.raises(ValueError, match=r"input factor A.*graddot, gradcos, tracin or less"):
        method_by_name(method, **options)


def test_a_store_without_layouts_is_refused_unless_nothing_is_left_out(
    qwen2_stores: tuple[StoreReader, StoreReader], tmp_path: Path
) -> None:
    """A store written before layouts were recorded: leaving parameters out is refused with
    the way out; per-layer normalization alone needs no layout and still scores."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(qwen2_stores[0].root, old)
    header = json.loads((old / "store.json").read_text())
    del header["config"]["parameters"]
    (old / "store.json").write_text(json.dumps(header))
    with pytest.raises(ValueError, match="recapture it, or score without exclude_params"):
        method_by_name("graddot", exclude_params="bias").score(StoreReader(old), qwen2_stores[1])
    normalized = method_by_name("graddot", normalize_layers=True)
    got = normalized.score(StoreReader(old), qwen2_stores[1])
    assert torch.equal(got.values, normalized.score(*qwen2_stores).values)


def test_projected_stores_leave_out_whole_layers_only(tmp_path: Path) -> None:
    """Under factor projection a layer's bias is folded into its projected input, so leaving
    out part of a layer is refused; leaving out whole layers scores as a store captured
    without them (the projection maps depend on the layer's name, not on the others)."""
    model = tiny_causal_lm("qwen2")
    projection = ProjectionConfig(kind="factor", k_a=8, k_g=8)

    def stores(name: str, layers: LayerSelection | None) -> tuple[StoreReader, StoreReader]:
        return (
            capture_store(model, TRAIN, tmp_path / name, layers, projection, curvature=False),
            capture_store(
                model, QUERIES, tmp_path / f"{name}-q", layers, projection, curvature=False
            ),
        )

    full = stores("full", None)
    with pytest.raises(ValueError, match=r"projected.*leave out whole layers"):
        method_by_name("graddot", exclude_params="bias").score(*full)
    without = stores("without", LayerSelection("linear", exclude=r"self_attn"))
    got = method_by_name("graddot", exclude_params="*.self_attn.*").score(*full)
    expected = method_by_name("graddot").score(*without)
    assert rel_error(got.values, scores_by_id(expected, got.train_ids, got.query_ids)) <= REL_TOL


def test_live_influence_refuses_a_bad_pattern_when_it_attaches() -> None:
    """The logger's patterns are checked against the engine's layers when it attaches,
    before any micro-batch; one that is never attached refuses queries it cannot place."""
    model = tiny_causal_lm("llama")
    logger = InfluenceLogger("graddot", exclude_params=("bias",))
    with pytest.raises(ValueError, match=r"'bias' matches no captured parameter.*\['weight'\]"):
        CaptureEngine(model, consumers=[logger]).attach()
    assert not any(m._forward_hooks for m in model.modules())  # nothing left hooked
    with pytest.raises(ValueError, match="attach it to the engine"):
        logger.set_queries(capture_batch(model, QUERIES[0]))


# -- the layouts and the representations ------------------------------------------------------


def modules() -> dict[str, nn.Module]:
    from transformers.pytorch_utils import Conv1D

    bitfit = nn.Linear(5, 3)
    bitfit.weight.requires_grad_(False)
    return {
        "linear": nn.Linear(5, 3),
        "linear-no-bias": nn.Linear(5, 3, bias=False),
        "bitfit": bitfit,
        "conv1d": Conv1D(3, 5),
        "layernorm": nn.LayerNorm(4),
        "layernorm-no-bias": nn.LayerNorm(4, bias=False),
        "rmsnorm": nn.RMSNorm(4),
        "embedding": nn.Embedding(6, 4),
    }


@pytest.mark.parametrize("kind", list(modules()))
def test_each_adapter_layout_is_where_unflatten_reads_its_parameters(kind: str) -> None:
    """Every adapter's layout names the positions its own ``unflatten`` reads each
    parameter from: parameter ``p`` is columns ``[start, stop)`` of every row of width
    ``width``."""
    module = modules()[kind]
    adapter = DEFAULT_REGISTRY.lookup(module)
    assert adapter is not None
    layout = adapter.parameter_layout(module)
    dim = sum(p.numel() for p in adapter.captured_parameters(module).values())
    positions = adapter.unflatten(module, torch.arange(dim))
    assert set(positions) == set(layout.names) == set(adapter.captured_parameters(module))
    for name, start, stop in layout.columns:
        rows = torch.arange(dim).view(-1, layout.width)[:, start:stop]
        assert sorted(positions[name].flatten().tolist()) == sorted(rows.flatten().tolist())


def test_a_linear_layer_split_stays_per_token_factors() -> None:
    """Leaving out a linear layer's bias or weight keeps the captured factors (the same
    tensors, no copy): the weight alone is the factors without the appended 1, the bias
    alone the zero-width input with it; their materialized gradients are the columns."""
    gen = torch.Generator().manual_seed(0)
    grads = TokenFactors(
        torch.randn(3, 4, 5, generator=gen, dtype=torch.float64),
        torch.randn(3, 4, 2, generator=gen, dtype=torch.float64),
        bias=True,
    )
    layout = ParameterLayout(6, (("weight", 0, 5), ("bias", 5, 6)))
    full = grads.materialize().view(3, 2, 6)
    for names, columns in (
        (frozenset({"weight"}), slice(0, 5)),
        (frozenset({"bias"}), slice(5, 6)),
    ):
        part = keep_parameters(grads, layout, names)
        assert isinstance(part, TokenFactors)
        for mine, theirs in ((part.a, grads.a), (part.g, grads.g)):
            assert mine.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()
        assert torch.equal(part.materialize(), full[:, :, columns].flatten(1))
    assert keep_parameters(grads, layout, frozenset({"weight", "bias"})) is grads


def test_materialized_gradients_keep_the_columns_of_every_row() -> None:
    """Materialized gradients keep their kept parameters' columns of every row, in order,
    also when the kept parameters are not adjacent (a middle one left out)."""
    values = torch.arange(24, dtype=torch.float64).view(2, 12)  # 2 examples, rows of 4
    layout = ParameterLayout(4, (("a", 0, 1), ("b", 1, 2), ("c", 2, 4)))
    part = keep_parameters(DenseGrad(values), layout, frozenset({"a", "c"}))
    rows = values.view(2, 3, 4)
    assert torch.equal(part.materialize(), rows[:, :, [0, 2, 3]].flatten(1))
    with pytest.raises(ValueError, match="rows of 5"):
        keep_parameters(DenseGrad(values), ParameterLayout(5, (("w", 0, 5),)), frozenset())


# -- the trainer callbacks --------------------------------------------------------------------


def test_hf_influence_callback_scores_the_groups_as_offline(tmp_path: Path) -> None:
    """``InfluenceLoggingCallback(exclude_params=..., normalize_layers=True)`` in a real
    ``Trainer`` run (learning rate 0: fixed weights) logs per step the mean and max of the
    GradDot scores, with the same groups, of a store captured in the same run."""
    from datasets import Dataset
    from transformers import Trainer

    from tda_plugins.integrations.transformers import (
        GradientCaptureCallback,
        InfluenceLoggingCallback,
    )
    from tests.trainers import pad_rows, token_rows, training_args

    rows = [{"input_ids": r} for r in token_rows(8)]
    queries = [{"input_ids": r} for r in token_rows(2, seed=9)]
    model = tiny_causal_lm("qwen2", torch.float32)
    groups = {"exclude_params": ("bias", "*.o_proj.*"), "normalize_layers": True}
    influence = InfluenceLoggingCallback(
        queries=queries, method="graddot", layers="linear", **groups
    )
    capture = GradientCaptureCallback(store_dir=str(tmp_path / "store"), layers="linear")
    args = training_args(
        tmp_path / "out", learning_rate=0.0, max_steps=4, logging_strategy="steps", logging_steps=1
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        data_collator=pad_rows,
        callbacks=[capture, influence],
    )
    trainer.train()
    query_store = capture_store(
        model, [pad_rows(queries)], tmp_path / "queries", LayerSelection("linear"), curvature=False
    )
    store = StoreReader(tmp_path / "store")
    scores = method_by_name("graddot", **groups).score(store, query_store)
    plain = method_by_name("graddot").score(store, query_store)
    assert rel_error(scores.values, plain.values) > 1e-2  # the groups matter here
    steps = store.load_all().steps
    logged = {h["step"]: h for h in trainer.state.log_history if "influence/q0_mean" in h}
    assert sorted(logged) == [1, 2, 3, 4]
    for step in range(4):
        values = scores.values[steps == step]
        for j in range(values.shape[1]):
            for stat, reference in (("mean", values[:, j].mean()), ("max", values[:, j].max())):
                got = logged[step + 1][f"influence/q{j}_{stat}"]
                assert got == pytest.approx(float(reference), rel=1e-4, abs=1e-6)


def test_hf_influence_callback_refuses_a_bad_pattern_before_any_step(tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import Trainer

    from tda_plugins.integrations.transformers import InfluenceLoggingCallback
    from tests.trainers import pad_rows, token_rows, training_args

    influence = InfluenceLoggingCallback(
        queries=[{"input_ids": r} for r in token_rows(1, seed=9)], exclude_params="bias"
    )
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(tmp_path / "out", max_steps=2),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(4)]),
        data_collator=pad_rows,
        callbacks=[influence],
    )
    with pytest.raises(ValueError, match=r"'bias' matches no captured parameter"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_olmo_core_influence_callback_takes_the_groups() -> None:
    """The OLMo-core callback hands its groups to the logger it scores with (resolved when
    its engine attaches, as the transformers callback's)."""
    from tda_plugins.integrations.olmo_core import InfluenceLoggingCallback

    callback = InfluenceLoggingCallback(
        queries=[[3, 4, 5]], exclude_params=("*.w_out.*",), normalize_layers=True
    )
    groups = callback.influence_log.groups
    assert (groups.exclude, groups.normalize_layers) == (("*.w_out.*",), True)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_takes_the_groups_or_refuses_them_by_name(name: str) -> None:
    """A registered method either takes ``exclude_params`` or refuses it with a
    ``ValueError`` naming why (the CLI's one-line error), never a bare ``TypeError``."""
    cls = METHODS[name]
    if cls.no_parameter_groups is None:
        assert method_by_name(name, exclude_params=("bias",)).groups.active
    else:
        with pytest.raises(ValueError, match="takes no exclude_params"):
            method_by_name(name, exclude_params=("bias",))
