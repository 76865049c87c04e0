"""The check that the trainer backpropagates the model's own loss, read at its logits
(or at the log-probs of TRL's fused head).

The loss normalization reads the trainer's factor ``c`` at ``output.loss``
(:mod:`~tda_plugins.integrations.transformers.normalization`). A ``compute_loss``
override that adds a term computed from the same forward (a KL to a reference model, an
entropy bonus, a loss of its own over the logits) leaves that factor as it was, yet every
layer's captured gradient then carries the added term: the store would hold something
other than each example's own summed token loss, and the selection would rebuild
``.grad`` from it, both without a word.

The model's own causal-LM loss gives its logits an exactly known gradient. With
``s = loss_scale`` (``N / c``), at the position predicting label ``y``

    dL/dz = (softmax(z) - onehot(y)) / s,

and zero where no token is predicted (a ``-100`` label, padding, the last position).
:class:`LogitsCheck` keeps a few rows of the logits (drawn at random over the
micro-batch's positions, a new draw at each check, and each sequence's last labelled and
last position: :func:`sampled_rows`), the gradient that arrives at them, and compares
after the backward: each row's ``||s * dL/dz - (softmax(z) - onehot(y))||`` must stay
within the rounding of the logits' dtype. The rows are copied (``P x V`` values); the
comparison reads one number back to the host, so the normalization runs it on the first
micro-batches of a run and on every :data:`EVERY`-th after (a regularizer that starts at
zero, such as a KL to the model a LoRA starts from, shows within a few steps).

TRL's fused head returns each position's log-probability of its label, not the logits,
and its loss is ``-c * sum(log_probs) / N``: every entry of the gradient at ``log_probs``
is the same ``-c / N`` (:func:`verify_uniform`). A term the override adds from the
log-probs (other than a multiple of their sum, which keeps them uniform and is read as
part of ``c``) makes them differ.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tda_plugins.session.capture import UnsupportedTrainingSetup

#: Logit rows checked per micro-batch.
ROWS = 32
#: Micro-batches checked at the start of a run, then one in every ``EVERY``.
FIRST = 4
EVERY = 16
#: The largest row difference, in units of ``1 / loss_scale``, taken for the recomputed
#: softmax's rounding; twice the logits dtype's unit roundoff is added.
TOLERANCE = 1e-4


def due(micro_batch: int) -> bool:
    """Whether the ``micro_batch``-th (1-based) micro-batch of a run is checked."""
    return micro_batch <= FIRST or micro_batch % EVERY == 0


def sampled_rows(targets: Tensor, seed: int) -> Tensor:
    """Flat ``(B*T)`` positions to check: :data:`ROWS` drawn at random (a new draw per
    ``seed``, so that a term on a few positions is met over the checks), and, for up to
    :data:`ROWS` sequences, the position predicting their last label and their last
    position (where a term on one token of a sequence, such as a score at its end, sits)."""
    sequences, length = targets.shape[0], targets.shape[-1]
    total = targets.numel()
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.randperm(total, generator=generator)[:ROWS].to(targets.device)
    labelled = (targets.reshape(sequences, length)[:ROWS] != -100).int()
    last_label = length - 1 - labelled.flip(-1).argmax(-1)
    starts = torch.arange(labelled.shape[0], device=targets.device) * length
    return torch.unique(torch.cat([drawn, starts + last_label, starts + length - 1]))


class LogitsCheck:
    """Sampled rows of one micro-batch's logits, their labels and the gradient they get.

    Args:
        logits: ``(B, T, V)`` the model output's logits (any floating dtype).
        targets: ``(B, T)`` the label each position predicts, ``-100`` where none.
        seed: which positions to draw (:func:`sampled_rows`).
    """

    def __init__(self, logits: Tensor, targets: Tensor, seed: int = 0):
        flat = logits.detach().flatten(0, -2)
        self.rows = sampled_rows(targets, seed).to(flat.device)
        self.logits = flat[self.rows].float()
        self.targets = targets.flatten()[self.rows.to(targets.device)].to(flat.device)
        self.rounding = float(torch.finfo(logits.dtype).eps) / 2
        self.grad: Tensor | None = None
        logits.register_hook(self._keep)

    @staticmethod
    def applies(logits: Tensor, targets: Tensor) -> bool:
        """Whether the logits line up with the labels (one row per labelled position)."""
        return logits.dim() == targets.dim() + 1 and logits.shape[:-1] == targets.shape

    def _keep(self, grad: Tensor) -> None:
        self.grad = grad.detach().flatten(0, -2)[self.rows].float()

    def deviation(self, loss_scale: Tensor) -> float:
        """The largest row difference between ``loss_scale`` times the gradient that
        arrived and the model's own loss's, in units of ``1 / loss_scale`` (over the
        finite rows)."""
        if self.grad is None:
            return 0.0  # the backward did not reach the logits: nothing to compare
        labelled = self.targets != -100
        own = torch.softmax(self.logits, dim=-1)
        predicting = labelled.nonzero().flatten()
        own[predicting, self.targets[predicting]] -= 1
        own[~labelled] = 0
        own -= self.grad * loss_scale.to(self.grad.device).float()
        rows = own.norm(dim=-1)
        rows = rows[rows.isfinite()]  # a non-finite example is the finite checks' to name
        return float(rows.max()) if rows.numel() else 0.0

    def verify(self, loss_scale: Tensor, when: str = "") -> None:
        """Refuse the micro-batch unless its logits got the model's own loss's gradient
        (``when``: which micro-batch, for the message)."""
        _refuse_beyond(self.deviation(loss_scale), self.rounding, "logits", when)


def verify_uniform(gradient: Tensor, rounding: float, when: str = "") -> None:
    """Refuse the micro-batch unless every finite entry of the gradient at the fused head's
    ``(B, T)`` log-probs is the same, within ``rounding`` (the log-probs dtype's). Entries
    that average to zero without all being zero (an advantage-weighted objective's) are
    refused too: no scale of the model's own loss gives them."""
    values = gradient[gradient.isfinite()].double()
    if not values.numel():
        return
    mean, spread = values.mean(), (values - values.mean()).abs().max()
    if bool(mean != 0):
        off = float(spread / mean.abs())
    else:
        off = 0.0 if not bool(spread) else float("inf")
    _refuse_beyond(off, rounding, "log-probs", when)


def checked_when(micro_batch: int, passed: int) -> str:
    """Which micro-batch a refusal comes at, and what a store of the run then holds: the
    steps after the last check that passed (``passed``, 0: none) may carry the term."""
    if passed == 0 or passed == micro_batch - 1:
        return f" at the run's micro-batch {micro_batch}"
    return (
        f" at the run's micro-batch {micro_batch}, where the check before passed at "
        f"micro-batch {passed}: a store this run wrote may carry the term in the steps "
        "after that one, so capture again once the loss is the model's own"
    )


def _refuse_beyond(off: float, rounding: float, where: str, when: str) -> None:
    """Refuse a difference ``off`` (in units of one token's loss) beyond the tolerance."""
    if off <= TOLERANCE + 2 * rounding:
        return
    raise UnsupportedTrainingSetup(
        f"the gradient at the model's {where} is not the one its own loss gives them "
        f"({off:.3g} off, in units of one token's loss{when}): the trainer backpropagates more "
        "than the model's cross-entropy (a compute_loss override that adds a KL, an "
        f"entropy or another term computed from the {where}), so each example's captured "
        "gradient would not be its own summed token loss's; return "
        "super().compute_loss(...)'s loss unchanged, or capture with the engine and a "
        "LossNormalization of your own"
    )
