"""A buffer reused across steps for large temporary tensors.

Per-example gradients built at every optimizer step (data selection's materialized
layers: tens to a hundred MB) would be fresh allocations each time; on a CPU, glibc
serves blocks that large from ``mmap`` and gives them back at ``free``, so every step
pays a page fault per 4 KiB page it writes (on the selection benchmark's model, about as
much time as materializing saves). Carving them out of one kept buffer touches the pages
once.
"""

from __future__ import annotations

from math import prod

import torch
from torch import Tensor


class Workspace:
    """Flat buffers, one per dtype and device, grown to the largest request and kept.

    The tensors :meth:`carve` returns are views of the buffer: they are valid until the
    next call, which reuses the same memory.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def carve(
        self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
    ) -> list[Tensor]:
        """Uninitialized tensors of ``shapes``, consecutive views of one buffer."""
        sizes = [prod(shape) for shape in shapes]
        buffer = self._buffers.get((dtype, device))
        if buffer is None or buffer.numel() < sum(sizes):
            buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
            self._buffers[(dtype, device)] = buffer
        views, start = [], 0
        for shape, size in zip(shapes, sizes, strict=True):
            views.append(buffer[start : start + size].view(shape))
            start += size
        return views

    def nbytes(self) -> int:
        """Bytes held by the kept buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
