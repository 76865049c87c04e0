"""Refuse batches that pack several sequences into one row.

A padding-free collator (transformers' ``DataCollatorWithFlattening``, TRL's
``padding_free``, a user's own) concatenates a batch's examples into one row and tells
the model where each starts through ``position_ids`` that restart at 0, or through the
flash-attention keywords ``cu_seq_lens_q``/``cu_seq_lens_k``. Per-example capture sees
one row as one example: its gradient would be the pack's sum and its id the pack's, a
silently wrong store. The engine's root pre-hook calls :func:`packed_rows` on every
micro-batch's forward keywords, so the first packed batch stops the run before its
backward, before any optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

#: The keywords that carry the boundaries of sequences packed into one row.
_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")

PACKED_ROWS_FIX = (
    "capture needs one example per row: pad the batch instead (transformers' "
    "DataCollatorWithPadding or DataCollatorForLanguageModeling, not "
    "DataCollatorWithFlattening; in TRL's SFTConfig padding_free=False and packing=False)"
)


def packed_rows(kwargs: Mapping[str, Any]) -> str | None:
    """Why the forward keywords ``kwargs`` pack several sequences into one row, or
    ``None`` when each row is one sequence.

    Packed: a sequence-boundary keyword (``cu_seq_lens_q``/``_k``), or 2-D
    ``position_ids`` that go down between two real tokens of a row (the next sequence
    starting); padding positions (``attention_mask`` 0), which generation code may set
    to anything, are not compared."""
    given = [key for key in _BOUNDARY_KEYS if kwargs.get(key) is not None]
    if given:
        return f"the forward receives {given[0]}, the boundaries of sequences packed in a row"
    positions = kwargs.get("position_ids")
    if not isinstance(positions, Tensor) or positions.dim() != 2 or positions.shape[1] < 2:
        return None
    down = positions[:, 1:] < positions[:, :-1]
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.shape == positions.shape:
        real = mask.bool()
        down &= real[:, 1:] & real[:, :-1]
    if not bool(down.any()):
        return None
    row, at = (int(i) for i in down.nonzero()[0])
    return (
        f"position_ids restart within row {row} (at token {at + 1}: "
        f"{int(positions[row, at])} -> {int(positions[row, at + 1])}), so the row holds "
        "several sequences"
    )
