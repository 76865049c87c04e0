"""Online data selection never writes a non-finite value, and refuses what it cannot use.

* A poisoned training example (its hidden states NaN, so its gradient and score are NaN)
  in a real ``Trainer`` run with selection: it is dropped and named (the log, the JSONL
  line, the trainer's metrics), the weights stay finite, and the other examples' ``.grad``
  is the exact kept one; a step whose every example is poisoned is skipped (weights and
  Adam state unchanged).
* A target without loss tokens, and a target whose gradient is not finite: an error at
  the refresh naming the target examples, before any optimizer step.
* The decision itself: a non-finite score drops its example, the rule applies to the
  finite ones, and the JSON line stays valid JSON.
* The clipping the callback takes over is the user's again however training ends.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from torch import Tensor, nn
from transformers import Trainer, TrainerCallback

from tda_plugins.data_selection import SelectionError, rule_by_name
from tda_plugins.data_selection.outcome import decide
from tda_plugins.data_selection.parallel import Ranks
from tda_plugins.data_selection.scoring import UnitScores
from tda_plugins.integrations.transformers import DataSelectionCallback
from tests.models import tiny_causal_lm
from tests.selection_helpers import PINNED, SelectionAudit, assert_trainer_grads_match_fresh
from tests.trainers import FP32_TOL, pad_rows, token_rows, training_args

#: The first token of a poisoned row (no other row starts with it).
POISON = 1


def poison_rows(model: nn.Module) -> None:
    """Rows whose first token is :data:`POISON` get NaN hidden states after the embedding."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        poisoned = args[0][:, 0] == POISON
        if not bool(poisoned.any()):
            return output
        out = output.clone()
        out[poisoned] = float("nan")
        return out

    model.get_input_embeddings().register_forward_hook(hook)


def rows(count: int, poisoned: set[int], seed: int = 0) -> list[dict[str, list[int]]]:
    out = [{"input_ids": r} for r in token_rows(count, seed=seed)]
    for i in poisoned:
        out[i]["input_ids"][0] = POISON
    return out


def target() -> list[dict[str, list[int]]]:
    return rows(2, set(), seed=7)


class WeightsAndState(TrainerCallback):
    """Weights and Adam step counts at each step's start and end."""

    def __init__(self) -> None:
        self.begin: list[dict[str, Tensor]] = []
        self.end: list[dict[str, Tensor]] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.begin.append({k: v.clone() for k, v in kwargs["model"].state_dict().items()})

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.end.append({k: v.clone() for k, v in kwargs["model"].state_dict().items()})


def train(tmp_path: Path, data: list[dict[str, list[int]]], **options: Any) -> tuple:
    """Full fine-tuning of the fp32 tiny Llama, 3 steps of 4 examples (2 x 2, in dataset
    order), selection after ``snapshots`` and before the audit; returns (trainer,
    selection, audit, snapshots)."""
    model = tiny_causal_lm("llama", torch.float32)
    poison_rows(model)
    selection = DataSelectionCallback(
        options.pop("target", target()), layers="all", **{**PINNED, **options}
    )
    audit, snapshots = SelectionAudit(), WeightsAndState()
    trainer = Trainer(
        model=model,
        args=training_args(
            tmp_path / "out",
            gradient_accumulation_steps=2,
            max_grad_norm=1e9,
            logging_strategy="steps",
            logging_steps=1,
            train_sampling_strategy="sequential",  # step k trains rows 4k .. 4k + 3
        ),
        train_dataset=Dataset.from_list(data),
        data_collator=pad_rows,
        callbacks=[snapshots, selection, audit],
    )
    return trainer, selection, audit, snapshots


