"""What the callbacks exchange between the ranks of a data-parallel run.

Every rank of a data-parallel run sees its own share of each global batch. Where a result
must cover the whole global batch (live influence metrics, a report), the ranks exchange
the few numbers per example it needs through a :class:`RankGather`: every rank calls
the same methods in the same order (each call is a collective), and every rank gets the
concatenation over ranks, in rank order.

:func:`rank_gather` picks the strategy for the running process: one process (nothing to
exchange) or the default ``torch.distributed`` process group.

:func:`without_gradient_sync` keeps a pass between training steps (a selection target's,
influence queries') out of DDP's gradient all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn


def process_rank() -> int:
    """This process's rank in the default process group (0 without ``torch.distributed``)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RankGather(Protocol):
    """Concatenates per-rank values over the ranks of a run (a collective per call)."""

    rank: int

    def rows(self, values: Tensor) -> Tensor:
        """``(N_r, ...)`` on each rank -> ``(sum_r N_r, ...)``, rank 0's rows first; the
        ranks may hold different ``N_r`` (trailing dimensions and dtype must agree)."""
        ...

    def objects(self, value: Any) -> list[Any]:
        """One picklable value per rank, as a list in rank order."""
        ...


class OneProcess:
    """The run has one process: nothing to exchange."""

    rank = 0

    def rows(self, values: Tensor) -> Tensor:
        return values

    def objects(self, value: Any) -> list[Any]:
        return [value]


class ProcessGroupGather:
    """Exchanges over a ``torch.distributed`` process group (default: the world).

    Tensors travel on the device they are on (CUDA under NCCL, CPU under gloo). Rows of
    unequal counts are padded to the largest count for the all-gather and cut back after.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def rows(self, values: Tensor) -> Tensor:
        count = torch.tensor([values.shape[0]], dtype=torch.long, device=values.device)
        counts = [torch.empty_like(count) for _ in range(self.size)]
        dist.all_gather(counts, count, group=self.group)
        sizes = [int(c.item()) for c in counts]
        padded = values.new_zeros((max(sizes), *values.shape[1:]))
        padded[: values.shape[0]] = values
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])

    def objects(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out


@contextmanager
def without_gradient_sync(model: nn.Module) -> Iterator[None]:
    """No data-parallel all-reduce in the backward passes of this block (DDP's
    ``no_sync``, composable ``replicate``'s ``set_requires_gradient_sync``): a pass at the
    current weights between training steps (a selection target, influence queries) whose
    ``.grad`` each rank keeps to itself.

    For replicated parameters only: a ``fully_shard``-ed module has the same toggle, but
    there the pass must join FSDP's reduce-scatter (turned off, FSDP would keep this pass's
    unsharded gradients for the next synced backward)."""
    no_sync = getattr(model, "no_sync", None)
    toggle = getattr(model, "set_requires_gradient_sync", None)
    if callable(no_sync):
        with no_sync():
            yield
    elif callable(toggle):
        toggle(False)
        try:
            yield
        finally:
            toggle(True)
    else:
        yield


def rank_gather() -> RankGather:
    """The exchange for this process: over the default process group when one with more
    than one rank is initialized, else :class:`OneProcess`."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ProcessGroupGather()
    return OneProcess()
