"""Tensor helpers the gradient representations share: accumulation dtypes, token padding,
memory keys, row runs, and the block sizes of blocked products (sized to a CPU core's
share of the last-level cache)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

GRAM_CHUNK_ELEMENTS = 1 << 24


def accumulation_dtype(t: Tensor) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 for everything else (bf16/fp16/fp32)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def pad_tokens(t: Tensor, tokens: int) -> Tensor:
    """Pad ``(B, T, ...)`` with zero token rows to ``tokens``: zero rows add nothing."""
    if t.shape[1] == tokens:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], tokens - t.shape[1], *t.shape[2:])], dim=1)


def stack_tokens(tensors: list[Tensor]) -> Tensor:
    tokens = max(t.shape[1] for t in tensors)
    return torch.cat([pad_tokens(t, tokens) for t in tensors])


TensorKey = tuple[int, tuple[int, ...], tuple[int, ...]]


def tensor_key(t: Tensor) -> TensorKey:
    """Identifies the memory a tensor views: layers fed by one input share its key."""
    return (t.data_ptr(), tuple(t.shape), t.stride())


def row_runs(rows: Tensor) -> list[slice]:
    """``(n,)`` distinct indices -> the slices of their runs of consecutive ones
    (``[0, 1, 2, 5, 6] -> [0:3, 5:7]``; none: one empty slice); slicing a tensor by them
    gives views."""
    runs: list[slice] = []
    for i in rows.tolist():
        if runs and runs[-1].stop == i:
            runs[-1] = slice(runs[-1].start, i + 1)
        else:
            runs.append(slice(i, i + 1))
    return runs or [slice(0, 0)]


def summed(parts: Iterable[Tensor]) -> Tensor:
    """The sum of one or more tensors, added into the first (which must be a fresh one)."""
    it = iter(parts)
    out = next(it)
    for part in it:
        out += part
    return out


def spans(total: int, step: int) -> list[slice]:
    """``[0, total)`` cut into consecutive slices of ``step`` (the last one shorter)."""
    return [slice(i, min(i + step, total)) for i in range(0, total, step)]


#: Bytes of one block of materialized gradients in a blocked product on a CPU (about a
#: core's share of the last-level cache); other devices take one block.
CPU_BLOCK_BYTES = 1 << 21
#: Fewest output rows in a block: narrower products run far below peak (on the peer
#: benchmark's layer shapes, 128 rows made the blocked cross-Gram 10-45% faster than 32)...
MIN_BLOCK_ROWS = 128
#: ... unless that block would pass this many bytes (wide rows of large batches: 128 rows
#: of a 1536-input layer for 256 + 256 examples are 400 MB); then fewer rows, down to
MAX_BLOCK_BYTES = 1 << 26
#: rows (below them the per-example products that build a block slow down).
FEWEST_BLOCK_ROWS = 32


def output_blocks(out_dim: int, row_bytes: int, like: Tensor) -> list[slice]:
    """Slices of ``out_dim`` output rows, each ``row_bytes`` bytes per row once
    materialized, sized to stay in cache on a CPU; one slice on other devices."""
    if like.device.type != "cpu":
        return [slice(0, out_dim)]
    row_bytes = max(row_bytes, 1)
    step = max(MIN_BLOCK_ROWS, CPU_BLOCK_BYTES // row_bytes)
    step = min(step, max(FEWEST_BLOCK_ROWS, MAX_BLOCK_BYTES // row_bytes))
    return spans(out_dim, step)


def row_chunks(rows: int, cols: int) -> list[slice]:
    """Split ``rows`` so that each ``chunk x cols`` block stays under the chunk budget."""
    step = max(1, GRAM_CHUNK_ELEMENTS // max(cols, 1))
    return spans(rows, step)
