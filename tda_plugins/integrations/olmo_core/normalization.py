"""How OLMo-core normalizes the language-model loss, read off each micro-batch's forward.

``TransformerTrainModule.train_batch`` calls the model once per micro-batch with
``labels`` (the inputs shifted left, ``label_ignore_index`` where no token is predicted),
``loss_reduction="sum"`` and ``loss_div_factor=N``, where ``N`` is the whole rank batch's
count of label tokens (plus the tokens of instances an instance filter masked), the same
for every micro-batch. The model returns ``loss = (sum_t CE_t + z * sum_t lse_t^2) / N``
(the z-loss term only with a ``z_loss_multiplier``) and the train module calls
``loss.backward()``. So the gradient a layer sees is each example's summed objective times
``c / N``, where ``c`` is the gradient arriving at ``loss`` (1 here; read off a hook so
that a loop which rescales the loss is followed too), and ``loss_scale = N / c``.

A plain ``model(input_ids, labels=labels)`` call (``loss_reduction="mean"``, no divisor)
averages over the label tokens, so there ``N`` is that token count. No host sync: the
scale stays a tensor on the loss's device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tda_plugins.capture.normalization import GradientAt, LossScale


def _loss_divisor(kwargs: dict[str, Any]) -> Tensor:
    """``N`` with ``model loss = sum of per-example summed losses / N`` (fp64)."""
    reduction = kwargs.get("loss_reduction", "mean")
    factor = kwargs.get("loss_div_factor")
    divisor = torch.as_tensor(1.0 if factor is None else factor, dtype=torch.float64)
    if reduction == "sum":
        return divisor
    if reduction == "mean":
        labels = kwargs.get("labels")
        if not isinstance(labels, Tensor):
            raise ValueError("cannot count the loss's tokens: the model was called without labels")
        tokens = (labels != kwargs.get("ignore_index", -100)).sum()
        return divisor.to(tokens.device) * tokens
    raise ValueError(
        f"loss_reduction={reduction!r} returns no scalar loss to train on; per-example capture "
        "follows 'sum' (TransformerTrainModule) or 'mean'"
    )


class OLMoCoreLossNormalization:
    """Loss normalization of OLMo-core ``Transformer`` training (any ``loss_reduction``
    except ``"none"``, any ``loss_div_factor``, with or without z-loss).

    Per-example loss: the example's own *summed* training objective, i.e. the sum over its
    label tokens of the cross-entropy, plus ``z_loss_multiplier * logsumexp(logits)^2`` per
    label token when the train module uses z-loss (both are in the gradient it
    backpropagates, and they cannot be told apart inside it).
    """

    def observe(self, kwargs: dict[str, Any], output: Any) -> LossScale:
        loss = getattr(output, "loss", None)
        if not isinstance(loss, Tensor) or not loss.requires_grad or loss.dim() != 0:
            raise ValueError(
                f"the OLMo-core model returned {type(output).__name__} without a scalar loss "
                "that requires grad: train through TransformerTrainModule, or call the model "
                "with labels and loss_reduction='sum' or 'mean'"
            )
        divisor = _loss_divisor(kwargs)
        at_loss = GradientAt(loss)

        def loss_scale() -> Tensor:
            grad = at_loss.value().double()
            return divisor.to(grad.device) / grad

        return loss_scale
