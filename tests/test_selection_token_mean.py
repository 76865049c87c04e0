"""The selection's rebuild is exact only for a loss that is the token mean over the step's
global batch; any other normalization is refused before ``.grad`` is edited, and
transformers' ``shift_labels`` are the tokens counted and scored.

Through a real ``Trainer``: ``tests/test_selection_exact.py`` (a ``compute_loss`` override
without ``num_items_in_batch``, a collator's ``shift_labels``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tda_plugins.data_selection.token_mean import check_token_mean
from tda_plugins.integrations.transformers.normalization import CausalLMNormalization
from tda_plugins.integrations.transformers.selection import (
    PER_RANK_FIX,
    TOKEN_MEAN_FIX,
    causal_lm_output_losses,
    token_mean_fix,
)
from tda_plugins.session.capture import UnsupportedTrainingSetup

#: Two ranks' loss tokens per example: rank 0 holds 10 tokens, rank 1 holds 30.
COUNTS = torch.tensor([4.0, 6.0, 10.0, 20.0], dtype=torch.float64)
IDS = torch.tensor([11, 12, 13, 14])
#: Loss scales with no rounding (a loss's own), one per example.
EXACT = torch.zeros(4, dtype=torch.float64)


def test_a_global_token_mean_over_two_ranks_passes() -> None:
    """``average_tokens_across_devices``: each rank divides by the 40 global tokens and
    multiplies by the world size 2, DDP divides by 2 (``F``): ``loss_scale = 40 / 2``."""
    check_token_mean(0, IDS, COUNTS, torch.full((4,), 20.0, dtype=torch.float64), EXACT, 2.0, "fix")


def test_each_rank_dividing_by_its_own_tokens_is_refused() -> None:
    """``average_tokens_across_devices=False``: rank 0 divides by its 10 tokens, rank 1 by
    its 30, so rank 0's examples weigh three times rank 1's in ``.grad``."""
    scales = torch.tensor([10.0, 10.0, 30.0, 30.0], dtype=torch.float64)
    with pytest.raises(UnsupportedTrainingSetup, match=r"step 3: .*example 11 by 10 tokens") as e:
        check_token_mean(2, IDS, COUNTS, scales, EXACT, 2.0, "the way out")
    message = str(e.value)
    assert "(times 2, the ranks' gradient divisor: 20)" in message and "has 40 loss" in message
    assert message.endswith("the way out") and "4 of 4" in message


def test_one_token_in_six_hundred_is_refused_on_an_exact_scale() -> None:
    """Per-rank means over 298 and 297 tokens: 2e-3 off the global mean's weight, far
    above rounding for a scale read off an fp32 gradient or a loss."""
    counts = torch.tensor([149.0, 149.0, 149.0, 148.0], dtype=torch.float64)
    scales = torch.tensor([298.0, 298.0, 297.0, 297.0], dtype=torch.float64)
    with pytest.raises(UnsupportedTrainingSetup, match="4 of 4 examples differ"):
        check_token_mean(0, IDS, counts, scales, EXACT, 2.0, "fix")


def test_equal_token_counts_per_rank_make_per_rank_means_a_global_one() -> None:
    counts = torch.tensor([5.0, 15.0, 8.0, 12.0], dtype=torch.float64)  # 20 per rank
    check_token_mean(0, IDS, counts, torch.full((4,), 20.0, dtype=torch.float64), EXACT, 2.0, "fix")


def test_a_bfloat16_gradient_of_the_log_probs_is_taken_for_its_rounding() -> None:
    """TRL's fused head: ``loss_scale = -1 / (-c / N)`` read off a bfloat16 gradient, which
    the normalization says carries bfloat16's rounding; the same scale said to be exact
    is refused."""
    total = 37.0
    log_probs = torch.zeros(2, 5, dtype=torch.bfloat16, requires_grad=True)
    scale = CausalLMNormalization().observe({}, SimpleNamespace(log_probs=log_probs))
    (-log_probs.sum() / total).backward()
    rounded = torch.as_tensor(scale()).reshape(1)
    assert float(rounded) != total  # bfloat16 cannot hold 1/37
    rounding = torch.tensor([scale.rounding], dtype=torch.float64)  # type: ignore[attr-defined]
    assert float(rounding) == 2.0**-8
    check_token_mean(0, IDS[:1], torch.tensor([total]), rounded, rounding, 1.0, "fix")
    with pytest.raises(UnsupportedTrainingSetup):
        check_token_mean(0, IDS[:1], torch.tensor([total]), rounded, EXACT[:1], 1.0, "fix")


def test_the_transformers_fix_names_the_per_rank_mean(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    assert token_mean_fix(args) == TOKEN_MEAN_FIX
    two_ranks = SimpleNamespace(world_size=2, average_tokens_across_devices=False)
    assert token_mean_fix(two_ranks) == PER_RANK_FIX  # type: ignore[arg-type]


def test_a_one_token_difference_in_a_hundred_is_refused() -> None:
    counts = torch.tensor([50.0, 50.0], dtype=torch.float64)
    scales = torch.tensor([99.0, 100.0], dtype=torch.float64)
    with pytest.raises(UnsupportedTrainingSetup, match="1 of 2 examples differ"):
        check_token_mean(0, IDS[:2], counts, scales, EXACT[:2], 1.0, "fix")


def test_score_loss_reads_the_shift_labels_where_the_call_has_them() -> None:
    """Each example's loss against ``shift_labels`` (position ``t`` predicts target ``t``,
    no shift), summed by hand token by token."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 5))
    shift_labels = torch.randint(0, 7, (2, 5))
    shift_labels[0, :2] = -100
    shift_labels[:, -1] = -100
    losses = causal_lm_output_losses(
        SimpleNamespace(logits=logits), {"labels": labels, "shift_labels": shift_labels}
    )
    log_probs = logits.log_softmax(dim=-1)
    expected = torch.tensor(
        [
            -sum(
                float(log_probs[b, t, int(shift_labels[b, t])])
                for t in range(5)
                if shift_labels[b, t] >= 0
            )
            for b in range(2)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(losses, expected)
