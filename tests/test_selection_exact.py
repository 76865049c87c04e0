"""Online data selection is exact: after a step's selection, ``.grad`` is a fresh backward
over the kept examples alone, with the trainer's normalization.

The reference never touches the engine (``tests.selection_helpers``): one backward over
the kept examples of each micro-batch of ``sum_{kept} L_i / N_kept`` (``L_i`` an example's
summed token loss, ``N_kept`` the kept examples' label tokens). Which examples must be
kept is worked out independently too: each example's own gradient from the loop oracle
(one backward per unpadded example, ``tests.oracle``), scored against the oracle target
gradient, and the rule applied by hand. Covered:

1. The core without a trainer (fp64, tiny Llama and GPT-2, padded batches): full
   fine-tuning (``kind="all"``, GPT-2's tied ``lm_head``/``wte`` captured twice) and LoRA,
   accumulation 1 and 4 with the trainer's ``/ N_window`` loss, every score mode (dot,
   cosine, Adam-preconditioned) x granularity (global, per layer) x rule; the global
   scores themselves; dropping nothing; dropping everything.
2. ``Trainer`` + ``DataSelectionCallback`` (fp32; full fine-tuning and LoRA; accumulation
   1 and 4) with clipping after selection, the JSONL log, the trainer's logs and
   ``max_grad_norm`` restored; TRL ``SFTTrainer`` + LoRA; refusals before step 0.

Data parallelism is covered by ``tests/test_hf_distributed.py`` (DDP, FSDP2) and
``tests/test_olmo_core_distributed.py`` (OLMo-core DDP, FSDP, HSDP).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from torch import Tensor, nn
from transformers import Trainer, TrainerCallback

from tda_plugins import CaptureEngine, LayerSelection, ProjectionConfig
from tda_plugins.capture import MicroBatchRecord
from tda_plugins.data_selection import DataSelector, StepSelection, rule_by_name
from tda_plugins.data_selection import selector as selector_module
from tda_plugins.data_selection.target import target_gradient
from tda_plugins.grads import Route
from tda_plugins.integrations.transformers import DataSelectionCallback
from tda_plugins.integrations.transformers.selection import causal_lm_token_counts
from tda_plugins.session.batch import causal_lm_losses
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tests.models import lm_batch, tiny_causal_lm, with_lora
from tests.oracle import loop_oracle, max_rel_error
from tests.selection_helpers import (
    FP64_TOL,
    LENGTHS,
    PINNED,
    SelectionAudit,
    StepAudit,
    adam_step_metric,
    assert_trainer_grads_match_fresh,
    current_grads,
    example_losses,
    fresh_kept_gradient,
    label_counts,
    trainable,
)
from tests.stores import ManualScale
from tests.trainers import (
    FP32_TOL,
    FirstWeights,
    pad_rows,
    prompt_completion_pairs,
    token_rows,
    training_args,
    word_tokenizer,
)

EXAMPLES = len(LENGTHS)
MODELS = ("llama-full", "llama-lora", "gpt2-full", "gpt2-lora")
SCORES = ("dot", "cosine", "adam")
GRANULARITIES = ("global", "per_layer")
RULES = ("bottom_fraction", "threshold", "negative_in_bottom")
#: 0.45 * 8 = 3.6: the fraction rules consider floor = 3 examples, not round = 4.
FRACTION = 0.45


# -- 1. the core, fp64 ------------------------------------------------------------------


@dataclass
class Subject:
    """A tiny fp64 model, a step's 8 examples and a target batch, with the oracle's view:
    each example's own gradient and the target's summed gradient, per parameter."""

    model: nn.Module
    layers: LayerSelection | None
    optimizer: torch.optim.Adam | None
    window: dict[str, Tensor]
    target: dict[str, Tensor]
    per_example: dict[str, Tensor]
    target_grad: dict[str, Tensor]
    fresh_cache: dict[tuple, dict[str, Tensor]] = field(default_factory=dict)

    def micro_batches(self, accumulation: int) -> list[dict[str, Tensor]]:
        size = EXAMPLES // accumulation
        return [
            {k: v[j * size : (j + 1) * size] for k, v in self.window.items()}
            for j in range(accumulation)
        ]

    def layer_groups(self) -> dict[str, list[str]]:
        """Owning module -> its trainable parameter names (a captured layer each)."""
        groups: dict[str, list[str]] = {}
        for name in self.per_example:
            groups.setdefault(name.rsplit(".", 1)[0], []).append(name)
        return groups

    def preconditioner(self, name: str) -> Tensor | None:
        """Adam's ``1 / (sqrt(v_hat) + eps)`` for a parameter in the step it is about to
        take with the window's gradient ``sum_i g_i / N_window`` (the ``.grad`` scored)."""
        if self.optimizer is None:
            return None
        grad = self.per_example[name].sum(0) / self.window_tokens
        return adam_step_metric(self.optimizer, self.model.get_parameter(name), grad)

    def fresh(self, accumulation: int, keep: Tensor) -> dict[str, Tensor]:
        """:func:`fresh_kept_gradient` over the kept examples (``(8,)`` mask), cached."""
        key = (accumulation, tuple(keep.tolist()))
        if key not in self.fresh_cache:
            size = EXAMPLES // accumulation
            masks = [keep[j * size : (j + 1) * size] for j in range(accumulation)]
            self.fresh_cache[key] = fresh_kept_gradient(
                self.model, self.micro_batches(accumulation), masks, self.window_tokens
            )
        return self.fresh_cache[key]

    @property
    def window_tokens(self) -> float:
        """Label tokens of the step's 8 examples: the trainer's loss divides by this."""
        return float(label_counts(self.window).sum())

    def row_grads(self, accumulation: int) -> dict[str, Tensor]:
        """``(8, *shape)`` per parameter: the terms of the fresh backward, one per example
        (``L_i / N_window``, taken in its own padded micro-batch; cached). By linearity of
        the backward, the fresh backward over a kept set ``K`` is their sum over ``K``
        times ``N_window / N_K``: per-layer selection needs one fresh gradient per distinct
        kept set, and this gives them all from 8 backward passes
        (:func:`test_row_terms_sum_to_the_fresh_backward`)."""
        key = ("rows", accumulation)
        if key not in self.fresh_cache:
            params = list(trainable(self.model).items())
            rows: list[tuple[Tensor, ...]] = []
            for batch in self.micro_batches(accumulation):
                losses = example_losses(self.model, batch) / self.window_tokens
                for loss in losses:
                    rows.append(
                        torch.autograd.grad(loss, [p for _, p in params], retain_graph=True)
                    )
            self.fresh_cache[key] = {
                n: torch.stack([r[j] for r in rows]) for j, (n, _) in enumerate(params)
            }
        return self.fresh_cache[key]

    def fresh_by_rows(self, accumulation: int, keep: Tensor) -> dict[str, Tensor]:
        """The fresh backward over ``keep`` from :meth:`row_grads`."""
        rescale = self.window_tokens / float(label_counts(self.window)[keep].sum())
        return {n: g[keep].sum(0) * rescale for n, g in self.row_grads(accumulation).items()}


