"""``first_non_finite``: every NaN or infinity found, in every floating dtype the store
writes, and finite entries whose sum overflows never flagged."""

from __future__ import annotations

import pytest
import torch

from tda_plugins.utils.finite import first_non_finite

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_entry_is_found_in_its_tensor(dtype: torch.dtype, value: float) -> None:
    tensors = [torch.randn(3, 5, dtype=dtype) for _ in range(4)]
    tensors.insert(0, torch.arange(6))  # integers are skipped
    tensors[3].view(-1)[-1] = value
    assert first_non_finite(tensors) == 3
    assert first_non_finite(tensors[:3] + tensors[4:]) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_opposite_infinities_in_one_tensor_are_found(dtype: torch.dtype) -> None:
    """``inf + -inf`` is NaN: the probe of a tensor holding both is not finite either."""
    t = torch.zeros(8, dtype=dtype)
    t[2], t[5] = float("inf"), float("-inf")
    assert first_non_finite([torch.ones(2, dtype=dtype), t]) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_entries_whose_sum_overflows_are_finite(dtype: torch.dtype) -> None:
    """Entries near the dtype's largest value: their sum overflows to inf, yet every entry
    is finite, so nothing is flagged."""
    big = torch.full((64,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert not torch.isfinite(big.sum(dtype=torch.float64 if dtype == torch.float64 else None))
    assert first_non_finite([big, -big]) is None


def test_nothing_floating_is_finite() -> None:
    assert first_non_finite([]) is None
    assert first_non_finite([torch.arange(3), torch.empty(0)]) is None
