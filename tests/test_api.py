"""The per-example loss used by per_example_gradients and the CLI."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tda_plugins import causal_lm_example_losses


@pytest.mark.parametrize(
    "dtype,expected",
    [
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ],
)
def test_losses_keep_fp64_and_promote_half_precision(
    dtype: torch.dtype, expected: torch.dtype
) -> None:
    logits = torch.randn(2, 5, 7).to(dtype)
    labels = torch.randint(0, 7, (2, 5))
    assert causal_lm_example_losses(logits, labels).dtype == expected


def test_losses_are_shifted_sums_ignoring_minus_100() -> None:
    """Each example's loss is the sum over its predicted tokens, written out by hand."""
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 5))
    labels[1, 3:] = -100
    expected = []
    for b in range(2):
        terms = [
            F.cross_entropy(logits[b, t], labels[b, t + 1])
            for t in range(4)
            if labels[b, t + 1] != -100
        ]
        expected.append(torch.stack(terms).sum())
    torch.testing.assert_close(causal_lm_example_losses(logits, labels), torch.stack(expected))