def build_model(spec: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    """``"<arch>-full"`` or ``"<arch>-lora"`` (default LoRA on every linear)."""
    arch, kind = spec.split("-")
    model = tiny_causal_lm(arch, dtype)
    return with_lora(model) if kind == "lora" else model


def capture_layers(spec: str) -> LayerSelection | None:
    """Full fine-tuning captures every layer; LoRA the default selection (its adapters)."""
    return LayerSelection("all") if spec.endswith("-full") else None


@functools.cache
def subject(spec: str, adam: bool = False) -> Subject:
    """Cached per model and optimizer: with ``adam``, one Adam step has run on another
    batch first, so that the optimizer holds moments (and the weights moved)."""
    model = build_model(spec)
    optimizer = None
    if adam:
        optimizer = torch.optim.Adam(trainable(model).values(), lr=1e-3)
        warmup = lm_batch(4, 10, lengths=(10, 6, 8, 9), seed=3)
        (example_losses(model, warmup).sum() / label_counts(warmup).sum()).backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
    window = lm_batch(EXAMPLES, 10, lengths=LENGTHS, seed=1)
    # 16 target tokens: for some layers the factors are the smaller form of the target
    # (scored by the ghost dot), for others the vector (both routes below)
    target = lm_batch(2, 8, lengths=(8, 5), seed=2)
    names = list(trainable(model))
    per_example = loop_oracle(model, window, names)
    target_grad = {n: g.sum(0) for n, g in loop_oracle(model, target, names).items()}
    return Subject(model, capture_layers(spec), optimizer, window, target, per_example, target_grad)


@dataclass
class Outcome:
    """One optimizer step through the engine and a ``DataSelector``."""

    before: dict[str, Tensor]
    after: dict[str, Tensor]
    selection: StepSelection
    layer_names: list[str]
    factor_layers: list[str]
    materialized: list[set[str]]
    linear_layers: set[str]
    workspace_bytes: int


class RecordingSelector(DataSelector):
    """A :class:`DataSelector` that remembers which layers each step materialized."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.materialized: list[set[str]] = []

    def materialized_layers(self, records: list[MicroBatchRecord]) -> set[str]:
        self.materialized.append(super().materialized_layers(records))
        return self.materialized[-1]


def run_step(
    s: Subject,
    accumulation: int,
    rule: str,
    options: dict[str, float],
    score: str = "dot",
    granularity: str = "global",
    route: Route | None = None,
    steps: int = 1,
) -> Outcome:
    """The trainer's step, by hand: the target captured with the engine paused, then per
    micro-batch ``sum of its summed losses / N_window`` backpropagated (the engine told
    ``loss_scale = N_window``), then ``engine.optimizer_step()``; ``.grad`` before and
    after the selection (of the last of ``steps`` such steps, each on the same window
    and target, with no optimizer step between them)."""
    micro_batches = s.micro_batches(accumulation)
    normalization = ManualScale()
    normalization.value = s.window_tokens
    with CaptureEngine(s.model, layers=s.layers, normalization=normalization) as engine:
        selector = RecordingSelector(
            engine.captured_layers,
            rule=rule_by_name(rule, **options),
            token_counts=causal_lm_token_counts,
            score=score,  # type: ignore[arg-type]
            granularity=granularity,  # type: ignore[arg-type]
            optimizer=s.optimizer,
            route=route,
        )
        engine.add_consumer(selector)
        with engine.paused():
            selector.set_target(
                target_gradient(s.model, engine.captured_layers, s.target, causal_lm_losses)
            )
        for _ in range(steps):
            s.model.zero_grad(set_to_none=True)
            first = 0
            for batch in micro_batches:
                size = batch["input_ids"].shape[0]
                engine.set_example_ids(torch.arange(first, first + size))
                first += size
                (example_losses(s.model, batch).sum() / normalization.value).backward()
            before = current_grads(s.model)
            engine.optimizer_step()
            after = current_grads(s.model)
        layer_names = engine.layer_names
        linear = {n for n, (_, a) in engine.captured_layers.items() if a.family == "linear"}
    s.model.zero_grad(set_to_none=True)
    assert len(selector.history) == steps and selector.target is not None
    factor_layers = list(selector.target.factors)
    return Outcome(
        before,
        after,
        selector.history[-1],
        layer_names,
        factor_layers,
        selector.materialized,
        linear,
        selector.workspace.nbytes(),
    )


def oracle_scores(s: Subject, score: str, names: list[str]) -> Tensor:
    """``(8,)`` each example's score over the parameters ``names``, from the oracle:
    ``<g_i, T>``, ``<g_i, T> / (|g_i| |T|)`` or ``<g_i, T / (sqrt(v_hat) + eps)>``."""
    dot = torch.zeros(EXAMPLES, dtype=torch.float64)
    g_sq = torch.zeros(EXAMPLES, dtype=torch.float64)
    t_sq = torch.zeros((), dtype=torch.float64)
    for name in names:
        g, t = s.per_example[name].flatten(1), s.target_grad[name].flatten()
        pre = s.preconditioner(name) if score == "adam" else None
        dot += g @ (t if pre is None else t * pre.flatten())
        g_sq += g.pow(2).sum(1)
        t_sq += t.pow(2).sum()
    return dot / (g_sq.sqrt() * t_sq.sqrt()) if score == "cosine" else dot


def rule_keep(scores: Tensor, rule: str, option: float) -> Tensor:
    """The rule by hand: ``(N,)`` kept mask. Fractions consider the ``floor(f N)`` lowest;
    an empty kept set keeps the best-scoring example (``rules.py``)."""
    n = scores.shape[0]
    if rule == "threshold":
        dropped = {i for i in range(n) if scores[i] < option}
    else:
        lowest = sorted(range(n), key=lambda i: float(scores[i]))[: math.floor(option * n)]
        negative = rule == "negative_in_bottom"
        dropped = {i for i in lowest if scores[i] < 0 or not negative}
    keep = torch.tensor([i not in dropped for i in range(n)])
    if not keep.any():
        keep[int(torch.argmax(scores))] = True
    return keep


def rule_option(s: Subject, rule: str, score: str, granularity: str) -> float:
    """Fraction rules: :data:`FRACTION`. Threshold: globally, between the 3rd and 4th
    lowest oracle scores (3 dropped); per layer 0 (each layer drops its negatives)."""
    if rule != "threshold":
        return FRACTION
    if granularity == "per_layer":
        return 0.0
    ordered = oracle_scores(s, score, list(s.per_example)).sort().values
    return float(ordered[2] + ordered[3]) / 2


def _option_name(rule: str) -> str:
    return "value" if rule == "threshold" else "fraction"


def expected_keep(
    s: Subject, rule: str, option: float, score: str, granularity: str
) -> dict[str, Tensor]:
    """Parameter name -> ``(8,)`` kept mask: one global mask, or each layer's own."""
    if granularity == "global":
        keep = rule_keep(oracle_scores(s, score, list(s.per_example)), rule, option)
        return dict.fromkeys(s.per_example, keep)
    out = {}
    for names in s.layer_groups().values():
        keep = rule_keep(oracle_scores(s, score, names), rule, option)
        out.update(dict.fromkeys(names, keep))
    return out


def assert_grad_is_fresh_over_kept(
    s: Subject, outcome: Outcome, accumulation: int, keep: Tensor | dict[str, Tensor]
) -> None:
    """Every trainable ``.grad`` equals the fresh backward over the kept set: one ``(8,)``
    mask for all, or each parameter's own (its layer's; from :meth:`Subject.row_grads`)."""
    if isinstance(keep, Tensor):
        expected = s.fresh(accumulation, keep)
    else:
        expected = {n: s.fresh_by_rows(accumulation, mask)[n] for n, mask in keep.items()}
    error = max_rel_error(outcome.after, expected)
    assert error <= FP64_TOL, f".grad is {error:.2e} away from the fresh backward over kept"


#: How scoring and surgery read the gradients: the cost model's choice (here every linear
#: layer materialized once, the rest as captured), or each route forced on every layer.
ROUTES = {"routed": None, "factors": Route.FACTORIZED, "built-once": Route.MATERIALIZED}


def _core_cases() -> list[Any]:
    """Every model x accumulation x score x granularity x route; the rule turns with the
    route in a Latin square whose offset follows the accumulation and the score, so each
    rule meets every value of every other factor, and every (route, rule) pair meets both
    granularities and every model. The rule acts on the scores alone and the route on how
    they and the sums are computed, so the full rule x route product would run each case
    three times over to check no further interaction (378 cases against these 126)."""
    cases = []
    for spec in MODELS:
        for a, acc in enumerate((1, 4)):
            for s, score in enumerate(SCORES):
                for gran in GRANULARITIES:
                    # A tied weight would get two kept sets: refused
                    # (test_per_layer_refuses_a_tied_weight).
                    if spec == "gpt2-full" and gran == "per_layer":
                        continue
                    for r, route in enumerate(ROUTES):
                        rule = RULES[(r + a + s) % len(RULES)]
                        name = f"{spec}-ga{acc}-{score}-{gran}-{rule}-{route}"
                        cases.append(pytest.param(spec, acc, score, gran, rule, route, id=name))
    return cases


CORE_CASES = _core_cases()


def test_the_core_grid_meets_every_pair_of_factor_values() -> None:
    """What :func:`_core_cases` promises: the full product without the rule, each rule
    with every value of every other factor, and each (route, rule) pair with every model
    and both granularities (the tied GPT-2 per layer aside, refused)."""
    cases = [case.values for case in CORE_CASES]
    factors = (MODELS, (1, 4), SCORES, GRANULARITIES, RULES, tuple(ROUTES))
    without_rule = {(*c[:4], c[5]) for c in cases}
    refused = {
        c for c in itertools.product(*factors) if c[0] == "gpt2-full" and c[3] == "per_layer"
    }
    assert len(cases) == len(without_rule)
    assert without_rule == {(*c[:4], c[5]) for c in set(itertools.product(*factors)) - refused}
    for i, j in itertools.combinations(range(len(factors)), 2):
        met = {(c[i], c[j]) for c in cases}
        assert met >= {(a, b) for a, b in itertools.product(factors[i], factors[j])} - {
            ("gpt2-full", "per_layer")
        }, (i, j)
    for k, values in ((0, MODELS), (3, GRANULARITIES)):
        met = {(c[4], c[5], c[k]) for c in cases}
        assert met == set(itertools.product(RULES, ROUTES, values))


@pytest.mark.parametrize("spec, accumulation, score, granularity, rule, route", CORE_CASES)
def test_grad_after_selection_is_a_fresh_backward_over_the_kept_examples(
    spec: str, accumulation: int, score: str, granularity: str, rule: str, route: str
) -> None:
    """The engine's selection keeps exactly the examples the rule picks from the oracle's
    scores (per layer: each layer its own), and every trainable ``.grad`` then equals the
    fresh backward over those kept examples (per layer: over that layer's kept set),
    normalized by their own label tokens, within fp64 rounding: whether scores and sums
    read the captured factors or per-example gradients built once."""
    s = subject(spec, adam=score == "adam")
    option = rule_option(s, rule, score, granularity)
    options = {_option_name(rule): option}
    outcome = run_step(s, accumulation, rule, options, score, granularity, ROUTES[route])
    expected_routes = {
        "factors": set(),
        "built-once": set(outcome.layer_names),
        "routed": outcome.linear_layers,
    }
    assert outcome.materialized == [expected_routes[route]]
    keep = expected_keep(s, rule, option, score, granularity)
    masks = torch.stack(list(keep.values()))
    assert not masks.all(), "the case is vacuous: the rule drops nothing anywhere"
    assert outcome.selection.example_ids.tolist() == list(range(EXAMPLES))

    if granularity == "global":
        # The surgery first, on the kept set the selector chose; then that choice.
        assert_grad_is_fresh_over_kept(s, outcome, accumulation, ~outcome.selection.dropped)
        assert outcome.selection.dropped.tolist() == (~masks[0]).tolist()
        return
    assert sorted(outcome.layer_names) == sorted(s.layer_groups())
    assert len({tuple(m.tolist()) for m in masks}) > 1, "per-layer sets all coincide"
    assert outcome.selection.dropped.tolist() == (~masks).any(0).tolist()
    assert_grad_is_fresh_over_kept(s, outcome, accumulation, keep)


@pytest.mark.parametrize("spec", ["llama-lora", "gpt2-full"])
def test_row_terms_sum_to_the_fresh_backward(spec: str) -> None:
    """The per-layer reference is sound: summing :meth:`Subject.row_grads` over a kept set
    gives the fresh backward over those examples alone (fp64 rounding apart)."""
    s = subject(spec)
    for keep in (torch.tensor([1, 0, 1, 1, 0, 0, 1, 1]).bool(), torch.ones(EXAMPLES).bool()):
        assert max_rel_error(s.fresh_by_rows(4, keep), s.fresh(4, keep)) <= 1e-13


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("spec", MODELS)
def test_global_scores_are_each_examples_gradient_against_the_target(spec: str, score: str) -> None:
    """The step's recorded scores are the oracle's ``<g_i, T>`` (cosine: over the norms;
    adam: ``T`` preconditioned by Adam's ``1 / (sqrt(v_hat) + eps)`` of the step the
    window's gradient is about to take), with
    ``g_i`` and ``T`` each parameter's full gradient: for a tied weight (GPT-2's
    ``lm_head``/``wte``) the sum of both layers' contributions, cross terms included.
    Scores are kept in fp32."""
    s = subject(spec, adam=score == "adam")
    outcome = run_step(s, 4, "bottom_fraction", {"fraction": FRACTION}, score)
    expected = oracle_scores(s, score, list(s.per_example))
    error = ((outcome.selection.scores.double() - expected).norm() / expected.norm()).item()
    assert error <= 1e-5, f"scores are {error:.2e} (relative) away from the oracle's"


@pytest.mark.parametrize("spec", ["llama-full", "gpt2-full"])
def test_the_target_scores_some_layers_by_its_factors(spec: str) -> None:
    """The subjects' target is the smaller form as factors for some layers and not for
    others, so the score and removal tests cover both routes of ``dots_with``; a tied
    weight (GPT-2's ``lm_head``/``wte``) is scored by its whole-parameter vector."""
    s = subject(spec)
    outcome = run_step(s, 1, "bottom_fraction", {"fraction": FRACTION})
    assert 0 < len(outcome.factor_layers) < len(outcome.layer_names)
    tied = s.model.get_output_embeddings().weight is s.model.get_input_embeddings().weight
    assert tied == spec.startswith("gpt2")
    assert ("lm_head" in outcome.factor_layers) != tied


@pytest.mark.parametrize("spec", MODELS)
@pytest.mark.parametrize(
    "rule, options",
    [("threshold", {"value": -math.inf}), ("bottom_fraction", {"fraction": 0.0})],
    ids=["threshold-inf", "fraction0"],
)
def test_dropping_nothing_leaves_grad_unchanged(
    spec: str, rule: str, options: dict[str, float]
) -> None:
    """A rule that drops no example leaves every ``.grad`` bit for bit as the backward
    left it (accumulation 4), and the step records no dropped example."""
    s = subject(spec)
    outcome = run_step(s, 4, rule, options)
    assert not outcome.selection.dropped.any()
    changed = [n for n in outcome.before if not torch.equal(outcome.before[n], outcome.after[n])]
    assert not changed, f".grad changed: {changed[:3]}"


@pytest.mark.parametrize(
    "spec, granularity",
    [(m, g) for m in MODELS for g in GRANULARITIES if not (m == "gpt2-full" and g == "per_layer")],
)
def test_dropping_everything_keeps_the_best_example(spec: str, granularity: str) -> None:
    """``threshold=+inf`` would drop every example; as ``rules.py`` documents, the
    best-scoring one (per layer: each layer's best) is kept, and ``.grad`` is the fresh
    backward over it alone, normalized by its own label tokens."""
    s = subject(spec)
    outcome = run_step(s, 4, "threshold", {"value": math.inf}, granularity=granularity)
    keep = expected_keep(s, "threshold", math.inf, "dot", granularity)
    assert all(int(mask.sum()) == 1 for mask in keep.values())
    assert outcome.selection.dropped.tolist() == (~torch.stack(list(keep.values()))).any(0).tolist()
    if granularity == "global":
        assert_grad_is_fresh_over_kept(s, outcome, 4, next(iter(keep.values())))
    else:
        assert_grad_is_fresh_over_kept(s, outcome, 4, keep)


def test_a_layer_wider_than_the_cache_or_the_budget_stays_factorized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cost model materializes a layer only if one example's gradient fits
    ``DENSE_EXAMPLE_BYTES`` (here set to leave out the LM head, the widest layer) and the
    step's built gradients fit ``DENSE_STEP_BYTES`` (here three of the widest block
    layers'): every eligible layer left out would not have fit beside the chosen ones,
    and the selector's kept workspace holds no more than the chosen ones. The mixed step
    is still the fresh backward over the kept examples."""
    s = subject("llama-full")
    model = s.model
    dims = {
        n: sum(p.numel() for p in m.parameters())
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }
    widest_block = max(d for n, d in dims.items() if n != "lm_head")
    assert dims["lm_head"] > widest_block
    itemsize = torch.float64.itemsize
    budget = 3 * EXAMPLES * widest_block * itemsize
    monkeypatch.setattr(selector_module, "DENSE_EXAMPLE_BYTES", widest_block * itemsize)
    monkeypatch.setattr(selector_module, "DENSE_STEP_BYTES", budget)
    outcome = run_step(s, 1, "bottom_fraction", {"fraction": FRACTION})
    (chosen,) = outcome.materialized
    assert chosen and "lm_head" not in chosen
    used = sum(EXAMPLES * dims[n] * itemsize for n in chosen)
    assert used <= budget
    assert outcome.workspace_bytes == used, "the selector keeps exactly the built gradients"
    left_out = set(dims) - chosen - {"lm_head"}
    assert left_out, "the budget is not binding"
    assert all(budget - used < EXAMPLES * dims[n] * itemsize for n in left_out)
    assert_grad_is_fresh_over_kept(s, outcome, 1, ~outcome.selection.dropped)


def test_after_a_step_that_summed_no_row_nothing_is_materialized() -> None:
    """The cost model prices the sums by the share of rows the previous step summed
    (half before the first): after a step that dropped nothing, so summed no row,
    reading the factors is the cheaper route for every layer, and ``.grad`` is still
    left as the backward wrote it."""
    s = subject("llama-full")
    outcome = run_step(s, 1, "threshold", {"value": -math.inf}, steps=2)
    assert outcome.materialized == [outcome.linear_layers, set()]
    assert all(torch.equal(outcome.before[n], outcome.after[n]) for n in outcome.before)


def test_per_layer_refuses_a_tied_weight() -> None:
    """GPT-2's ``lm_head`` and ``wte`` share one weight: per-layer selection would give it
    two kept sets, so the selector refuses and names the layers."""
    model = tiny_causal_lm("gpt2")
    refused = pytest.raises(ValueError, match=r"share a parameter.*granularity='global'")
    with CaptureEngine(model, layers=LayerSelection("all")) as engine, refused as info:
        DataSelector(
            engine.captured_layers,
            rule=rule_by_name("bottom_fraction"),
            token_counts=causal_lm_token_counts,
            granularity="per_layer",
        )
    assert "lm_head" in str(info.value) and "transformer.wte" in str(info.value)


# -- 2. Trainer and SFTTrainer, fp32 ---------------------------------------------------


MAX_GRAD_NORM = 0.05
STEPS = 3
PER_DEVICE = 2
#: Weights move visibly each step, but stay where fp32 gradients are accurate to ~1e-5:
#: after two AdamW steps at 1e-2 the LoRA model's own fp32 backward is 4e-4 off fp64.
LEARNING_RATE = 1e-3


def target_rows() -> list[dict[str, Any]]:
    return [{"input_ids": r} for r in token_rows(3, seed=7)]


def fp64_twin(spec: str) -> Callable[[], nn.Module]:
    """The reference model: the trained model's architecture in fp64 (weights loaded)."""
    return lambda: build_model(spec, torch.float64)


@dataclass
class SelectionRun:
    trainer: Trainer
    selection: DataSelectionCallback
    audit: SelectionAudit


def dropped_per_step(selection: DataSelectionCallback) -> dict[int, set[int]]:
    return {h.step: set(h.summary()["dropped_ids"]) for h in selection.history}


def assert_window_token_counts(steps: dict[int, StepAudit]) -> None:
    """Each micro-batch was told ``num_items_in_batch`` = its window's shifted label
    tokens: the count the selection renormalizes with (``causal_lm_token_counts``)."""
    for audit in steps.values():
        window = sum(int(label_counts(b).sum()) for b in audit.micro_batches)
        assert audit.num_items == [window] * len(audit.micro_batches)


def train_with_selection(
    tmp_path: Path,
    spec: str,
    accumulation: int,
    first: TrainerCallback | None = None,
    trainer_class: type[Trainer] = Trainer,
    collator: Callable[[list[Any]], dict[str, Tensor]] = pad_rows,
    max_grad_norm: float = MAX_GRAD_NORM,
    **selection_options: Any,
) -> SelectionRun:
    """``trainer_class`` (fp32, 3 steps, batch 2, ``max_grad_norm``, logging every
    step, ``collator``) with ``first`` (a probe),
    ``DataSelectionCallback(fraction=0.5, **selection_options)`` then the audit."""
    selection = DataSelectionCallback(
        target_rows(), fraction=0.5, **{**PINNED, **selection_options}
    )
    audit = SelectionAudit()
    trainer = trainer_class(
        model=build_model(spec, torch.float32),
        args=training_args(
            tmp_path / "out",
            gradient_accumulation_steps=accumulation,
            max_grad_norm=max_grad_norm,
            learning_rate=LEARNING_RATE,
            logging_strategy="steps",
            logging_steps=1,
        ),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(24)]),
        data_collator=collator,
        callbacks=[c for c in (first, selection, audit) if c is not None],
    )
    trainer.train()
    return SelectionRun(trainer, selection, audit)