def test_a_poisoned_example_is_dropped_and_named_and_weights_stay_finite(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = rows(12, poisoned={1, 6})  # one in step 0, one in step 1
    trainer, selection, audit, _ = train(tmp_path, data, fraction=0.25)
    with caplog.at_level(logging.WARNING, logger="tda_plugins"):
        trainer.train()
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    poisoned_steps = [h for h in selection.history if h.nonfinite.any()]
    assert [h.step for h in poisoned_steps] == [0, 1]
    for outcome in poisoned_steps:
        summary = outcome.summary()
        assert len(summary["nonfinite_ids"]) == 1 and not summary["skipped"]
        assert set(summary["nonfinite_ids"]) <= set(summary["dropped_ids"])
        assert f"step {outcome.step + 1}:" in caplog.text and "non-finite" in caplog.text
        assert str(summary["nonfinite_ids"][0]) in caplog.text
    lines = (tmp_path / "out" / "selection.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [h.summary() for h in selection.history]
    logged = [e for e in trainer.state.log_history if "selection/nonfinite" in e]
    assert [e["selection/nonfinite"] for e in logged] == [1.0, 1.0, 0.0]
    # every .grad is the fresh backward over the kept (finite) examples
    dropped = {h.step: set(h.summary()["dropped_ids"]) for h in selection.history}
    check = assert_trainer_grads_match_fresh(
        audit.steps, dropped, lambda: tiny_causal_lm("llama", torch.float64), math.inf, FP32_TOL
    )
    assert check.steps == 3


def test_a_step_without_a_finite_example_is_skipped(tmp_path: Path) -> None:
    """Step 1's four examples are all poisoned: no ``.grad`` is left, so AdamW leaves the
    weights (and its state) as they were; the other steps train."""
    data = rows(12, poisoned={4, 5, 6, 7})
    trainer, selection, _, snapshots = train(tmp_path, data, fraction=0.25)
    trainer.train()
    skipped = [h.step for h in selection.history if h.skipped]
    assert skipped == [1]
    assert selection.history[1].summary()["kept"] == 0
    for step, (begin, end) in enumerate(zip(snapshots.begin, snapshots.end, strict=True)):
        same = all(torch.equal(begin[k], end[k]) for k in begin)
        assert same == (step == 1), f"step {step}"
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    assert trainer.args.max_grad_norm == 1e9


def test_a_target_without_loss_tokens_is_an_error_at_refresh(tmp_path: Path) -> None:
    no_tokens = [{**r, "labels": [-100] * len(r["input_ids"])} for r in rows(2, set(), 7)]
    trainer, _, audit, _ = train(tmp_path, rows(12, set()), target=no_tokens)
    with pytest.raises(ValueError, match=r"target:1: has no loss token .*labels all -100"):
        trainer.train()
    assert not any(a.grads for a in audit.steps.values()), "an optimizer step ran"
    assert trainer.args.max_grad_norm == 1e9


def test_a_session_target_without_loss_tokens_is_an_error_at_refresh(tmp_path: Path) -> None:
    """The session itself (under any integration's pool) refuses a refresh whose target
    examples have no loss token, naming their pool positions, before scoring anything."""
    from tda_plugins import LayerSelection
    from tda_plugins.data_selection import SelectionSession, SelectionSettings
    from tda_plugins.integrations.transformers.normalization import CausalLMNormalization
    from tda_plugins.integrations.transformers.selection import (
        causal_lm_token_counts,
        target_token_counts,
    )
    from tda_plugins.session.batch import causal_lm_losses

    target = pad_rows([{"input_ids": r} for r in token_rows(2, seed=7)])
    target["labels"] = torch.full_like(target["labels"], -100)
    session = SelectionSession(
        SelectionSettings(rule="bottom_fraction", fraction=0.5, score="dot"),
        tiny_causal_lm("llama", torch.float32),
        target=target,
        losses=causal_lm_losses,
        target_tokens=target_token_counts,
        normalization=CausalLMNormalization(),
        token_counts=causal_lm_token_counts,
        log_path=tmp_path / "selection.jsonl",
        layers=LayerSelection("all"),
    )
    with pytest.raises(SelectionError, match=r"examples \[0, 1\] \(pool positions\) have no loss"):
        session.refresh_target(0)


def test_a_non_finite_target_is_an_error_at_refresh_naming_its_examples(tmp_path: Path) -> None:
    pool = rows(3, {1}, seed=7)
    trainer, _, audit, _ = train(tmp_path, rows(12, set()), target=pool, target_examples=1)
    with pytest.raises(SelectionError, match=r"examples \[1\].*non-finite gradient at step 1"):
        trainer.train()
    # the refresh of step 1 (pool example 1) failed: only step 0 was taken
    assert [s for s, a in audit.steps.items() if a.grads] == [0]


def test_a_non_finite_score_drops_its_example_and_the_rule_takes_the_finite_ones() -> None:
    """Scores (2, nan, -1, inf, 5): the non-finite two are dropped; ``bottom_fraction``
    0.5 then drops ``floor(0.5 * 3) = 1`` of the finite three (the lowest, -1); the JSON
    line is valid JSON and its mean is over the finite scores."""
    dots = torch.tensor([[2.0], [math.nan], [-1.0], [math.inf], [5.0]], dtype=torch.float64)
    decision = decide(
        4,
        ids=torch.arange(10, 15),
        counts=torch.ones(5, dtype=torch.long),
        scales=torch.full((5,), 5.0, dtype=torch.float64),
        roundings=torch.zeros(5, dtype=torch.float64),
        scores=UnitScores(dots),
        rule=rule_by_name("bottom_fraction", fraction=0.5),
        per_layer=False,
        ranks=Ranks(),
    )
    summary = decision.outcome.summary()
    assert summary["dropped_ids"] == [11, 12, 13]
    assert summary["nonfinite_ids"] == [11, 13]
    assert summary["mean_score"] == pytest.approx(2.0) and not summary["skipped"]
    assert json.loads(json.dumps(summary, allow_nan=False)) == summary


class RaiseAt(TrainerCallback):
    """Raises at step ``step``: in ``on_substep_end`` (after the window's first micro-batch's
    backward), or in the model's forward of the window's second micro-batch."""

    def __init__(self, step: int, where: str) -> None:
        self.step, self.where, self.calls = step, where, 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.where == "forward":
            kwargs["model"].register_forward_pre_hook(self._forward)
        self.state = state

    def _forward(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled() and self.state.global_step == self.step:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("boom")

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.where == "substep" and state.global_step == self.step:
            raise RuntimeError("boom")


@pytest.mark.parametrize("where", ["forward", "substep"])
def test_clipping_is_the_users_again_when_training_raises(tmp_path: Path, where: str) -> None:
    """The callback takes over ``max_grad_norm`` only between a micro-batch's backward and
    the next forward, its ``on_substep_end`` or ``on_pre_optimizer_step``: an exception
    from the model's forward, or from a later callback's ``on_substep_end``, finds the
    user's value (1e9) in place."""
    trainer, _, _, _ = train(tmp_path, rows(12, set()), fraction=0.25)
    trainer.add_callback(RaiseAt(1, where))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert trainer.args.max_grad_norm == 1e9
