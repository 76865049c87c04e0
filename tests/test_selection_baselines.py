"""The baseline rules and scores of online data selection, against independent references.

* Rules: ``random`` drops exactly ``floor(fraction * N)`` examples, the same ones for the
  same seed and decision; ``top_fraction`` the highest scores; a replayed ``count`` (the
  ``drop_counts`` schedule) drops that many in the rule's order; rules that decide their
  own count refuse one.
* ``score="loss"``: the dropped examples are the highest (``bottom_fraction``) or lowest
  (``top_fraction``) mean token losses, each computed by a forward of the example alone,
  unpadded, in fp64; and ``.grad`` after the step is a fresh backward over the kept
  examples (``tests.selection_helpers``). Through the core, the HF ``Trainer`` (logits)
  and TRL's ``SFTTrainer`` (its fused head's log-probabilities), with no target pool.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from torch import Tensor, nn
from transformers import Trainer

from tda_plugins import CaptureEngine
from tda_plugins.data_selection import DataSelector, SelectionSettings, rule_by_name
from tda_plugins.data_selection.losses import ForwardLosses
from tda_plugins.integrations.transformers import DataSelectionCallback
from tda_plugins.integrations.transformers.selection import (
    causal_lm_output_losses,
    causal_lm_token_counts,
)
from tests.models import lm_batch, tiny_causal_lm, with_lora
from tests.oracle import max_rel_error
from tests.selection_helpers import (
    FP64_TOL,
    LENGTHS,
    SelectionAudit,
    assert_trainer_grads_match_fresh,
    current_grads,
    example_losses,
    fresh_kept_gradient,
    kept_masks,
    label_counts,
)
from tests.stores import ManualScale
from tests.trainers import (
    FP32_TOL,
    pad_rows,
    prompt_completion_pairs,
    token_rows,
    training_args,
    word_tokenizer,
)

# -- rules ------------------------------------------------------------------------------


def test_random_drops_the_requested_count_reproducibly() -> None:
    """Each decision drops exactly ``floor(fraction * N)`` of the finite examples; a rule
    with the same seed repeats the same sequence of decisions, another seed does not, and
    over many decisions every position is dropped about equally often."""
    scores = torch.linspace(-1, 1, 16)
    first, again, other = (rule_by_name("random", fraction=0.3, seed=s) for s in (5, 5, 6))
    masks = [first.dropped(scores) for _ in range(400)]
    assert all(int(m.sum()) == math.floor(0.3 * 16) for m in masks)
    assert all(torch.equal(m, again.dropped(scores)) for m in masks)
    assert any(not torch.equal(m, other.dropped(scores)) for m in masks)
    assert len({tuple(m.tolist()) for m in masks}) > 300  # not the same draw each time
    share = torch.stack(masks).double().mean(0)  # each position: 4 of 16 expected
    assert share.min() > 0.18 and share.max() < 0.32


def test_top_fraction_and_counts_follow_the_rules_order() -> None:
    scores = torch.tensor([0.3, -2.0, 5.0, 1.0, -0.5, 4.0, 0.0, 2.0])
    ranked = sorted(range(8), key=lambda i: float(scores[i]))
    top = rule_by_name("top_fraction", fraction=0.3).dropped(scores)
    assert top.nonzero().flatten().tolist() == sorted(ranked[-2:])
    for count in (0, 3, 8):
        bottom = rule_by_name("bottom_fraction", fraction=0.3).dropped(scores, count)
        assert bottom.nonzero().flatten().tolist() == sorted(ranked[:count])
        drawn = rule_by_name("random", fraction=0.3).dropped(scores, count)
        assert int(drawn.sum()) == count
    # dropping all of them still keeps the best one
    kept = rule_by_name("bottom_fraction").keep(scores, 8)
    assert kept.nonzero().flatten().tolist() == [2]


@pytest.mark.parametrize("rule", ["threshold", "negative_in_bottom"])
def test_rules_that_choose_their_count_refuse_a_replayed_one(rule: str) -> None:
    with pytest.raises(ValueError, match="ranked rule"):
        SelectionSettings(rule=rule, drop_counts=(1, 2))
    with pytest.raises(ValueError, match="drop_counts"):
        rule_by_name(rule).dropped(torch.zeros(4), 2)


def test_settings_refuse_what_the_loss_score_cannot_do() -> None:
    with pytest.raises(ValueError, match="granularity='global'"):
        SelectionSettings(score="loss", rule="bottom_fraction", granularity="per_layer")
    with pytest.raises(ValueError, match="score_projection"):
        SelectionSettings(score="loss", rule="bottom_fraction", score_projection=4)
    with pytest.raises(ValueError, match="counts >= 0"):
        SelectionSettings(drop_counts=(1, -1))
    assert not SelectionSettings(score="loss", rule="bottom_fraction").needs_target
    assert SelectionSettings(score="cosine").needs_target
    with pytest.raises(ValueError, match="needs a target"):
        DataSelectionCallback(None, score="dot")


# -- the loss score through the core ----------------------------------------------------


def mean_losses(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """``(B,)`` each example's mean token loss, from a forward of that example alone with
    its padding cut off (fp64)."""
    out = []
    for i, length in enumerate(batch["attention_mask"].sum(1).tolist()):
        row = {k: v[i : i + 1, :length] for k, v in batch.items()}
        with torch.no_grad():
            out.append(float(example_losses(model, row)) / float(label_counts(row)))
    return torch.tensor(out, dtype=torch.float64)


def loss_ranked_drop(losses: Tensor, rule: str, count: int) -> set[int]:
    """The ``count`` highest (``bottom_fraction``) or lowest (``top_fraction``) losses."""
    order = sorted(range(len(losses)), key=lambda i: float(losses[i]))
    return set(order[-count:] if rule == "bottom_fraction" else order[:count]) if count else set()


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("rule", ["bottom_fraction", "top_fraction"])
def test_loss_score_drops_by_mean_loss_and_grad_is_fresh_over_kept(
    rule: str, accumulation: int
) -> None:
    """Two steps through the engine with the replayed counts 3 and 5: each drops the
    examples its rule ranks first by the reference mean losses, and leaves ``.grad`` the
    fresh backward over the kept ones."""
    model = with_lora(tiny_causal_lm("llama"))
    batch = lm_batch(8, 10, lengths=LENGTHS, seed=1)
    size = 8 // accumulation
    micro = [{k: v[j * size : (j + 1) * size] for k, v in batch.items()} for j in range(2)]
    micro = micro[:accumulation] if accumulation == 2 else [batch]
    tokens = float(label_counts(batch).sum())
    normalization = ManualScale()
    normalization.value = tokens
    with CaptureEngine(model, layers=None, normalization=normalization) as engine:
        losses = ForwardLosses(model, causal_lm_output_losses)
        selector = DataSelector(
            engine.captured_layers,
            rule=rule_by_name(rule),
            token_counts=causal_lm_token_counts,
            score="loss",
            example_losses=losses.of,
            drop_counts=[3, 5],
        )
        engine.add_consumer(selector)
        for step, count in enumerate((3, 5)):
            model.zero_grad(set_to_none=True)
            first = 0
            for part in micro:
                engine.set_example_ids(torch.arange(first, first + part["input_ids"].shape[0]))
                first += part["input_ids"].shape[0]
                (example_losses(model, part).sum() / tokens).backward()
            engine.optimizer_step()
            losses.clear()
            dropped = set(selector.history[step].dropped.nonzero().flatten().tolist())
            expected = loss_ranked_drop(mean_losses(model, batch), rule, count)
            assert dropped == expected, f"step {step}"
            keep = torch.tensor([i not in dropped for i in range(8)])
            masks = [keep[j * size : (j + 1) * size] for j in range(len(micro))]
            with engine.paused():
                fresh = fresh_kept_gradient(model, micro, masks, tokens)
            error = max_rel_error(current_grads(model), fresh)
            assert error <= FP64_TOL, f"step {step}: .grad {error:.2e} off the fresh backward"
        losses.remove()


def test_loss_score_refuses_a_forward_without_labels() -> None:
    model = with_lora(tiny_causal_lm("llama"))
    batch = lm_batch(4, 10, seed=1)
    normalization = ManualScale()
    normalization.value = 1.0
    with CaptureEngine(model, layers=None, normalization=normalization) as engine:
        losses = ForwardLosses(model, causal_lm_output_losses)
        selector = DataSelector(
            engine.captured_layers,
            rule=rule_by_name("bottom_fraction"),
            token_counts=lambda r: torch.ones(r.batch_size),
            score="loss",
            example_losses=losses.of,
        )
        engine.add_consumer(selector)
        model(input_ids=batch["input_ids"]).logits.sum().backward()
        with pytest.raises(ValueError, match="no labels"):
            engine.optimizer_step()


# -- through the trainers, no target ----------------------------------------------------


STEPS = 3
MAX_GRAD_NORM = 0.05


def fp64_lora() -> nn.Module:
    return with_lora(tiny_causal_lm("llama", torch.float64))


def audited_drops(selection: DataSelectionCallback) -> dict[int, set[int]]:
    return {h.step: set(h.summary()["dropped_ids"]) for h in selection.history}


def assert_highest_losses_dropped(audit: SelectionAudit, dropped: dict[int, set[int]]) -> None:
    """At every step the dropped ids are the highest reference mean losses of the step's
    examples, at the step's weights."""
    reference = fp64_lora()
    assert audit.steps
    for step, record in audit.steps.items():
        reference.load_state_dict(record.weights)
        for batch, kept in zip(
            record.micro_batches, kept_masks(record.micro_batches, dropped[step]), strict=True
        ):
            losses = mean_losses(reference, batch)
            assert bool(kept.any()) and not bool(kept.all())
            assert float(losses[~kept].min()) >= float(losses[kept].max()) - 1e-6


