"""AdamW's update, with the trainer's gradient clipping, as a differentiable function of
the weights, the moments and the gradient (docs/design.md section 13.2).

The same function replays the run (under ``no_grad``) and, with a graph, gives the
metagradient's backward the step's vector-Jacobian products; so the weights replayed and
the weights differentiated are one computation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tda_plugins.methods.training_run import AdamWSettings

#: ``(v, 1 - beta2^k, eps) -> denominator`` of Adam's update at step ``k``.
Denominator = Callable[[Tensor, float, float], Tensor]


def _sqrt(v: Tensor) -> Tensor:
    """``sqrt(v)`` with derivative 0 where ``v = 0``: there the gradient was exactly zero
    (``v = (1 - beta2) sum beta2^j g_j^2``), ``sqrt(v)`` is ``|g|`` up to a factor, and 0
    is the derivative of the run for a parameter that no example moves (unused embedding
    rows); autograd's ``inf * 0`` would give NaN."""
    positive = v > 0
    return torch.where(positive, torch.where(positive, v, 1.0).sqrt(), 0.0)


def exact_denominator(v: Tensor, correction2: float, eps: float) -> Tensor:
    """``sqrt(v / (1 - beta2^k)) + eps``, differentiated through ``v``."""
    return _sqrt(v) / math.sqrt(correction2) + eps


def fixed_denominator(v: Tensor, correction2: float, eps: float) -> Tensor:
    """The same value held constant: the derivative treats each step's denominator as a
    fixed per-coordinate learning rate (``v`` is not differentiated)."""
    return exact_denominator(v.detach(), correction2, eps)


ADAM_DENOMINATORS: dict[str, Denominator] = {
    "exact": exact_denominator,
    "fixed": fixed_denominator,
}


def denominator_by_name(name: str) -> Denominator:
    if name not in ADAM_DENOMINATORS:
        raise ValueError(
            f"unknown adam_denominator {name!r}; choose from {sorted(ADAM_DENOMINATORS)}"
        )
    return ADAM_DENOMINATORS[name]


@dataclass
class AdamState:
    """The trainable weights and AdamW's moments before a step, one tensor per parameter
    (in the order of the model's trainable parameters)."""

    params: list[Tensor]
    m: list[Tensor]
    v: list[Tensor]

    @classmethod
    def start(cls, params: Sequence[Tensor]) -> AdamState:
        """Fresh moments, as ``torch.optim.AdamW`` starts them."""
        return cls(
            list(params),
            [torch.zeros_like(p) for p in params],
            [torch.zeros_like(p) for p in params],
        )

    def tensors(self) -> list[Tensor]:
        return [*self.params, *self.m, *self.v]

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor]) -> AdamState:
        """Inverse of :meth:`tensors`."""
        n = len(tensors) // 3
        return cls(list(tensors[:n]), list(tensors[n : 2 * n]), list(tensors[2 * n :]))

    def to(self, device: torch.device | str | None) -> AdamState:
        return AdamState.from_tensors([t.to(device) for t in self.tensors()])


def clipped(grads: Sequence[Tensor], max_norm: float | None) -> list[Tensor]:
    """``grads`` scaled as ``torch.nn.utils.clip_grad_norm_`` scales them: by
    ``min(1, max_norm / (||g|| + 1e-6))``, ``||g||`` over all of them together."""
    if max_norm is None:
        return list(grads)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return [g * coefficient for g in grads]


def adamw_update(
    state: AdamState,
    grads: Sequence[Tensor],
    *,
    lr: float,
    step: int,
    settings: AdamWSettings,
    decays: Sequence[float],
    denominator: Denominator,
) -> AdamState:
    """The state after optimizer step ``step`` (1-based, Adam's bias-correction count):

        g  = clip(grads)
        m' = b1 m + (1 - b1) g,        v' = b2 v + (1 - b2) g^2
        p' = p (1 - lr wd) - lr / (1 - b1^k) * m' / denominator(v', 1 - b2^k, eps)

    exactly ``torch.optim.AdamW`` (up to the order of rounding). Out-of-place, so that
    with a graph every output is differentiable in every input."""
    beta1, beta2 = settings.betas
    correction1, correction2 = 1.0 - beta1**step, 1.0 - beta2**step
    new = AdamState([], [], [])
    for p, m, v, g, decay in zip(
        state.params, state.m, state.v, clipped(grads, settings.max_grad_norm), decays, strict=True
    ):
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p * (1.0 - lr * decay) - (lr / correction1) * m / denominator(
            v, correction2, settings.eps
        )
        new.params.append(p)
        new.m.append(m)
        new.v.append(v)
    return new
