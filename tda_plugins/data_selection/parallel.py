"""Data parallelism as selection sees it: the ranks, the gathers a step needs, and where each
captured parameter's ``.grad`` lives (replicated, or sharded on dim 0 by ``fully_shard``).

Under DDP every rank holds the whole ``.grad``; under FSDP2/HSDP (``fully_shard``) a
parameter and its ``.grad`` are DTensors whose rows (dim 0) are split over the mesh's
last dimension (``Shard(0)``), replicated over the first one under HSDP
(``(Replicate(), Shard(0))``). Either way the trainer's collective averages the ranks'
gradients: ``.grad = sum over ranks of each rank's backward / F``, ``F`` the
data-parallel size (or FSDP's ``gradient_divide_factor`` where one is set). Anything else
(tensor parallelism, a shard on another dim, mixed-precision parameters or reductions) is
refused by :func:`check_layout` before any step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.session.capture import UnsupportedTrainingSetup

Layers = Mapping[str, tuple[nn.Module, LayerAdapter]]


@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel ranks (one process: world 1)."""

    world: int = 1
    rank: int = 0

    @classmethod
    def current(cls) -> Ranks:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_world_size(), dist.get_rank())
        return cls()

    def sizes(self, count: int, device: torch.device) -> list[int]:
        """Every rank's ``count``, in rank order (one collective; ``device``: where the
        process group's backend exchanges tensors)."""
        if self.world == 1:
            return [count]
        mine = torch.tensor([count], dtype=torch.int64, device=device)
        counts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(counts, mine)
        return [int(c) for c in torch.cat(counts).tolist()]

    def gather_rows(
        self, local: Tensor, sizes: list[int] | None = None
    ) -> tuple[Tensor, list[int]]:
        """``(B_r, K)`` rows of every rank -> ``(sum_r B_r, K)`` in rank order, and each
        rank's ``B_r`` (two collectives: the counts, unless ``sizes`` gives them, then the
        rows padded to the largest)."""
        if self.world == 1:
            return local, [local.shape[0]]
        sizes = sizes or self.sizes(local.shape[0], local.device)
        padded = local.new_zeros(max(sizes), *local.shape[1:])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]), sizes

    def gather_padded(self, local: Tensor, shape: tuple[int, ...]) -> list[Tensor]:
        """Every rank's ``local`` zero-padded to ``shape`` (the same on every rank), in
        rank order."""
        padded = local.new_zeros(shape)
        padded[tuple(slice(0, n) for n in local.shape)] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return parts

    def all_reduce(self, t: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=op)
        return t


def captured_parameters(layers: Layers) -> Iterable[tuple[str, nn.Parameter]]:
    for name, (module, adapter) in layers.items():
        for local, p in adapter.captured_parameters(module).items():
            yield f"{name}.{local}", p


def is_sharded(layers: Layers) -> bool:
    """Whether the captured parameters are DTensors (``fully_shard``)."""
    return any(isinstance(p, DTensor) for _, p in captured_parameters(layers))


def _fsdp_groups(model: nn.Module) -> list[object]:
    """``fully_shard``'s parameter groups of ``model`` (their mixed-precision policy and
    divide factor are read nowhere else)."""
    groups = []
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        group = getattr(state_of(), "_fsdp_param_group", None) if callable(state_of) else None
        if group is not None:
            groups.append(group)
    return groups


def check_layout(model: nn.Module, layers: Layers) -> None:
    """Refuse, before any step, a parameter layout whose ``.grad`` selection cannot edit
    exactly: sharded other than on dim 0 of a 1-D (FSDP) or 2-D (HSDP) mesh, or computed or
    reduced in another dtype than the parameter's (mixed precision)."""
    dtypes = set()
    for qualified, p in captured_parameters(layers):
        dtypes.add(p.dtype)
        if not isinstance(p, DTensor):
            continue
        placements = tuple(p.placements)
        if not placements or type(placements[-1]) is not Shard or placements[-1].dim != 0:
            raise UnsupportedTrainingSetup(
                f"{qualified} is laid out as {placements}: data selection edits .grad of "
                "parameters replicated (DDP) or sharded on dim 0 by fully_shard (FSDP/HSDP) "
                "only; train without tensor parallelism or a custom shard_placement_fn"
            )
        if any(type(pl) is not Replicate for pl in placements[:-1]):
            raise UnsupportedTrainingSetup(
                f"{qualified} is laid out as {placements}: only HSDP's (Replicate(), "
                "Shard(0)) mesh is supported besides FSDP's Shard(0); train without tensor "
                "or context parallelism"
            )
    for group in _fsdp_groups(model):
        policy = getattr(group, "mp_policy", None)
        for kind in ("param_dtype", "reduce_dtype"):
            dtype = getattr(policy, kind, None)
            if dtype is not None and dtype not in dtypes:
                raise UnsupportedTrainingSetup(
                    f"fully_shard's MixedPrecisionPolicy sets {kind}={dtype}, so .grad is not "
                    "the sum of the captured per-example gradients to the bit; selection "
                    "would remove inexact contributions; train with param_dtype and "
                    "reduce_dtype None (or the parameters' dtype), autocast instead"
                )


def divide_factor(model: nn.Module, ranks: Ranks) -> float:
    """``F`` with ``.grad = sum over ranks of their backward / F``: FSDP's
    ``gradient_divide_factor`` where set, else the data-parallel world size."""
    factors: set[float] = {
        float(f)
        for g in _fsdp_groups(model)
        if (f := getattr(g, "gradient_divide_factor", None)) is not None
    }
    if len(factors) > 1:
        raise UnsupportedTrainingSetup(
            f"fully_shard groups divide gradients by different factors {sorted(factors)}; "
            "selection needs one: set one gradient_divide_factor on the root"
        )
    return factors.pop() if factors else float(ranks.world)


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t`` (a DTensor's local shard, a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def rows_of(p: Tensor) -> slice:
    """The rows (dim 0) of ``p`` that this rank holds (all of them unless sharded)."""
    if not isinstance(p, DTensor):
        return slice(0, p.shape[0])
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return slice(offset[0], offset[0] + shape[0])


def reduced_to_local(summed: Tensor, p: Tensor, ranks: Ranks) -> Tensor:
    """``summed`` (a full-size tensor shaped like ``p``, one part per rank) summed over the
    ranks, of which this rank's rows: an all-reduce for a replicated parameter, a
    reduce-scatter (and an all-reduce over HSDP replicas) for a sharded one."""
    if not isinstance(p, DTensor):
        return ranks.all_reduce(summed)
    partial = DTensor.from_local(
        summed, p.device_mesh, [Partial("sum")] * p.device_mesh.ndim, run_check=False
    )
    return partial.redistribute(p.device_mesh, p.placements).to_local()


def reduce_bytes(p: Tensor, ranks: Ranks) -> float:
    """Bytes a rank receives in :func:`reduced_to_local` of a ``p``-sized tensor (ring
    collectives): an all-reduce ``2 D (W-1)/W``; a reduce-scatter over ``S`` shards
    ``D (S-1)/S`` plus, over ``R`` HSDP replicas, an all-reduce of the shard."""
    size = p.numel() * p.element_size()
    if not isinstance(p, DTensor):
        return 2 * size * (ranks.world - 1) / ranks.world
    shards = p.device_mesh.size(p.device_mesh.ndim - 1)
    replicas = p.device_mesh.size() // shards
    return size * (shards - 1) / shards + 2 * size / shards * (replicas - 1) / replicas
