"""The check that a transformers trainer backpropagates the model's own loss.

Oracle: the model's causal-LM loss gives its logits the gradient ``(softmax - onehot) / s``
at labelled positions and zero elsewhere, and TRL's fused head's loss ``-c sum(log_probs)
/ N`` the same ``-c / N`` at every log-prob; a loss with an added term computed from them
does not. Through a ``Trainer`` and an ``SFTTrainer``: a ``compute_loss`` override that
adds such a term is refused before the optimizer changes a weight."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from torch import Tensor, nn
from transformers import Trainer, TrainerCallback

from tda_plugins.capture.targets import predicted_labels
from tda_plugins.integrations.transformers import DataSelectionCallback, GradientCaptureCallback
from tda_plugins.integrations.transformers.logits_check import (
    EVERY,
    FIRST,
    LogitsCheck,
    verify_uniform,
)
from tda_plugins.integrations.transformers.normalization import CausalLMNormalization
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tests.models import tiny_causal_lm
from tests.selection_helpers import PINNED
from tests.trainers import (
    FirstWeights,
    pad_rows,
    prompt_completion_pairs,
    token_rows,
    training_args,
    word_tokenizer,
)

VOCAB = 11


def causal_lm_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' loss: summed token cross-entropy of ``labels`` shifted left, over the
    labelled tokens, and that count."""
    targets = labels[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), reduction="sum")
    tokens = (targets != -100).sum()
    return loss / tokens, tokens.double()


