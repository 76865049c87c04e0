"""Loss normalization: from the backpropagated loss to each example's own summed loss.

A trainer backpropagates some normalized loss (HF: token mean over the batch, times or
divided by accumulation and world-size factors). Stores and methods want each example's
gradient of its own *summed* token loss. A :class:`LossNormalization` observes each root
forward call and returns a function that, once the backward has run, gives the factor
``loss_scale`` with ``per-example summed-loss gradient = captured gradient * loss_scale``.
It may return a tensor, so that no host sync is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor

LossScale = Callable[[], float | Tensor]


class LossNormalization(Protocol):
    """Strategy that knows how a training loop normalizes its loss."""

    def observe(self, kwargs: dict[str, Any], output: Any) -> LossScale:
        """Called at each root forward under grad with its keyword inputs and output."""
        ...


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
