"""The ``step_cosine`` rule: the kept set is the greedy backward elimination that raises the
cosine between the step's summed gradient and the target, against references that never
touch the engine.

* On plain vectors: the rule's incremental bookkeeping against a brute-force greedy that
  recomputes every candidate's cosine from the vectors themselves.
* Through the engine (fp64, LoRA and a full GPT-2 with its tied head, accumulation 1 and 2,
  the identity metric and Adam's): the examples kept are those the brute-force greedy keeps
  on the oracle's per-example gradients (``tests.oracle.loop_oracle``) and target, and
  ``.grad`` is then the fresh backward over them (``tests.selection_helpers``).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from tda_plugins import CaptureEngine, LayerSelection
from tda_plugins.data_selection import DataSelector, SelectionSettings, rule_by_name
from tda_plugins.data_selection.target import target_gradient
from tda_plugins.integrations.transformers.selection import causal_lm_token_counts
from tda_plugins.session.batch import causal_lm_losses
from tests.models import lm_batch, tiny_causal_lm, with_lora
from tests.oracle import max_rel_error
from tests.selection_helpers import (
    current_grads,
    example_losses,
    fresh_kept_gradient,
    greedy_by_hand,
    label_counts,
    oracle_kept,
    trainable,
)
from tests.stores import ManualScale

FP64_TOL = 1e-6
#: The engine cases' margin: small enough that the tiny models' steps drop some examples.
MARGIN = 0.001


@pytest.mark.parametrize("margin", [0.0, 0.02])
@pytest.mark.parametrize("seed", range(6))
def test_rule_matches_the_greedy_elimination_by_hand(seed: int, margin: float) -> None:
    """Clean examples share the target's direction plus noise; a few carry large noise or
    point elsewhere. The rule keeps exactly what the brute-force greedy keeps, and its
    kept sum is at least as aligned as the whole step."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(40, generator=gen, dtype=torch.float64)
    vectors = 0.3 * target + torch.randn(12, 40, generator=gen, dtype=torch.float64)
    vectors[:3] = 4 * torch.randn(3, 40, generator=gen, dtype=torch.float64)  # off-target noise
    order = torch.randperm(12, generator=gen)
    vectors = vectors[order]
    kept = rule_by_name("step_cosine", margin=margin).kept_of(vectors @ target, vectors @ vectors.T)
    expected = greedy_by_hand(vectors, target, margin)
    assert kept.tolist() == expected.tolist()
    assert 0 < int(kept.sum()) < 12, "vacuous: nothing or everything dropped"

    def cosine(mask: Tensor) -> float:
        step = vectors[mask].sum(0)
        return float(step @ target / (step.norm() * target.norm()))

    assert cosine(kept) > cosine(torch.ones(12, dtype=torch.bool))


def test_a_clean_step_along_the_target_keeps_everything() -> None:
    target = torch.ones(8, dtype=torch.float64)
    vectors = torch.stack([target * (1 + 0.1 * i) for i in range(5)])
    kept = rule_by_name("step_cosine").kept_of(vectors @ target, vectors @ vectors.T)
    assert bool(kept.all())


# -- through the engine -------------------------------------------------------------------


def subject(spec: str, adam: bool, warm: bool = True) -> tuple[nn.Module, torch.optim.Adam | None]:
    """A tiny fp64 model (``"llama-lora"`` or ``"gpt2-full"``, whose head is tied to the
    embedding); with ``adam``, its optimizer: after one Adam step on another batch
    (moments exist) or, not ``warm``, before its first step (no state)."""
    arch, kind = spec.split("-")
    model = tiny_causal_lm(arch, torch.float64)
    model = with_lora(model) if kind == "lora" else model
    if not adam:
        return model, None
    optimizer = torch.optim.Adam(trainable(model).values(), lr=1e-3)
    if not warm:
        return model, optimizer
    warmup = lm_batch(4, 10, lengths=(10, 6, 8, 9), seed=3)
    (example_losses(model, warmup).sum() / label_counts(warmup).sum()).backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return model, optimizer


CASES = [
    pytest.param("llama-lora", 1, "dot", True, id="lora-ga1-dot"),
    pytest.param("llama-lora", 2, "cosine", True, id="lora-ga2-cosine"),
    pytest.param("llama-lora", 2, "adam", True, id="lora-ga2-adam"),
    pytest.param("llama-lora", 1, "adam", False, id="lora-ga1-adam-first-step"),
    pytest.param("gpt2-full", 2, "dot", True, id="gpt2-full-tied-ga2-dot"),
]


