"""How transformers' and TRL's trainers normalize the causal-LM loss, read off each step.

Two output forms are handled, both without a host sync (but on the micro-batches the
own-loss check of :mod:`~tda_plugins.integrations.transformers.logits_check` runs on,
which reads one number):

* ``output.loss`` (``Trainer``): the model's loss is ``sum of token losses / N`` with ``N``
  the ``num_items_in_batch`` keyword (the accumulation window's token count, across
  ranks) or, without it, the micro-batch's label count (:func:`loss_tokens`: its
  ``shift_labels`` where a collator gives them, as transformers' loss reads them); the trainer then
  multiplies or divides it by ``c`` (world size, accumulation steps). The gradient
  arriving at ``output.loss`` *is* ``c``, so ``loss_scale = N / c``.
* ``output.log_probs`` (TRL ``SFTTrainer``'s fused head): the loss is
  ``-c * sum(log_probs) / N``, so every entry of the gradient at ``log_probs`` is ``-c/N``
  and ``loss_scale = -1 / mean(gradient)``, rounded as the gradient's dtype rounds
  (:class:`~tda_plugins.capture.normalization.ReadOffGradient`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from tda_plugins.capture.normalization import GradientAt, ReadOffGradient
from tda_plugins.capture.targets import predicted_labels
from tda_plugins.integrations.transformers.logits_check import (
    LogitsCheck,
    checked_when,
    due,
    verify_uniform,
)


def _field(output: Any, name: str) -> Tensor | None:
    value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
    return value if isinstance(value, Tensor) and value.requires_grad else None


def loss_tokens(labels: Any, shift_labels: Any) -> Tensor:
    """``(B,)`` tokens each example's causal-LM loss sums over, counted as transformers'
    loss takes them: ``shift_labels`` (already shifted) where the model call has them, else
    ``labels[..., 1:]``; ``-100`` is ignored."""
    targets = predicted_labels(labels, shift_labels)
    if targets is None:
        raise ValueError("cannot count the loss's tokens: no labels in the model call")
    return (targets != -100).sum(dim=-1)


class CausalLMNormalization:
    """Loss normalization of HF ``Trainer`` and TRL ``SFTTrainer`` causal-LM training.

    Some micro-batches also check that the trainer backpropagated the model's own loss and
    nothing else, at its logits or the fused head's log-probs
    (:mod:`~tda_plugins.integrations.transformers.logits_check`): a term a ``compute_loss``
    override adds is refused.
    """

    def __init__(self) -> None:
        #: Micro-batches observed so far (which of them the own-loss check runs on).
        self._micro_batches = 0
        #: The last micro-batch whose own-loss check passed (0: none yet).
        self._passed = 0

    def _checked(self, number: int, verify: Callable[[str], None]) -> None:
        """Run micro-batch ``number``'s own-loss check; remember it passed."""
        verify(checked_when(number, self._passed))
        self._passed = number

    def observe(self, kwargs: dict[str, Any], output: Any) -> Callable[[], float | Tensor]:
        self._micro_batches += 1
        number = self._micro_batches
        checked = due(number)
        log_probs = _field(output, "log_probs")
        if log_probs is not None:
            at_log_probs = GradientAt(log_probs)
            rounding = float(torch.finfo(log_probs.dtype).eps) / 2

            def log_probs_scale() -> Tensor:
                gradient = at_log_probs.value().double()
                if checked:
                    self._checked(number, partial(verify_uniform, gradient, rounding))
                mean = gradient.mean()
                # nothing backpropagated through the log-probs (no labelled token): every
                # captured gradient is zero, and so is the scale, not -1/0; a gradient
                # averaging to zero otherwise has no scale (NaN: the store refuses it)
                nothing = torch.where(gradient.any(), torch.nan, 0.0).to(mean)
                return torch.where(mean != 0, -1.0 / mean, nothing)

            return ReadOffGradient.of(log_probs_scale, log_probs.dtype)
        loss = _field(output, "loss")
        if loss is None:
            raise ValueError(
                "the model output has neither a loss nor TRL's log_probs: the batch has no "
                "labels, or the trainer computes the loss outside the model (a "
                "compute_loss_func, or a compute_loss override that pops the labels); train "
                "with labels (a causal-LM collator) and the model's own loss, or capture "
                "with the engine and a LossNormalization of your own"
            )
        at_loss = GradientAt(loss)
        count = kwargs.get("num_items_in_batch")
        if count is None:
            count = loss_tokens(kwargs.get("labels"), kwargs.get("shift_labels")).sum()
        items = torch.as_tensor(count, dtype=torch.float64)

        def loss_scale() -> Tensor:
            return items.to(at_loss.value().device) / at_loss.value().double()

        logits = _field(output, "logits")
        if logits is None or not checked:
            return loss_scale
        targets = predicted_labels(kwargs.get("labels"), kwargs.get("shift_labels"))
        if targets is None or not LogitsCheck.applies(logits, targets):
            return loss_scale
        check = LogitsCheck(logits, targets, seed=number)

        def checked_loss_scale() -> Tensor:
            scale = loss_scale()
            self._checked(number, partial(check.verify, scale))
            return scale

        return checked_loss_scale
