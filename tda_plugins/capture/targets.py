"""Which label each position of a causal LM predicts, as transformers' loss pairs them."""

from __future__ import annotations

import torch
from torch import Tensor


def next_token_targets(labels: Tensor) -> Tensor:
    """``(B, T)`` labels -> ``(B, T)`` the label each position predicts: the next one, and
    ``-100`` (nothing) at the last position (transformers' ``shift_labels``)."""
    return torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], dim=-1)


def predicted_labels(labels: Tensor | None, shift_labels: Tensor | None) -> Tensor | None:
    """``(B, T)`` the label each logit position predicts (``-100``: none), as transformers'
    loss pairs them: ``shift_labels`` where given, else ``labels`` shifted left."""
    if isinstance(shift_labels, Tensor):
        return shift_labels
    return next_token_targets(labels) if isinstance(labels, Tensor) else None
