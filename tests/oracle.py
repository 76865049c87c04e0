"""Reference per-example gradients, computed without the engine.

* :func:`loop_oracle`: one backward per example on its *unpadded* tokens (so padding can
  only agree with it if it truly contributes nothing).
* :func:`func_oracle`: ``torch.func.vmap`` over ``grad`` of ``functional_call``, losses by
  hand from logits, no attention mask into the vmapped model (right padding only).

Both return ``{param name: (B, *param.shape)}`` of each example's own summed token loss.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from tda_plugins import causal_lm_example_losses


def loop_oracle(
    model: nn.Module, batch: Mapping[str, Tensor], names: list[str]
) -> dict[str, Tensor]:
    params = dict(model.named_parameters())
    out: dict[str, list[Tensor]] = {n: [] for n in names}
    for i in range(batch["input_ids"].shape[0]):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]
        labels = batch["labels"][i][keep][None]
        loss = causal_lm_example_losses(model(input_ids=ids).logits, labels).sum()
        grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
        for n, g in zip(names, grads, strict=True):
            out[n].append(torch.zeros_like(params[n]) if g is None else g)
    return {n: torch.stack(v) for n, v in out.items()}


def func_oracle(
    model: nn.Module, batch: Mapping[str, Tensor], names: list[str]
) -> dict[str, Tensor]:
    params = {n: p.detach() for n, p in model.named_parameters()}
    wanted = {n: params[n] for n in names}
    frozen = {n: p for n, p in params.items() if n not in wanted}

    def example_loss(w: dict[str, Tensor], ids: Tensor, labels: Tensor) -> Tensor:
        # An all-ones mask masks nothing; it only keeps transformers from probing the ids
        # for padding on the host, which vmap cannot do.
        inputs = {"input_ids": ids[None], "attention_mask": torch.ones_like(ids[None])}
        logits = functional_call(model, {**frozen, **w}, (), inputs).logits
        return causal_lm_example_losses(logits, labels[None]).sum()

    return vmap(grad(example_loss), in_dims=(None, 0, 0))(
        wanted, batch["input_ids"], batch["labels"]
    )


def max_rel_error(got: Mapping[str, Tensor], ref: Mapping[str, Tensor]) -> float:
    """Largest per-parameter ``||got - ref|| / ||ref||`` (keys must match)."""
    assert set(got) == set(ref), set(got) ^ set(ref)
    assert got, "nothing to compare"
    errors = []
    for n in ref:
        scale = ref[n].double().norm().clamp_min(1e-30)
        errors.append(((got[n].double() - ref[n].double()).norm() / scale).item())
    return max(errors)
