"""The workspace hands out views of one kept buffer, grown to the largest request."""

from __future__ import annotations

import torch

from tda_plugins.grads.tokens import TokenFactors
from tda_plugins.grads.workspace import Workspace

CPU = torch.device("cpu")


def test_carved_tensors_are_consecutive_views_of_one_kept_buffer() -> None:
    space = Workspace()
    first = space.carve([(2, 3), (4,)], torch.float32, CPU)
    assert [t.shape for t in first] == [(2, 3), (4,)]
    assert first[1].data_ptr() == first[0].data_ptr() + 6 * 4
    again = space.carve([(5,)], torch.float32, CPU)
    assert again[0].data_ptr() == first[0].data_ptr(), "a request that fits reuses the buffer"
    assert space.nbytes() == 10 * 4
    grown = space.carve([(3, 5)], torch.float32, CPU)
    assert grown[0].shape == (3, 5) and space.nbytes() == 15 * 4
    space.carve([(2,)], torch.float64, CPU)
    assert space.nbytes() == 15 * 4 + 2 * 8, "each dtype has its own buffer"


def test_factors_materialized_into_a_buffer_equal_materialize() -> None:
    gen = torch.Generator().manual_seed(0)
    for bias in (False, True):
        factors = TokenFactors(
            torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 6, generator=gen), bias
        )
        (out,) = Workspace().carve([(3, factors.dim)], torch.float32, CPU)
        assert factors.materialize_into(out) is out
        torch.testing.assert_close(out, factors.materialize(), rtol=0, atol=0)