def test_trainer_loss_baseline_needs_no_target_and_is_exact(tmp_path: Path) -> None:
    """``DataSelectionCallback(None, score="loss", drop_counts=...)`` on a ``Trainer``: each
    step drops its scheduled count, the highest-loss examples, and the optimizer steps
    with the clipped fresh backward over the kept ones."""
    selection = DataSelectionCallback(
        None, score="loss", rule="bottom_fraction", drop_counts=[1, 3, 2]
    )
    audit = SelectionAudit()
    trainer = Trainer(
        model=with_lora(tiny_causal_lm("llama", torch.float32)),
        args=training_args(
            tmp_path / "out",
            per_device_train_batch_size=4,
            max_grad_norm=MAX_GRAD_NORM,
            learning_rate=1e-3,
        ),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(24)]),
        data_collator=pad_rows,
        callbacks=[selection, audit],
    )
    trainer.train()
    history = selection.history
    assert [int(h.dropped.sum()) for h in history] == [1, 3, 2]
    dropped = audited_drops(selection)
    assert_highest_losses_dropped(audit, dropped)
    check = assert_trainer_grads_match_fresh(
        audit.steps, dropped, fp64_lora, MAX_GRAD_NORM, FP32_TOL
    )
    assert check.steps == len(history) == STEPS


