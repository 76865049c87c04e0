"""The check that a step's loss is the token mean over its global batch.

The selection rebuilds ``.grad`` as ``sum_{kept} c_i / F * N_all / N_kept``
(:mod:`~tda_plugins.data_selection.surgery`). That is the gradient of a fresh backward
over the kept examples only if every example's captured contribution ``c_i`` is its own
summed-token-loss gradient ``g_i`` times ``F / N_all``: the trainer divides the loss of
every micro-batch of the step, on every rank, by the same global token count ``N_all``.
Each record's ``loss_scale`` is what the trainer divided by (``g_i = c_i * loss_scale``),
so the condition reads ``loss_scale * F == N_all`` for every example.

A trainer that divides each micro-batch by its own token count (a ``compute_loss`` override
that drops ``num_items_in_batch``), each rank by its own (``average_tokens_across_devices=
False``), or counts other tokens than the selection does breaks it: the selection would
hand the optimizer another gradient than the trainer's normalization of the kept examples,
without a word. :func:`check_token_mean` refuses such a step before ``.grad`` is edited.
"""

from __future__ import annotations

from torch import Tensor

from tda_plugins.session.capture import UnsupportedTrainingSetup

#: Relative difference between ``loss_scale * F`` and the step's token count taken for
#: rounding, plus twice the rounding a scale says it carries (a record's
#: ``loss_scale_rounding``: 2^-8 read off a bfloat16 gradient, as TRL's fused head on a
#: bfloat16 model gives it); a loss's own scale is exact.
TOLERANCE = 1e-6

#: The way out when no integration names its own.
GENERIC_FIX = "normalize the loss by the token count of the step's whole global batch"


def check_token_mean(
    step: int,
    ids: Tensor,
    counts: Tensor,
    scales: Tensor,
    roundings: Tensor,
    divide: float,
    fix: str,
) -> None:
    """Refuse step ``step`` unless every example's loss was divided by the step's tokens.

    Args:
        step: the optimizer step, 0-based (named as ``step + 1``).
        ids: ``(N,)`` the examples' ids.
        counts: ``(N,)`` loss tokens of every example of the global batch.
        scales: ``(N,)`` fp64 each example's ``loss_scale`` (what its loss was divided by).
        roundings: ``(N,)`` the relative rounding each scale carries.
        divide: ``F``, the trainer's gradient divisor over ranks.
        fix: the integration's way out.

    Raises:
        UnsupportedTrainingSetup: some example's loss was divided by another count.
    """
    total = float(counts.double().sum())
    if total <= 0:
        return  # no loss token in the step: nothing to normalize, nothing kept to rescale
    divided = scales.double() * divide
    tolerance = TOLERANCE + 2 * roundings.double()
    off = ((divided - total).abs() > tolerance * total).nonzero().flatten()
    if off.numel() == 0:
        return
    first = int(off[0])
    ranks = f" (times {divide:g}, the ranks' gradient divisor: {float(divided[first]):.6g})"
    raise UnsupportedTrainingSetup(
        f"step {step + 1}: the trainer divided the loss of example {int(ids[first])} by "
        f"{float(scales[first]):.6g} tokens{ranks if divide != 1 else ''}, but the step's "
        f"global batch has {total:.6g} loss tokens ({off.numel()} of {scales.numel()} "
        "examples differ). The selection rebuilds .grad as the token mean over the kept "
        "examples of the whole step, so it would differ from the trainer's own "
        f"normalization; {fix}"
    )
