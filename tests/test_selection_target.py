"""The selection target: which pool examples each refresh uses."""

from __future__ import annotations

import pytest
import torch

from tda_plugins.selection.target import TargetPool


def _pool(size: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(size)[:, None] * torch.ones(1, 3, dtype=torch.long)}


def test_whole_pool_by_default() -> None:
    pool = TargetPool(_pool(4))
    for _ in range(3):
        assert pool.next_batch()["input_ids"][:, 0].tolist() == [0, 1, 2, 3]


def test_per_refresh_takes_the_next_examples_in_turn_and_wraps() -> None:
    pool = TargetPool(_pool(5), per_refresh=2)
    taken = [pool.next_batch()["input_ids"][:, 0].tolist() for _ in range(4)]
    assert taken == [[0, 1], [2, 3], [4, 0], [1, 2]]


@pytest.mark.parametrize("per_refresh", [0, 6])
def test_per_refresh_outside_the_pool_is_refused(per_refresh: int) -> None:
    with pytest.raises(ValueError, match="between 1 and the pool size 5"):
        TargetPool(_pool(5), per_refresh=per_refresh)
