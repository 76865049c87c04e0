"""Which examples of an optimizer step to drop, given their scores (registered rules).

Every rule keeps at least one example: if it would drop them all, the best-scoring
example is kept (an optimizer step on no data is never taken silently). An example whose
score is not finite (a NaN or infinite gradient, or one whose inner products overflow) is
always dropped and never counted: the rule decides among the finite scores alone, so the
mask is empty only when no score is finite (the caller then skips the step).

Ranked rules (:class:`RankedRule`: ``bottom_fraction``, ``top_fraction``, ``random``) drop
the first ``floor(fraction * N)`` examples of an order; given a ``count`` instead (a
replayed schedule, ``SelectionSettings.drop_counts``) they drop that many in the same
order, so a baseline can keep as many examples per step as another run did.
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


def _check_fraction(fraction: float) -> None:
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")


class DropRule(ABC):
    """Decides the examples to keep from their ``(N,)`` scores (higher = more helpful)."""

    name: ClassVar[str]

    @abstractmethod
    def dropped(self, scores: Tensor, count: int | None = None) -> Tensor:
        """``(N,)`` bool mask of the examples the rule drops (``count``: how many, for the
        ranked rules; the others refuse it)."""

    def keep(self, scores: Tensor, count: int | None = None) -> Tensor:
        """``(N,)`` bool mask of kept examples: the rule over the finite scores (non-finite
        ones dropped), never empty unless no score is finite."""
        finite = torch.isfinite(scores)
        keep = torch.zeros_like(scores, dtype=torch.bool)
        rows = finite.nonzero().flatten()
        if rows.numel() == 0:
            return keep
        considered = scores[rows]
        kept = ~self.dropped(considered, count)
        if not bool(kept.any()):
            kept[torch.argmax(considered)] = True
        keep[rows[kept]] = True
        return keep


class RankedRule(DropRule):
    """Drops the first ``floor(fraction * N)`` examples of :meth:`order` (or ``count``)."""

    def __init__(self, fraction: float = 0.25):
        _check_fraction(fraction)
        self.fraction = fraction

    @abstractmethod
    def order(self, scores: Tensor) -> Tensor:
        """``(N,)`` example positions, the first dropped first."""

    def dropped(self, scores: Tensor, count: int | None = None) -> Tensor:
        count = int(self.fraction * scores.shape[0]) if count is None else count
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask[self.order(scores)[: max(count, 0)]] = True
        return mask


class UnrankedRule(DropRule):
    """A rule whose number of drops follows from the scores themselves."""

    @abstractmethod
    def drops(self, scores: Tensor) -> Tensor:
        """``(N,)`` bool mask of the examples dropped."""

    def dropped(self, scores: Tensor, count: int | None = None) -> Tensor:
        if count is not None:
            raise ValueError(
                f"rule {self.name!r} decides how many to drop from the scores; a replayed "
                "count (drop_counts) needs bottom_fraction, top_fraction or random"
            )
        return self.drops(scores)


@register_rule("bottom_fraction")
class BottomFraction(RankedRule):
    """Drop the lowest-scoring ``fraction`` of the step's examples (ties: the earlier)."""

    def order(self, scores: Tensor) -> Tensor:
        return torch.argsort(scores, stable=True)


@register_rule("top_fraction")
class TopFraction(RankedRule):
    """Drop the highest-scoring ``fraction`` (with ``score="loss"``: the lowest-loss
    examples; a baseline, or an ablation of a helpful score)."""

    def order(self, scores: Tensor) -> Tensor:
        return torch.argsort(-scores, stable=True)


@register_rule("random")
class RandomFraction(RankedRule):
    """Drop ``fraction`` of the step's examples uniformly at random, whatever their scores
    (the baseline every score must beat). Reproducible: the ``k``-th decision of a rule
    draws from a generator seeded with ``(seed, k)``, the same on every rank."""

    def __init__(self, fraction: float = 0.25, seed: int = 0):
        super().__init__(fraction)
        self.seed = int(seed)
        self.calls = 0

    def order(self, scores: Tensor) -> Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.calls)
        self.calls += 1
        return torch.randperm(scores.shape[0], generator=generator).to(scores.device)


@register_rule("threshold")
class Threshold(UnrankedRule):
    """Drop every example scoring below ``value``."""

    def __init__(self, value: float = 0.0):
        self.value = value

    def drops(self, scores: Tensor) -> Tensor:
        return scores < self.value


@register_rule("negative_in_bottom")
class NegativeInBottom(UnrankedRule):
    """Drop examples of the bottom ``fraction`` whose score is negative (they hurt)."""

    def __init__(self, fraction: float = 0.5):
        _check_fraction(fraction)
        self.fraction = fraction

    def drops(self, scores: Tensor) -> Tensor:
        return BottomFraction(self.fraction).dropped(scores) & (scores < 0)