def test_sft_trainer_reads_losses_from_its_fused_head(tmp_path: Path) -> None:
    """TRL's fused LM head returns log-probabilities, not logits: the loss score reads
    them, drops the highest-loss completions and stays exact."""
    from trl import SFTConfig, SFTTrainer

    pairs = prompt_completion_pairs(16)
    selection = DataSelectionCallback(
        None, score="loss", rule="bottom_fraction", fraction=0.5
    )  # 1 of 2 per step
    audit = SelectionAudit()
    trainer = SFTTrainer(
        model=with_lora(tiny_causal_lm("llama", torch.float32)),
        args=training_args(
            tmp_path / "out",
            config_cls=SFTConfig,
            packing=False,
            max_grad_norm=MAX_GRAD_NORM,
            learning_rate=1e-3,
        ),
        train_dataset=Dataset.from_list([p.row() for p in pairs[:12]]),
        processing_class=word_tokenizer(),
        callbacks=[selection, audit],
    )
    trainer.train()
    assert all(int(h.dropped.sum()) == 1 for h in selection.history)
    dropped = audited_drops(selection)
    assert_highest_losses_dropped(audit, dropped)
    check = assert_trainer_grads_match_fresh(
        audit.steps, dropped, fp64_lora, MAX_GRAD_NORM, FP32_TOL
    )
    assert check.steps == STEPS


# -- the target's refresh schedule --------------------------------------------------------


def test_auto_refresh_keeps_the_target_within_its_share_of_the_examples() -> None:
    """``refresh_every=None``: ``m`` target examples per refresh against ``B`` per step
    are refreshed every ``ceil(m / (B / 8))`` steps (so ``m`` per that many ``B``-example
    steps is at most one eighth); a number is taken as it is."""
    auto = SelectionSettings(refresh_every=None)
    for m, b in ((16, 8), (16, 32), (3, 2), (1, 64), (7, 8)):
        interval = auto.refresh_interval(m, b)
        assert m / (interval * b) <= 1 / 8  # within the share
        assert interval == 1 or m / ((interval - 1) * b) > 1 / 8  # and no longer than needed
    assert SelectionSettings(refresh_every=3).refresh_interval(16, 8) == 3


def test_auto_refresh_through_the_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-example pool, batch 4 and ``refresh_every=None``: the target is computed at
    steps 0, 4 and 8 of 10 (every ``ceil(8 * 2 / 4)`` = 4 steps)."""
    from tda_plugins.data_selection import session as session_module

    refreshed: list[int] = []
    real = session_module.shared_target

    class Spy(DataSelectionCallback):
        """Notes the step of each target computation."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step = state.global_step
            super().on_step_begin(args, state, control, **kwargs)

    def counting(*args: Any, **kwargs: Any) -> Any:
        refreshed.append(selection.step)
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "shared_target", counting)
    selection = Spy([{"input_ids": r} for r in token_rows(2, seed=7)], refresh_every=None)
    trainer = Trainer(
        model=with_lora(tiny_causal_lm("llama", torch.float32)),
        args=training_args(tmp_path / "out", per_device_train_batch_size=4, max_steps=10),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(40)]),
        data_collator=pad_rows,
        callbacks=[selection],
    )
    trainer.train()
    assert len(selection.history) == 10
    assert refreshed == [0, 4, 8]
