"""Which examples of an optimizer step to drop, given their scores (registered rules).

Every rule keeps at least one example: if it would drop them all, the best-scoring
example is kept (an optimizer step on no data is never taken silently). An example whose
score is not finite (a NaN or infinite gradient, or one whose inner products overflow) is
always dropped and never counted: the rule decides among the finite scores alone, so the
mask is empty only when no score is finite (the caller then skips the step).

Ranked rules (:class:`RankedRule`: ``bottom_fraction``, ``top_fraction``, ``random``) drop
the first ``floor(fraction * N)`` examples of an order; given a ``count`` instead (a
replayed schedule, ``SelectionSettings.drop_counts``) they drop that many in the same
order, so a baseline can keep as many examples per step as another run did. A set rule
(:class:`SetRule`: ``step_cosine``) weighs the examples together, from their dots with the
target and the Gram matrix of their gradients.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from tda_plugins.utils.registry import Registry

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
    #: Whether the rule reads the examples' Gram matrix (:class:`SetRule`).
    needs_gram: ClassVar[bool] = False

    @abstractmethod
    def dropped(self, scores: Tensor, count: int | None = None) -> Tensor:
        """``(N,)`` bool mask of the examples the rule drops (``count``: how many, for the
        ranked rules; the others refuse it)."""

    def state(self) -> dict[str, int]:
        """What the rule carries from one decision to the next (saved with a checkpoint);
        none for a rule that decides from the step alone."""
        return {}

    def load_state(self, state: dict[str, int]) -> None:
        """Go on from :meth:`state` (a resumed run)."""
        if state:
            raise ValueError(f"rule {self.name!r} keeps no state between steps, got {state}")

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

    def state(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state(self, state: dict[str, int]) -> None:
        self.calls = int(state["calls"])


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


class SetRule(DropRule):
    """A rule over the examples together: ``(N,)`` inner products ``d_i = <g_i, T>`` with
    the target and the ``(N, N)`` Gram matrix ``G_ij = <g_i, g_j>`` of their gradients."""

    needs_gram = True

    def dropped(self, scores: Tensor, count: int | None = None) -> Tensor:
        raise TypeError(f"rule {self.name!r} decides from the dots and the Gram matrix")

    @abstractmethod
    def kept_of(self, dots: Tensor, gram: Tensor) -> Tensor:
        """``(N,)`` bool mask of the examples kept (at least one), from finite values."""


@register_rule("step_cosine")
class StepCosine(SetRule):
    """Keep the examples whose summed gradient, the direction the optimizer steps in,
    points most closely along the target: starting from the whole step, drop one at a time
    the example whose removal raises ``c = cos(sum_{kept} g_i, T)`` the most, while that
    raises ``c`` by more than ``margin * |c|`` (greedy backward elimination; ``O(N^2)``
    per removal).

    Dropping example ``i`` raises the cosine when its share of the step's alignment with
    the target, ``d_i / sum_kept d``, is below its share of the step's squared length,
    ``sum_{j kept} G_ij / sum_{kept} G``, roughly: examples that lengthen the step more
    than they turn it towards the target (high-loss noise, another task's gradient) go;
    examples like the rest of a clean step stay, since removing one of them shortens the
    step's aligned part as much as its noise. The margin keeps the examples whose removal
    would barely change the direction.

    Args:
        margin: least relative rise of the cosine that justifies a drop, ``>= 0``.
    """

    def __init__(self, margin: float = 0.01):
        if not margin >= 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.margin = margin

    def kept_of(self, dots: Tensor, gram: Tensor) -> Tensor:
        dots, gram = dots.double(), gram.double()
        keep = torch.ones(dots.shape[0], dtype=torch.bool)
        aligned = dots.sum()
        length = gram.sum()
        rows = gram.sum(dim=1)  # sum_{j kept} G_ij
        if length <= 0:
            return keep
        current = aligned / length.sqrt()
        tiny = torch.finfo(torch.float64).tiny
        while int(keep.sum()) > 1:
            remaining = length - 2 * rows + gram.diagonal()
            candidate = (aligned - dots) / remaining.clamp(min=tiny).sqrt()
            candidate = torch.where(keep & (remaining > 0), candidate, -torch.inf)
            best = int(torch.argmax(candidate))
            gain = max(self.margin, 1e-12) * abs(float(current))
            if not bool(candidate[best] > current + gain):
                break
            keep[best] = False
            aligned, length, current = aligned - dots[best], remaining[best], candidate[best]
            rows = rows - gram[:, best]
        return keep