def labelled_logits(dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """``(2, 6, V)`` logits that require grad, and labels with unlabelled positions."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, VOCAB, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (2, 6), generator=generator)
    labels[0, :3] = -100  # a prompt
    labels[1, 4:] = -100  # padding
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_models_own_loss_passes(dtype: torch.dtype) -> None:
    logits, labels = labelled_logits(dtype)
    check = LogitsCheck(logits, predicted_labels(labels, None))
    loss, tokens = causal_lm_loss(logits, labels)
    (3.0 * loss).backward()  # a trainer's factor c = 3
    check.verify(tokens / 3.0)
    assert check.deviation(tokens / 3.0) < (1e-5 if dtype == torch.float32 else 2**-8)


def test_shift_labels_are_the_predicted_ones() -> None:
    logits, labels = labelled_logits()
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    check = LogitsCheck(logits, predicted_labels(None, shifted))
    loss, tokens = causal_lm_loss(logits, labels)
    loss.backward()
    check.verify(tokens)


@pytest.mark.parametrize("weight", [1.0, 0.01])
def test_an_added_term_is_refused(weight: float) -> None:
    """A z-loss-like term over the labelled positions, at any weight the fp32 rounding
    cannot hide."""
    logits, labels = labelled_logits()
    check = LogitsCheck(logits, predicted_labels(labels, None))
    loss, tokens = causal_lm_loss(logits, labels)
    extra = logits[:, :-1].logsumexp(-1).pow(2)[labels[:, 1:] != -100].sum() / tokens
    (loss + weight * extra).backward()
    with pytest.raises(UnsupportedTrainingSetup, match="compute_loss override"):
        check.verify(tokens)


def test_a_term_on_unlabelled_positions_is_refused() -> None:
    logits, labels = labelled_logits()
    check = LogitsCheck(logits, predicted_labels(labels, None))
    loss, tokens = causal_lm_loss(logits, labels)
    (loss + 0.01 * logits[0, :2].logsumexp(-1).sum()).backward()
    with pytest.raises(UnsupportedTrainingSetup):
        check.verify(tokens)


def long_logits() -> tuple[Tensor, Tensor]:
    """``(2, 40, V)`` logits and labels: 80 positions, more than one check's draw."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 40, VOCAB, generator=generator).requires_grad_()
    labels = torch.randint(0, VOCAB, (2, 40), generator=generator)
    labels[1, 30:] = -100  # padding
    return logits, labels


def test_a_term_on_each_sequences_last_token_is_refused_at_once() -> None:
    """A score of one token per sequence (at its last label) sits where few random draws
    land: each sequence's last labelled position is always checked."""
    logits, labels = long_logits()
    targets = predicted_labels(labels, None)
    assert targets is not None
    check = LogitsCheck(logits, targets, seed=1)
    loss, tokens = causal_lm_loss(logits, labels)
    last = [int((targets[b] != -100).nonzero().max()) for b in range(2)]
    term = sum(logits[b, t].logsumexp(-1) for b, t in enumerate(last))
    (loss + 0.01 * term).backward()
    with pytest.raises(UnsupportedTrainingSetup):
        check.verify(tokens)


def test_a_term_on_one_inner_position_is_met_over_the_checks() -> None:
    """A term on position 2 of every sequence: each check draws other positions, so the
    checks of a run meet it (here within its first 4, the ones at the start of a run)."""
    refused = []
    for seed in range(1, FIRST + 1):
        logits, labels = long_logits()
        targets = predicted_labels(labels, None)
        assert targets is not None
        check = LogitsCheck(logits, targets, seed=seed)
        loss, tokens = causal_lm_loss(logits, labels)
        (loss + 0.01 * logits[:, 2].logsumexp(-1).sum()).backward()
        try:
            check.verify(tokens)
        except UnsupportedTrainingSetup:
            refused.append(seed)
    assert refused


def test_a_non_finite_row_is_left_to_the_finite_checks() -> None:
    logits, labels = labelled_logits()
    check = LogitsCheck(logits, predicted_labels(labels, None))
    loss, tokens = causal_lm_loss(logits, labels)
    (loss + logits[1, 0, 0] * float("nan")).backward()
    assert check.deviation(tokens) < 1e-5


def log_probs_gradient(weight: float) -> Tensor:
    """The gradient at ``(2, 6)`` log-probs of the fused head's loss ``-3 sum / 10``, plus
    ``weight`` times a squared-log-prob term's."""
    log_probs = (-torch.rand(2, 6, generator=torch.Generator().manual_seed(1))).requires_grad_()
    loss = -3.0 * log_probs.sum() / 10 + weight * log_probs.pow(2).sum() / 10
    loss.backward()
    assert log_probs.grad is not None
    return log_probs.grad


def test_the_fused_heads_own_loss_passes_and_an_added_term_is_refused() -> None:
    verify_uniform(log_probs_gradient(0.0), rounding=2**-24)
    rounded = log_probs_gradient(0.0).to(torch.bfloat16).double()
    verify_uniform(rounded, rounding=2**-8)
    with pytest.raises(UnsupportedTrainingSetup, match="model's log-probs"):
        verify_uniform(log_probs_gradient(0.01), rounding=2**-24)


def test_log_probs_gradients_averaging_to_zero_are_refused_and_zero_has_a_zero_scale() -> None:
    """An advantage-weighted objective (RLOO's, rewards centred per prompt) puts gradients
    of both signs at the log-probs, averaging to zero: no scale of the model's own loss
    gives them, so they are refused rather than read as an infinite scale. A zero gradient
    (nothing labelled) passes, and its scale is 0, not -1/0."""
    advantage = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]])
    with pytest.raises(UnsupportedTrainingSetup, match="model's log-probs"):
        verify_uniform(advantage, rounding=2**-24)
    verify_uniform(torch.zeros(2, 3), rounding=2**-24)
    log_probs = torch.zeros(2, 3, requires_grad=True)
    scale = CausalLMNormalization().observe({}, {"log_probs": log_probs})
    (0.0 * log_probs).sum().backward()
    assert float(scale()) == 0.0
    # unchecked micro-batches (the 5th on): an average of zero otherwise has no scale
    normalization = CausalLMNormalization()
    for _ in range(5):
        log_probs = torch.zeros(2, 3, requires_grad=True)
        scale = normalization.observe({}, {"log_probs": log_probs})
        (advantage * log_probs).sum().backward()
    assert torch.isnan(scale())


