"""Loss normalization: from the backpropagated loss to each example's own summed loss.

A trainer backpropagates some normalized loss (HF: token mean over the batch, times or
divided by accumulation and world-size factors). Stores and methods want each example's
gradient of its own *summed* token loss. A :class:`LossNormalization` observes each root
forward call and returns a function that, once the backward has run, gives the factor
``loss_scale`` with ``per-example summed-loss gradient = captured gradient * loss_scale``.
It may return a tensor, so that no host sync is needed. A scale read off a gradient in a
16-bit dtype carries that dtype's rounding: such a strategy returns a
:class:`ReadOffGradient`, which says how much.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

LossScale = Callable[[], float | Tensor]


class LossNormalization(Protocol):
    """Strategy that knows how a training loop normalizes its loss."""

    def observe(self, kwargs: dict[str, Any], output: Any) -> LossScale:
        """Called at each root forward under grad with its keyword inputs and output."""
        ...


@dataclass(frozen=True)
class ReadOffGradient:
    """A loss scale read off a gradient whose dtype rounds it.

    Attributes:
        read: gives the scale once the backward has run.
        rounding: the relative rounding the scale carries (the gradient dtype's unit
            roundoff: 2^-8 for bfloat16, 2^-24 for float32).
    """

    read: Callable[[], float | Tensor]
    rounding: float

    def __call__(self) -> float | Tensor:
        return self.read()

    @classmethod
    def of(cls, read: Callable[[], float | Tensor], dtype: torch.dtype) -> ReadOffGradient:
        """``read``'s scale, rounded as a gradient of ``dtype`` is."""
        return cls(read, float(torch.finfo(dtype).eps) / 2)


def scale_rounding(scale: LossScale) -> float:
    """The relative rounding ``scale`` carries (0 unless it is a :class:`ReadOffGradient`)."""
    return scale.rounding if isinstance(scale, ReadOffGradient) else 0.0


class SummedLoss:
    """The backpropagated loss already is the sum of per-example summed losses (scale 1)."""

    def observe(self, kwargs: dict[str, Any], output: Any) -> LossScale:
        return _one


def _one() -> float:
    return 1.0


class GradientAt:
    """Keeps the gradient that arrives at a tensor of the model output during backward.

    Normalization strategies read the trainer's loss factor off it: the gradient at the
    model's loss output is exactly the factor the trainer applied after the model.
    """

    def __init__(self, tensor: Tensor):
        self.grad: Tensor | None = None
        tensor.register_hook(self._keep)

    def _keep(self, grad: Tensor) -> None:
        self.grad = grad

    def value(self) -> Tensor:
        """The gradient; an error when the backward never reached the tensor."""
        if self.grad is None:
            raise RuntimeError(
                "the micro-batch's loss was not backpropagated through the model output; "
                "tda-plugins cannot derive the loss normalization of this training loop"
            )
        return self.grad
