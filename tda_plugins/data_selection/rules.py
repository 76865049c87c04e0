"""Which examples of an optimizer step to drop, given their scores (registered rules).

Every rule keeps at least one example: if it would drop them all, the best-scoring
example is kept (an optimizer step on no data is never taken silently). An example whose
score is not finite (a NaN or infinite gradient, or one whose inner products overflow) is
always dropped and never counted: the rule decides among the finite scores alone, so the
mask is empty only when no score is finite (the caller then skips the step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from tda_plugins.registry import Registry

RULES: Registry[DropRule] = Registry("selection rule")
#: Class decorator: make a rule available under a name.
register_rule = RULES.register


def rule_by_name(name: str, **options: float) -> DropRule:
    """Instantiate a registered rule; unknown names list the known ones."""
    return RULES.create(name, **options)


def _bottom(scores: Tensor, fraction: float) -> Tensor:
    """Mask of the ``floor(fraction * N)`` lowest scores (ties broken by position)."""
    count = int(fraction * scores.shape[0])
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[torch.argsort(scores, stable=True)[:count]] = True
    return mask


def _check_fraction(fraction: float) -> None:
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")


class DropRule(ABC):
    """Decides the examples to keep from their ``(N,)`` scores (higher = more helpful)."""

    name: ClassVar[str]

    @abstractmethod
    def dropped(self, scores: Tensor) -> Tensor:
        """``(N,)`` bool mask of the examples the rule drops."""

    def keep(self, scores: Tensor) -> Tensor:
        """``(N,)`` bool mask of kept examples: the rule over the finite scores (non-finite
        ones dropped), never empty unless no score is finite."""
        finite = torch.isfinite(scores)
        keep = torch.zeros_like(scores, dtype=torch.bool)
        rows = finite.nonzero().flatten()
        if rows.numel() == 0:
            return keep
        considered = scores[rows]
        kept = ~self.dropped(considered)
        if not bool(kept.any()):
            kept[torch.argmax(considered)] = True
        keep[rows[kept]] = True
        return keep


@register_rule("bottom_fraction")
class BottomFraction(DropRule):
    """Drop the lowest-scoring ``fraction`` of the step's examples."""

    def __init__(self, fraction: float = 0.25):
        _check_fraction(fraction)
        self.fraction = fraction

    def dropped(self, scores: Tensor) -> Tensor:
        return _bottom(scores, self.fraction)


@register_rule("threshold")
class Threshold(DropRule):
    """Drop every example scoring below ``value``."""

    def __init__(self, value: float = 0.0):
        self.value = value

    def dropped(self, scores: Tensor) -> Tensor:
        return scores < self.value


@register_rule("negative_in_bottom")
class NegativeInBottom(DropRule):
    """Drop examples of the bottom ``fraction`` whose score is negative (they hurt)."""

    def __init__(self, fraction: float = 0.5):
        _check_fraction(fraction)
        self.fraction = fraction

    def dropped(self, scores: Tensor) -> Tensor:
        return _bottom(scores, self.fraction) & (scores < 0)
