"""One layer's AdamW update at one recorded step, entry by entry of its flattened layout.

With the denominator and clipping of the step held at their recorded values, AdamW is
linear in the gradient ``G_t`` of each step (``docs/design.md`` section 7.9):

    m_t         = carry_t * m_{t-1} + intake_t * clip_t * G_t
    theta_{t+1} = decay_t * theta_t - scale_t * m_t

    carry_t = b1        intake_t = 1 - b1        decay_t = 1 - lr wd
    scale_t = lr / (1 - b1^k) / (sqrt(v_t) / sqrt(1 - b2^k) + eps)

with ``k`` the Adam step count after the step and ``v_t`` the second moment after it. A
layer the step did not update (a skipped step) has ``carry = decay = 1`` and
``intake = scale = 0``: its moments and weights stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tda_plugins.trajectory.record import StepRecord


@dataclass(frozen=True)
class AdamTerms:
    """The terms above for one layer and step: fp64 tensors, each ``(D,)`` or 0-dim when
    every entry shares its value (a layer whose parameters are all in one group)."""

    scale: Tensor
    decay: Tensor
    carry: Tensor
    intake: Tensor
    updated: bool

    @classmethod
    def of(
        cls, record: StepRecord, layer: str, second_moment: Tensor, entries: Tensor
    ) -> AdamTerms:
        """The terms of ``layer`` at ``record``'s step, from its ``(D,)`` second moment
        after the step and its ``(D,)`` entry -> parameter map (on the same device)."""
        update = record.layers[layer]
        if not update.updated:
            one, zero = torch.ones((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
            return cls(zero, one, one, zero, False)
        groups = [record.groups[g] for g in update.groups]
        index = entries.long()

        def per_entry(pick: str) -> Tensor:
            values = [getattr(g, pick) for g in groups]
            table = torch.tensor(values, dtype=torch.float64, device=second_moment.device)
            return table[0] if len(set(values)) == 1 else table[index]

        lr, wd = per_entry("lr"), per_entry("weight_decay")
        beta1, beta2 = per_entry("beta1"), per_entry("beta2")
        eps = per_entry("eps")
        k = update.adam_step
        denominator = second_moment.double().sqrt() / (1 - beta2**k).sqrt() + eps
        return cls(lr / (1 - beta1**k) / denominator, 1 - lr * wd, beta1, 1 - beta1, True)
