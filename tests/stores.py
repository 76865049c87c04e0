"""Build gradient stores from tiny models in tests: each example's own summed loss."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tda_plugins import (
    CaptureConsumer,
    CaptureEngine,
    LayerSelection,
    ProjectionConfig,
    causal_lm_example_losses,
)
from tda_plugins.precondition import CurvatureAccumulator
from tda_plugins.store import GradientStore, StoreReader

LossFn = Callable[[nn.Module, Mapping[str, Tensor]], Tensor]


def summed_loss(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """Sum over the batch of each example's summed next-token loss."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return causal_lm_example_losses(model(**inputs).logits, batch["labels"]).sum()


def label_tokens(batch: Mapping[str, Tensor]) -> int:
    """Number of predicted tokens (shifted labels that are not -100): a mean loss's divisor."""
    return int((batch["labels"][:, 1:] != -100).sum())


class ManualScale:
    """A loss normalization whose factor the test sets before each forward call."""

    def __init__(self) -> None:
        self.value = 1.0

    def observe(self, kwargs: dict[str, Any], output: Any) -> Callable[[], float]:
        value = self.value
        return lambda: value


def capture_store(
    model: nn.Module,
    batches: Iterable[Mapping[str, Tensor]],
    path: str | Path,
    layers: LayerSelection | None = None,
    projection: ProjectionConfig | None = None,
    keep_tokens: bool = False,
    curvature: bool = True,
    loss_fn: LossFn = summed_loss,
    mean_loss: bool = False,
    rank: int = 0,
) -> StoreReader:
    """One committed step per batch, K-FAC statistics included; ``.grad`` is cleared.

    ``loss_fn(model, batch)`` is the batch's summed loss. With ``mean_loss`` each batch's
    loss is divided by its :func:`label_tokens` (a trainer's mean loss) and the engine is
    told that count as the loss scale. ``rank`` writes the capture as that rank's part.
    """
    consumers: list[CaptureConsumer] = [GradientStore(path, rank=rank, keep_tokens=keep_tokens)]
    if curvature:
        consumers.append(CurvatureAccumulator(path, rank=rank))
    normalization = ManualScale()
    with CaptureEngine(model, layers, projection, consumers, normalization) as engine:
        for batch in batches:
            scale = label_tokens(batch) if mean_loss else 1
            normalization.value = scale
            (loss_fn(model, batch) / scale).backward()
            engine.optimizer_step()
        engine.end()
    model.zero_grad(set_to_none=True)
    return StoreReader(path)


def flat_oracle_grads(
    model: nn.Module, batches: Iterable[Mapping[str, Tensor]], names: list[str]
) -> torch.Tensor:
    """``(N, D)`` per-example gradients of the parameters ``names`` from the loop oracle."""
    from tests.oracle import loop_oracle

    rows = []
    for batch in batches:
        grads = loop_oracle(model, batch, names)
        rows.append(torch.cat([grads[n].flatten(1) for n in names], dim=1))
    return torch.cat(rows)
