"""Each training example's own loss, read from the training forward's output (``score="loss"``).

The loss-based baselines (drop the highest- or the lowest-loss examples of a step) need no
target and no second pass: a forward hook on the model computes every example's summed
token loss from the output the trainer's own forward produced, without gradient, and keeps
it until the step's selection reads it. A micro-batch is matched to its capture record by
its ``labels`` tensor (the record holds a reference to the forward's own), so an
evaluation forward, a target pass or a forward the capture did not record is never mixed
in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from tda_plugins.capture.records import MicroBatchRecord

#: ``(output, forward kwargs) -> (B,)`` each example's summed token loss (e.g.
#: :func:`~tda_plugins.session.batch.causal_lm_example_losses` of the logits and the labels).
OutputLosses = Callable[[Any, Mapping[str, Any]], Tensor]


class ForwardLosses:
    """Per-example losses of the training forwards since the last :meth:`clear`.

    Args:
        model: the model the trainer calls (its forward hook reads the output).
        losses: per-example summed losses from a forward's output and keyword arguments.

    Cost: one loss evaluation per training forward, without gradient (for a causal LM, a
    cross-entropy over the logits it already computed).
    """

    def __init__(self, model: nn.Module, losses: OutputLosses):
        self.losses = losses
        self._by_labels: dict[int, tuple[Tensor, Tensor]] = {}
        self._hook = model.register_forward_hook(self._on_output, with_kwargs=True)

    def _on_output(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        labels = kwargs.get("labels")
        if not torch.is_grad_enabled() or not isinstance(labels, Tensor):
            return  # evaluation, or nothing to match a record by
        with torch.no_grad():
            self._by_labels[id(labels)] = (labels, self.losses(output, kwargs).detach())

    def of(self, record: MicroBatchRecord) -> Tensor:
        """``(B,)`` summed token losses of the micro-batch of ``record``.

        Raises:
            ValueError: no training forward with the record's labels was seen (the model
                was called without ``labels``, or by a path this hook does not see).
        """
        entry = self._by_labels.get(id(record.labels)) if record.labels is not None else None
        if entry is None or entry[0] is not record.labels:
            raise ValueError(
                "score='loss' reads each example's loss from the training forward, but this "
                "micro-batch's forward had no labels the selection saw; call the model with "
                "labels, or use a gradient score"
            )
        return entry[1]

    def clear(self) -> None:
        """Forget the losses kept so far (after each optimizer step)."""
        self._by_labels.clear()

    def remove(self) -> None:
        """Unhook from the model."""
        self._hook.remove()
        self.clear()
