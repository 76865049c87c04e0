"""Stable example ids: a content hash of each example's unpadded token ids, on device.

The hash runs as tensor arithmetic on the ids' own device (wrapping int64 products and
xor-shifts, a SplitMix-style mixer), so it needs no host sync. It depends only on the
unpadded tokens and their order: the same text gets the same id with left or right
padding, in any batch, at any position.
"""

from __future__ import annotations

import torch
from torch import Tensor

EXAMPLE_IDS_KEY = "tda_example_ids"
"""Batch key under which a data path may carry ``(B,)`` integer example ids to the engine:
the engine's root pre-hook reads it, and whoever put it in the batch removes it before
the model's own ``forward`` (``integrations.transformers.use_id_column`` does both ends)."""

_M1 = 0x3C79AC492BA7B653  # odd 63-bit constants: multiplications wrap modulo 2**64
_M2 = 0x1C69B3F74AC4AE35
_POS = 0x5851F42D4C957F2D
_GOLDEN = 0x1E3779B97F4A7C15


def _mix(z: Tensor) -> Tensor:
    z = (z ^ (z >> 31)) * _M1
    z = (z ^ (z >> 29)) * _M2
    return z ^ (z >> 32)


_SAME_WIDTH_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _as_integers(x: Tensor) -> Tensor:
    """int64 view of the values: integer ids as they are, floats by their bit pattern."""
    if x.is_floating_point():
        x = x.contiguous().view(_SAME_WIDTH_INT[x.element_size()])
    return x.long()


def content_hash(input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """``(B, T)`` token ids (and optional ``(B, T)`` mask) -> ``(B,)`` int64 ids.

    Masked-out positions (padding) are ignored; positions count real tokens only. Inputs
    that are not token ids (``(B, ...)`` float features) are hashed by their bit patterns.
    """
    ids = _as_integers(input_ids).reshape(input_ids.shape[0], -1)
    if attention_mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    else:
        mask = attention_mask.reshape(ids.shape).bool()
    position = mask.long().cumsum(dim=1)
    per_token = _mix(ids * _GOLDEN + position * _POS)
    total = torch.where(mask, per_token, torch.zeros_like(per_token)).sum(dim=1)
    return _mix(total + mask.long().sum(dim=1))