class GradProbe(TrainerCallback):
    """Before the selection callback: the trainable parameters without a ``.grad``."""

    def __init__(self) -> None:
        self.without: list[set[str]] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        params = kwargs["model"].named_parameters()
        self.without.append({n for n, p in params if p.requires_grad and p.grad is None})


def test_one_process_trainer_builds_the_linear_grads_from_the_kept_examples(
    tmp_path: Path,
) -> None:
    """In one process the selection callback's engine leaves the captured linear and norm
    weights out of autograd (``parameter_grads=False``): before the selection their
    ``.grad`` is unwritten and the selection builds it from the kept examples (the
    Trainer cases above check the result against the fresh backward); the embedding,
    whose input is token ids, keeps autograd's own gradient."""
    probe = GradProbe()
    run = train_with_selection(tmp_path, "llama-full", 2, first=probe, layers="all")
    model = run.trainer.model
    linear = {f"{n}.weight" for n in LayerSelection("linear").resolve(model)}
    assert len(probe.without) == STEPS
    for without in probe.without:
        assert linear <= without
        assert "model.embed_tokens.weight" not in without


def test_one_process_full_fine_tuning_scores_every_layer_in_one_adam_metric(
    tmp_path: Path,
) -> None:
    """There the selection builds the captured layers' ``.grad`` after choosing, so only
    the embedding holds the step's gradient when it scores: Adam's metric is then the
    optimizer's stored state for every layer, the identity before the first step, and the
    first step's ``adam`` scores are its ``dot`` scores (with that gradient folded into
    the embedding's metric alone, they were weighted 1 / |g| there and 1 elsewhere)."""
    dot = train_with_selection(tmp_path / "dot", "llama-full", 1, layers="all", score="dot")
    adam = train_with_selection(tmp_path / "adam", "llama-full", 1, layers="all", score="adam")
    first_dot, first_adam = dot.selection.history[0], adam.selection.history[0]
    assert torch.equal(first_adam.example_ids, first_dot.example_ids)
    torch.testing.assert_close(first_adam.scores, first_dot.scores, rtol=1e-5, atol=0.0)