class RegularizedTrainer(Trainer):
    """KL-style regularized SFT: the model's loss plus ``WEIGHT`` times each labelled
    token's squared log-partition (a term of the same forward's logits), from compute
    call ``START`` on."""

    WEIGHT = 0.1
    START = 1

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Tensor | None = None,
    ) -> Any:
        self.calls += 1
        loss, outputs = super().compute_loss(
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        if self.calls >= self.START:
            labelled = inputs["labels"][:, 1:] != -100
            lse = outputs.logits[:, :-1].logsumexp(-1).pow(2)[labelled]
            loss = loss + self.WEIGHT * lse.sum() / num_items_in_batch
        return (loss, outputs) if return_outputs else loss


class LateRegularizedTrainer(RegularizedTrainer):
    """The term starts after the micro-batches checked at the start of a run."""

    START = FIRST + 1


def regularized_run(
    tmp_path: Path, callback: TrainerCallback, trainer_class: type[Trainer], steps: int
) -> Trainer:
    return trainer_class(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(tmp_path / "out", max_steps=steps, per_device_train_batch_size=2),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(2 * steps)]),
        data_collator=pad_rows,
        callbacks=[callback],
    )


@pytest.mark.parametrize("kind", ["capture", "selection"])
def test_a_compute_loss_override_adding_a_term_is_refused_before_the_first_update(
    tmp_path: Path, kind: str
) -> None:
    """The store would hold each example's regularized gradient, and the selection would
    rebuild ``.grad`` from it (an audit measured 1.7-4.7e-2 off the fresh backward over
    the kept examples): refused at the first micro-batch, no weight changed."""
    callback: TrainerCallback = (
        GradientCaptureCallback(store_dir=str(tmp_path / "store"), layers="all")
        if kind == "capture"
        else DataSelectionCallback(
            target=[{"input_ids": r} for r in token_rows(2, seed=7)],
            fraction=0.5,
            layers="all",
            **PINNED,
        )
    )
    first = FirstWeights()
    trainer = regularized_run(tmp_path, callback, RegularizedTrainer, steps=2)
    trainer.add_callback(first)
    with pytest.raises(UnsupportedTrainingSetup, match="logits is not the one its own loss"):
        trainer.train()
    first.assert_unchanged()


def test_a_term_added_later_is_refused_at_the_next_checked_micro_batch(tmp_path: Path) -> None:
    """A term that starts after the first checked micro-batches (a KL to the weights a
    LoRA starts from is zero at first) is caught at micro-batch ``EVERY``; the refusal
    says which steps of the store may carry it (those after the check that passed)."""
    capture = GradientCaptureCallback(store_dir=str(tmp_path / "store"), layers="all")
    trainer = regularized_run(tmp_path, capture, LateRegularizedTrainer, steps=EVERY + 2)
    with pytest.raises(UnsupportedTrainingSetup, match="logits is not the one") as info:
        trainer.train()
    assert trainer.state.global_step == EVERY - 1
    message = str(info.value)
    assert f"micro-batch {EVERY}, where the check before passed at micro-batch {FIRST}" in message
    assert "may carry the term in the steps after that one" in message


def test_sft_trainer_override_adding_a_term_to_the_fused_heads_loss_is_refused(
    tmp_path: Path,
) -> None:
    """``SFTTrainer``'s fused head returns log-probs, not logits (its ``compute_loss``
    hands an override logits recomputed without grad): an override that computes TRL's
    fused loss itself plus a squared-log-prob term makes the gradient at the log-probs
    non-uniform, refused at the first micro-batch before any update."""
    from trl import SFTConfig, SFTTrainer

    class RegularizedSFTTrainer(SFTTrainer):
        def compute_loss(
            self,
            model: nn.Module,
            inputs: dict[str, Any],
            return_outputs: bool = False,
            num_items_in_batch: Tensor | None = None,
        ) -> Any:
            outputs = model(**inputs, use_cache=False, fused_lm_head=True)
            log_probs = outputs.log_probs  # zero where no label is predicted
            loss = (-log_probs.sum() + 0.1 * log_probs.pow(2).sum()) / num_items_in_batch
            return (loss, outputs) if return_outputs else loss

    pairs = prompt_completion_pairs(8)
    first = FirstWeights()
    trainer = RegularizedSFTTrainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(tmp_path / "out", config_cls=SFTConfig, packing=False),
        train_dataset=Dataset.from_list([p.row() for p in pairs]),
        processing_class=word_tokenizer(),
        callbacks=[first, GradientCaptureCallback(store_dir=str(tmp_path / "store"))],
    )
    with pytest.raises(UnsupportedTrainingSetup, match="model's log-probs"):
        trainer.train()
    first.assert_unchanged()
