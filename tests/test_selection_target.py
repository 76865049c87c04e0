"""The selection target: which pool examples each refresh uses."""

from __future__ import annotations

import pytest
import torch

from tda_plugins import LayerSelection
from tda_plugins.data_selection.target import TargetPool, target_chunks, target_gradient
from tda_plugins.session.batch import causal_lm_losses
from tests.models import lm_batch, tiny_causal_lm


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


def test_target_gradient_is_the_summed_loss_gradient_and_leaves_grad_alone() -> None:
    """``target_gradient`` equals ``autograd.grad`` of the summed per-example losses (in
    each layer's flattened layout, chunked or not), and the ``.grad`` a training step had
    accumulated is the same tensor with the same values afterwards."""
    model = tiny_causal_lm("llama")
    batch = lm_batch(batch=4, lengths=(10, 7, 9, 5))
    layers = LayerSelection("linear").resolve(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    before = [p.grad for p in params]
    expected = dict(
        zip(
            [id(p) for p in params],
            torch.autograd.grad(causal_lm_losses(model, batch).sum(), params),
            strict=True,
        )
    )
    for chunk in (None, 3):
        got = target_gradient(model, layers, batch, causal_lm_losses, chunk)
        for name, (module, adapter) in layers.items():
            local = {k: expected[id(p)] for k, p in adapter.captured_parameters(module).items()}
            torch.testing.assert_close(got[name], adapter.flatten(module, local))
    assert all(p.grad is g for p, g in zip(params, before, strict=True))
    assert all(bool((p.grad == 0.5).all()) for p in params)


def test_target_factors_are_kept_where_smaller_and_give_the_vector() -> None:
    """The target's per-token factors are kept for exactly the layers where ``S`` target
    tokens make them the smaller form (``S (N_i + N_o) <= N_i N_o``), chunked or not; the
    pass skips those layers' own weight gradients (no vector until asked for), and the
    vector built from the factors is ``autograd.grad`` of the summed losses."""
    model = tiny_causal_lm("llama")
    layers = LayerSelection("linear").resolve(model)
    kept = 0
    for batch, chunk in ((lm_batch(batch=2, length=4), 1), (lm_batch(batch=4, length=10), None)):
        got = target_gradient(model, layers, batch, causal_lm_losses, chunk)
        weights = [module.weight for module, _ in layers.values()]
        expected = torch.autograd.grad(causal_lm_losses(model, batch).sum(), weights)
        tokens = batch["input_ids"].numel()
        for (name, (module, _)), grad in zip(layers.items(), expected, strict=True):
            n_i = module.in_features + int(module.bias is not None)
            n_o = module.out_features
            smaller = tokens * (n_i + n_o) <= n_i * n_o
            assert (name in got.factors) == smaller == (name not in got.vectors), name
            if smaller:
                kept += 1
                assert got.factors[name].batch_size == 1 and got.factors[name].tokens == tokens
            torch.testing.assert_close(got[name], grad.flatten())
    assert kept == len(layers)  # every layer of the 8-token target, none of the 40-token one


def test_uneven_pool_is_chunked_by_length_and_trimmed_with_the_same_gradient() -> None:
    """One long example among short ones: the chunks go longest first and are cut after
    their last attended column (the short ones are no longer padded to the long one), and
    the target gradient is still ``autograd.grad`` of the summed losses of the padded
    batch."""
    model = tiny_causal_lm("llama")
    batch = lm_batch(batch=5, length=12, lengths=(3, 12, 4, 2, 3))
    chunks = target_chunks(batch, 2)
    assert [c["input_ids"].shape[1] for c in chunks] == [12, 3, 2]
    assert [c["attention_mask"].sum(1).tolist() for c in chunks] == [[12, 4], [3, 3], [2]]
    layers = LayerSelection("linear").resolve(model)
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    expected = dict(
        zip(
            params,
            torch.autograd.grad(causal_lm_losses(model, batch).sum(), list(params.values())),
            strict=True,
        )
    )
    got = target_gradient(model, layers, batch, causal_lm_losses, 2)
    for name, (module, adapter) in layers.items():
        local = {k: expected[id(p)] for k, p in adapter.captured_parameters(module).items()}
        torch.testing.assert_close(got[name], adapter.flatten(module, local))