TRAINER_CASES = [
    pytest.param("llama-full", 1, {"layers": "all"}, id="full-ga1"),
    pytest.param("llama-full", 4, {"layers": "all"}, id="full-ga4"),
    pytest.param("llama-lora", 1, {}, id="lora-ga1"),
    pytest.param("llama-lora", 4, {"score": "adam"}, id="lora-ga4-adam"),
    pytest.param(
        "llama-full", 2, {"layers": "all", "score_projection": 4}, id="full-ga2-projected-scores"
    ),
]


@pytest.mark.parametrize("spec, accumulation, options", TRAINER_CASES)
def test_trainer_grad_is_the_clipped_fresh_backward_over_kept(
    tmp_path: Path, spec: str, accumulation: int, options: dict[str, Any]
) -> None:
    """Through ``Trainer``: each step drops half its examples, and the ``.grad`` the
    optimizer steps with is ``clip(fresh backward over the kept examples, 0.05)`` (so
    clipping follows selection and the trainer's own clipping before it is off); every
    fresh gradient is above 0.05, so the clipping is in effect. Afterwards
    ``max_grad_norm`` is 0.05 again, ``selection.jsonl`` has one line per step with its
    dropped ids, and the trainer's logs carry ``selection/kept`` and friends, with
    ``selection/grad_norm`` the fresh backward's norm before clipping."""
    run = train_with_selection(tmp_path, spec, accumulation, **options)
    history = run.selection.history
    examples_per_step = PER_DEVICE * accumulation
    assert [h.step for h in history] == list(range(STEPS))
    assert all(int(h.dropped.sum()) == examples_per_step // 2 for h in history)
    assert_window_token_counts(run.audit.steps)
    check = assert_trainer_grads_match_fresh(
        run.audit.steps, dropped_per_step(run.selection), fp64_twin(spec), MAX_GRAD_NORM, FP32_TOL
    )
    assert check.steps == STEPS and min(check.fresh_norms) > MAX_GRAD_NORM

    assert run.trainer.args.max_grad_norm == MAX_GRAD_NORM
    lines = (tmp_path / "out" / "selection.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [h.summary() for h in history]
    logged = [e for e in run.trainer.state.log_history if "selection/kept" in e]
    assert [e["step"] for e in logged] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # as the trainer logs
    assert all(e["selection/kept"] == examples_per_step // 2 for e in logged)
    assert all("selection/dropped" in e and "selection/mean_score" in e for e in logged)
    # the corrected gradient's norm before clipping: the fresh backward's, per step
    norms = torch.tensor([e["selection/grad_norm"] for e in logged], dtype=torch.float64)
    torch.testing.assert_close(
        norms, torch.tensor(check.fresh_norms, dtype=torch.float64), rtol=1e-4, atol=0.0
    )


def assert_unclipped_llama_run_exact(run: SelectionRun) -> None:
    """Every step's ``.grad`` of an unclipped ``llama-full`` run is the fp64 fresh
    backward over its kept examples."""
    check = assert_trainer_grads_match_fresh(
        run.audit.steps,
        dropped_per_step(run.selection),
        fp64_twin("llama-full"),
        0.0,
        FP32_TOL,
    )
    assert check.steps == STEPS


def prompt_masked_shift_labels(features: list[Any]) -> dict[str, Tensor]:
    """:func:`pad_rows` plus ``shift_labels`` (next-token targets, as context-parallel and
    padding-free collators add them) that leave out each row's first 3 predictions, while
    ``labels`` keep them: transformers' loss and ``num_items_in_batch`` follow
    ``shift_labels``."""
    batch = pad_rows(features)
    labels = batch["labels"]
    shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
    shifted[:, :3] = -100
    batch["shift_labels"] = shifted
    return batch


def test_a_collators_shift_labels_are_the_loss_tokens_the_selection_normalizes_by(
    tmp_path: Path,
) -> None:
    """A collator's ``shift_labels`` replace the shifted ``labels`` in transformers' loss:
    the selection counts them too, so ``.grad`` is the fresh backward over the kept
    examples of their ``shift_labels`` losses, divided by the kept ``shift_labels`` tokens
    (counting ``labels`` instead left it 1.5-8.6 % off). Not clipped: clipping would
    hide a wrong count, which scales a step's whole ``.grad``."""
    run = train_with_selection(
        tmp_path,
        "llama-full",
        2,
        collator=prompt_masked_shift_labels,
        max_grad_norm=0.0,
        layers="all",
    )
    for audit in run.audit.steps.values():
        assert all("shift_labels" in b for b in audit.micro_batches)
    assert_window_token_counts(run.audit.steps)  # the trainer counted shift_labels too
    assert_unclipped_llama_run_exact(run)


class MicroBatchMeanTrainer(Trainer):
    """An older ``compute_loss`` override that calls the parent without
    ``num_items_in_batch``: the model then divides each micro-batch's loss by that
    micro-batch's own tokens, and the trainer does not divide by the accumulation steps."""

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Tensor | None = None,
    ) -> Any:
        return super().compute_loss(model, inputs, return_outputs=return_outputs)


def test_a_loss_divided_per_micro_batch_is_refused_before_the_optimizer_steps(
    tmp_path: Path,
) -> None:
    """Under accumulation 2, ``MicroBatchMeanTrainer``'s loss is no token mean over the
    step: the selection's rebuilt ``.grad`` (the token mean over the kept examples) would
    be 16-111 % off the trainer's normalization of them. The first step is refused before
    the optimizer changes a weight, naming the override's fix."""
    snapshot = FirstWeights()
    with pytest.raises(UnsupportedTrainingSetup, match=r"step 1: .*num_items_in_batch") as info:
        train_with_selection(
            tmp_path,
            "llama-full",
            2,
            first=snapshot,
            trainer_class=MicroBatchMeanTrainer,
            layers="all",
        )
    assert "super().compute_loss()" in str(info.value)
    snapshot.assert_unchanged()


def test_a_model_given_no_num_items_in_batch_is_refused_under_accumulation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that takes no loss keywords (``accepts_loss_kwargs=False``) gets no
    ``num_items_in_batch`` from the Trainer, which then averages each micro-batch and
    divides by the accumulation steps: refused at step 1, naming that cause."""
    model = build_model("llama-full", torch.float32)
    monkeypatch.setattr(type(model), "accepts_loss_kwargs", False, raising=False)
    with pytest.raises(UnsupportedTrainingSetup, match=r"step 1: .*accepts_loss_kwargs=False"):
        train_with_selection(tmp_path, "llama-full", 2, layers="all")


def test_a_loss_divided_per_micro_batch_is_exact_without_accumulation(tmp_path: Path) -> None:
    """At accumulation 1 in one process each micro-batch is the whole step, so
    ``MicroBatchMeanTrainer``'s loss is the step's token mean: the check lets it train,
    and ``.grad`` is the fresh backward over the kept examples."""
    run = train_with_selection(
        tmp_path,
        "llama-full",
        1,
        trainer_class=MicroBatchMeanTrainer,
        max_grad_norm=0.0,
        layers="all",
    )
    assert_unclipped_llama_run_exact(run)


def _param_grad(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Gradient of ``batch``'s summed example losses over the trainable parameters, flat."""
    params = list(trainable(model).values())
    grads = torch.autograd.grad(example_losses(model, batch).sum(), params)
    return torch.cat([g.flatten() for g in grads])


def test_target_examples_score_each_step_against_the_next_pool_example(tmp_path: Path) -> None:
    """``target_examples=1`` (the dattri-llm protocol): step ``k``'s scores are the
    oracle's ``<g_i, T_k>`` with ``T_k`` the gradient of pool example ``k`` alone at the
    step's weights (fp64 autograd, one example at a time), and removal stays exact."""
    run = train_with_selection(tmp_path, "llama-lora", 1, target_examples=1)
    pool = target_rows()
    reference = fp64_twin("llama-lora")()
    for step, audit in run.audit.steps.items():
        reference.load_state_dict(audit.weights)
        ids = torch.tensor([pool[step % len(pool)]["input_ids"]])
        target = _param_grad(reference, {"input_ids": ids, "labels": ids})
        rows = [
            {k: v[i : i + 1] for k, v in batch.items()}
            for batch in audit.micro_batches
            for i in range(batch["input_ids"].shape[0])
        ]
        expected = torch.stack([_param_grad(reference, row) @ target for row in rows])
        got = run.selection.history[step].scores.double()
        assert ((got - expected).norm() / expected.norm()).item() <= 1e-4
    assert_lora_run_exact(run)


def assert_lora_run_exact(run: SelectionRun) -> None:
    """Every step of a ``llama-lora`` run: ``.grad`` is the clipped fresh backward over
    the kept examples (fp32 tolerance)."""
    check = assert_trainer_grads_match_fresh(
        run.audit.steps,
        dropped_per_step(run.selection),
        fp64_twin("llama-lora"),
        MAX_GRAD_NORM,
        FP32_TOL,
    )
    assert check.steps == STEPS


def sft_with_selection(tmp_path: Path, model: nn.Module, **options: Any) -> SelectionRun:
    """``SFTTrainer`` (TRL's tokenization, collator and fused LM head; completion-only
    loss; gradient checkpointing, its default; accumulation 2) with selection + audit,
    not yet trained."""
    from trl import SFTConfig, SFTTrainer

    pairs = prompt_completion_pairs(16)
    targets = [{"input_ids": list(p.tokens()), "labels": p.labels()} for p in pairs[-3:]]
    selection = DataSelectionCallback(targets, fraction=0.5, **{**PINNED, **options})
    audit = SelectionAudit()
    args = training_args(
        tmp_path / "out",
        config_cls=SFTConfig,
        packing=False,
        gradient_accumulation_steps=2,
        max_grad_norm=MAX_GRAD_NORM,
        learning_rate=LEARNING_RATE,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list([p.row() for p in pairs[:12]]),
        processing_class=word_tokenizer(),
        callbacks=[selection, audit],
    )
    return SelectionRun(trainer, selection, audit)


def test_sft_trainer_lora_selection_is_exact(tmp_path: Path) -> None:
    """Through TRL's ``SFTTrainer`` on a LoRA model (the loss reaches the model through
    ``log_probs``, not ``loss``): the labels the model is called with mask the prompt,
    TRL's fused head counts exactly their shifted label tokens (what the selection
    renormalizes with), and ``.grad`` is the clipped fresh backward over the kept
    examples' completion tokens."""
    run = sft_with_selection(tmp_path, build_model("llama-lora", torch.float32))
    run.trainer.train()
    assert len(run.selection.history) == STEPS
    assert all(int(h.dropped.sum()) == 2 for h in run.selection.history)
    for audit in run.audit.steps.values():
        assert all(bool((b["labels"][:, 0] == -100).all()) for b in audit.micro_batches)
        # TRL divides by its own count (the fused head's label_mask), not told the model.
        counted = [int(label_counts(b).sum()) for b in audit.micro_batches]
        assert audit.label_mask_tokens == counted
    assert_lora_run_exact(run)


def test_sft_trainer_full_fine_tuning_refuses_or_is_exact(tmp_path: Path) -> None:
    """``SFTTrainer``'s fused LM head reads ``lm_head.weight`` without calling ``lm_head``,
    so no hook sees its per-example gradients. Full fine-tuning with ``layers="all"`` must
    then refuse before step 0, naming ``lm_head``, or give the exact kept gradient."""
    run = sft_with_selection(tmp_path, build_model("llama-full", torch.float32), layers="all")
    try:
        run.trainer.train()
    except UnsupportedTrainingSetup as error:
        assert "lm_head" in str(error)
        assert not run.audit.steps, "refused only after training had begun"
        return
    check = assert_trainer_grads_match_fresh(
        run.audit.steps,
        dropped_per_step(run.selection),
        fp64_twin("llama-full"),
        MAX_GRAD_NORM,
        FP32_TOL,
    )
    assert check.steps == STEPS


def test_full_fine_tuning_with_default_layers_is_refused_before_any_step(
    tmp_path: Path,
) -> None:
    """Full fine-tuning with the default (linear) selection leaves the embedding and the
    norms uncaptured: ``train()`` fails at ``on_train_begin``, naming them, before any
    step, with no hook left on the model and ``max_grad_norm`` untouched."""
    audit = SelectionAudit()
    model = build_model("llama-full", torch.float32)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path / "out", max_grad_norm=1.0),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(8)]),
        data_collator=pad_rows,
        callbacks=[audit, DataSelectionCallback(target_rows())],
    )
    with pytest.raises(UnsupportedTrainingSetup, match=r"not captured.*layers='all'") as info:
        trainer.train()
    assert "embed_tokens" in str(info.value) and "norm" in str(info.value)
    assert not audit.steps
    assert trainer.args.max_grad_norm == 1.0
    hooked = [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    assert hooked == [""], f"hooks left on {hooked}"  # only the audit's hook on the root


def test_projected_scores_refuse_adam_preconditioning() -> None:
    with pytest.raises(ValueError, match="score 'dot' or 'cosine'"):
        DataSelector(
            {},
            rule=rule_by_name("bottom_fraction", fraction=0.5),
            token_counts=causal_lm_token_counts,
            score="adam",
            optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
            score_projection=ProjectionConfig(k_a=4, k_g=4),
        )