@pytest.mark.parametrize("spec, accumulation, score, warm", CASES)
def test_engine_keeps_the_greedy_set_and_grad_is_fresh_over_it(
    spec: str, accumulation: int, score: str, warm: bool
) -> None:
    """The engine's kept set is the greedy's by hand (in Adam's metric of the step being
    taken: its first step too, where the optimizer has no state yet), and ``.grad`` is
    the fresh backward over it."""
    model, optimizer = subject(spec, adam=score == "adam", warm=warm)
    window = lm_batch(8, 10, lengths=(10, 7, 9, 5, 10, 8, 6, 10), seed=1)
    # a target of a different batch: some examples of the window point away from it
    target = lm_batch(2, 8, lengths=(8, 5), seed=2)
    expected = oracle_kept(model, optimizer, window, target, MARGIN)
    assert 0 < int(expected.sum()) < 8, "vacuous case: the greedy drops nothing or all"
    size = 8 // accumulation
    micro = [
        {k: v[j * size : (j + 1) * size] for k, v in window.items()} for j in range(accumulation)
    ]
    tokens = float(label_counts(window).sum())
    normalization = ManualScale()
    normalization.value = tokens
    layers = LayerSelection("all") if spec.endswith("-full") else None
    with CaptureEngine(model, layers=layers, normalization=normalization) as engine:
        selector = DataSelector(
            engine.captured_layers,
            rule=rule_by_name("step_cosine", margin=MARGIN),
            token_counts=causal_lm_token_counts,
            score=score,  # type: ignore[arg-type]
            optimizer=optimizer,
        )
        engine.add_consumer(selector)
        with engine.paused():
            selector.set_target(
                target_gradient(model, engine.captured_layers, target, causal_lm_losses)
            )
        model.zero_grad(set_to_none=True)
        first = 0
        for part in micro:
            engine.set_example_ids(torch.arange(first, first + size))
            first += size
            (example_losses(model, part).sum() / tokens).backward()
        engine.optimizer_step()
        after = current_grads(model)
    dropped = selector.history[0].dropped
    assert (~dropped).tolist() == expected.tolist()
    masks = [expected[j * size : (j + 1) * size] for j in range(accumulation)]
    fresh = fresh_kept_gradient(model, micro, masks, tokens)
    error = max_rel_error(after, fresh)
    assert error <= FP64_TOL, f".grad is {error:.2e} off the fresh backward over the kept"


def test_the_margin_keeps_examples_that_barely_turn_the_step() -> None:
    """Three examples along the target and one slightly off it: without a margin the
    off one goes (the cosine rises a little), with a margin above that rise it stays."""
    target = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    vectors = torch.tensor(
        [[1.0, 0.1, 0.0], [1.0, -0.1, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.4]],
        dtype=torch.float64,
    )
    gain = greedy_by_hand(vectors, target, 0.0)
    assert gain.tolist() == [True, True, True, False]
    step = vectors.sum(0)
    rest = vectors[:3].sum(0)
    rise = float(rest[0] / rest.norm()) / float(step[0] / step.norm()) - 1
    for margin, kept in ((rise / 2, 3), (rise * 2, 4)):
        rule = rule_by_name("step_cosine", margin=margin)
        assert int(rule.kept_of(vectors @ target, vectors @ vectors.T).sum()) == kept
    with pytest.raises(ValueError, match="margin"):
        rule_by_name("step_cosine", margin=-0.1)


def test_settings_refuse_what_the_set_rule_cannot_weigh() -> None:
    for options in ({"score": "loss"}, {"granularity": "per_layer"}):
        with pytest.raises(ValueError, match="weighs the step's gradients together"):
            SelectionSettings(rule="step_cosine", **options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="share a parameter"):
        model = tiny_causal_lm("gpt2")
        with CaptureEngine(model, layers=LayerSelection("all")) as engine:
            DataSelector(
                engine.captured_layers,
                rule=rule_by_name("step_cosine"),
                token_counts=causal_lm_token_counts,
                score="adam",
                optimizer=torch.optim.Adam(model.parameters()),
            )
