"""The selection target: the summed loss gradient of target examples, in the layers' layout.

The target needs no per-example gradients, only their sum, so it comes from one plain
backward of the summed loss (no capture hooks, no per-token factors kept): its cost is a
forward and backward over the target examples and nothing more. A :class:`TargetPool`
hands out which examples each refresh uses: the whole pool, or the next ``m`` of it in
turn (the dattri-llm protocol scores each step against one example of a 16-example pool).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from tda_plugins.api import grads_set_aside
from tda_plugins.capture.adapters import LayerAdapter

Batch = Mapping[str, Tensor]
#: ``(model, batch) -> (B,)`` per-example losses, each the sum over its loss tokens.
ExampleLosses = Callable[[nn.Module, Batch], Tensor]


def target_gradient(
    model: nn.Module,
    layers: Mapping[str, tuple[nn.Module, LayerAdapter]],
    batch: Batch,
    losses: ExampleLosses,
    chunk_size: int | None = None,
) -> dict[str, Tensor]:
    """Gradient of ``sum_i L_i`` over ``batch`` (``L_i``: example ``i``'s summed-token
    loss) for each layer's captured parameters.

    Args:
        model: the model, called by ``losses``; its ``.grad`` is set aside during the
            backward and restored, so a training step in progress is untouched.
        layers: name -> (module, adapter), e.g. an engine's ``captured_layers``.
        batch: tensors with the example axis first.
        losses: per-example summed losses of a batch.
        chunk_size: examples per forward/backward (default: all at once).

    Returns:
        layer name -> ``(D,)`` gradient in the layout of the layer's flattened per-example
        gradients. A parameter shared by several layers (tied weights) gets its full
        gradient in each of them.
    """
    size = len(next(iter(batch.values())))
    step = chunk_size or size
    with grads_set_aside(model):
        with torch.enable_grad():
            for start in range(0, size, step):
                chunk = {k: v[start : start + step] for k, v in batch.items()}
                losses(model, chunk).sum().backward()
        out = {}
        for name, (module, adapter) in layers.items():
            params = adapter.captured_parameters(module)
            grads = {
                # this backward's own .grad tensors (set aside on exit): no copy needed
                local: p.grad.detach() if p.grad is not None else torch.zeros_like(p)
                for local, p in params.items()
            }
            out[name] = adapter.flatten(module, grads)
        return out


class TargetPool:
    """The target examples, and which of them each refresh uses.

    Args:
        batch: the pool, tensors with the example axis first (``P`` examples).
        per_refresh: examples per refresh; ``None`` (default) or ``P``: the whole pool
            every time; ``m < P``: the next ``m`` examples in turn, wrapping around.
    """

    def __init__(self, batch: Batch, per_refresh: int | None = None):
        self.batch = dict(batch)
        self.size = len(next(iter(self.batch.values())))
        if per_refresh is not None and not 1 <= per_refresh <= self.size:
            raise ValueError(
                f"target_examples must be between 1 and the pool size {self.size}, got "
                f"{per_refresh}"
            )
        self.per_refresh = per_refresh or self.size
        self._next = 0

    def next_batch(self, device: torch.device | None = None) -> dict[str, Tensor]:
        """The examples of the coming refresh, moved to ``device``."""
        rows = (torch.arange(self.per_refresh) + self._next) % self.size
        self._next = (self._next + self.per_refresh) % self.size
        return {k: v[rows].to(device) for k, v in self.batch.items()}
