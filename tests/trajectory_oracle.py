"""A brute-force AdamW-influence: training replayed step by step with ``torch.func``, each
example's loss weighted by ``w_z`` (1 by default), then ``d L_query(theta_T) / d w_z`` by
autograd. Nothing of the library's recording or scoring is used.

The replay follows torch's AdamW (decoupled weight decay, bias corrections, ``eps`` added
after the square root) with the trainer's token-mean normalization over each step's
window and its gradient clipping. Held fixed, as AdamW-influence holds them: every
step's Adam denominator ``v``, clipping factor and per-example gradients (taken at the
replayed weights, detached), so that the derivative runs through the first moment and
the weights alone. Only the captured parameters' share of an example's gradient carries
its weight; the other trained parameters follow the unweighted run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from tda_plugins import causal_lm_example_losses

#: One example: unpadded ``(T,)`` input ids and the labels it trained on.
Example = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class AdamWRun:
    """What the replay needs of the run (none of it read from the recorded trajectory).

    Attributes:
        steps: per optimizer step, the ids of the examples its window trained on.
        examples: id -> :data:`Example`.
        lr: the learning rate of each step.
        betas, eps: AdamW's.
        weight_decay: parameter name -> its decay (0 for the trainer's no-decay group).
        max_grad_norm: clipping threshold (0: none).
        captured: the parameters whose per-example gradients carry ``w_z``.
        normalized: divide each step's gradient by its window's label-token count (the
            trainer's ``num_items_in_batch``); else the loss is the plain sum.
    """

    steps: Sequence[Sequence[int]]
    examples: Mapping[int, Example]
    lr: Sequence[float]
    betas: tuple[float, float]
    eps: float
    weight_decay: Mapping[str, float]
    max_grad_norm: float
    captured: frozenset[str]
    normalized: bool = True


def example_loss(model: nn.Module) -> Callable[[dict[str, Tensor], Example], Tensor]:
    """``loss(params, example)``: the example's summed token loss with ``params``
    substituted into ``model`` (the others as they are)."""

    def loss(params: dict[str, Tensor], example: Example) -> Tensor:
        ids, labels = example
        logits = functional_call(model, params, (ids[None],)).logits
        return causal_lm_example_losses(logits, labels[None]).sum()

    return loss


def replay(
    model: nn.Module, run: AdamWRun, queries: Sequence[Example]
) -> tuple[dict[str, Tensor], list[tuple[int, int]], Tensor]:
    """Replay ``run`` from ``model``'s current weights (its trainable parameters).

    Returns the final weights, the ``(step, id)`` of each weighted occurrence, and the
    ``(occurrences, queries)`` derivatives ``d L_q(theta_T) / d w`` (fp64)."""
    loss = example_loss(model)
    theta = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    first = {n: torch.zeros_like(p) for n, p in theta.items()}
    second = {n: torch.zeros_like(p) for n, p in theta.items()}
    occurrences = [(s, i) for s, ids in enumerate(run.steps) for i in ids]
    weights = torch.ones(len(occurrences), dtype=torch.float64, requires_grad=True)
    beta1, beta2 = run.betas
    row = 0
    for s, ids in enumerate(run.steps):
        at = {n: t.detach().requires_grad_() for n, t in theta.items()}
        tokens = sum(int((run.examples[i][1][1:] != -100).sum()) for i in ids)
        norm = tokens if run.normalized else 1
        grad = {n: torch.zeros_like(t) for n, t in theta.items()}
        for i in ids:
            # the loss scaled before the backward, as the trainer scales it: the tiny
            # Llama's RMSNorm takes its backward in fp32, whose rounding follows the scale
            parts = torch.autograd.grad(loss(at, run.examples[i]) / norm, list(at.values()))
            for (n, g), part in zip(grad.items(), parts, strict=True):
                share = weights[row] if n in run.captured else 1.0
                grad[n] = g + share * part
            row += 1
        total = torch.sqrt(sum(g.detach().pow(2).sum() for g in grad.values()))
        clip = 1.0
        if run.max_grad_norm > 0:
            clip = min(1.0, float(run.max_grad_norm / (total + 1e-6)))
        lr, k = run.lr[s], s + 1
        for n in theta:
            g = clip * grad[n]
            decayed = theta[n] * (1 - lr * run.weight_decay[n])
            first[n] = beta1 * first[n] + (1 - beta1) * g
            second[n] = beta2 * second[n] + (1 - beta2) * g.detach() ** 2
            denominator = second[n].sqrt() / (1 - beta2**k) ** 0.5 + run.eps
            theta[n] = decayed - lr / (1 - beta1**k) * first[n] / denominator
    derivatives = []
    for query in queries:
        (d,) = torch.autograd.grad(loss(theta, query), [weights], retain_graph=True)
        derivatives.append(d)
    final = {n: t.detach() for n, t in theta.items()}
    return final, occurrences, torch.stack(derivatives, dim=1)
