"""What the transformers callbacks refuse before step 0, each with its reason and the way out.

Per-example gradients are exact when each process runs whole examples through whole
layers and the hooks see each layer's full input and output gradient: one process, DDP,
and FSDP2 (``fully_shard``, parameters gathered for each layer's forward and backward).
Everything else that would make them wrong, or that the hooks cannot see, is refused
here, before any step runs, by one registered check each (:data:`CHECKS`). The table:

============================  ==========================================================
packing / padding_free        several examples share one sequence
DeepSpeed (however enabled)   ZeRO partitions parameters and gradients outside the hooks
FSDP1                         flat parameters: per-layer gradients are not the layer's
tensor/context/sequence par.  each rank sees part of a layer or of a sequence
DTensor not from fully_shard  tensor parallel: each rank holds part of each gradient
model on several devices      a pipeline or device_map split: untested, refused
torch.compile                 compiled graphs bypass module hooks
============================  ==========================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Replicate, Shard

#: ``check(args, model) -> None, or the reason and the way out``.
Check = Callable[[Any, nn.Module], str | None]
CHECKS: list[Check] = []


def refusal(check: Check) -> Check:
    """Register a check run by :func:`refusals_for`."""
    CHECKS.append(check)
    return check


def refusals_for(args: Any, model: nn.Module) -> list[str]:
    """Every registered check's refusal of this trainer setup (empty: supported)."""
    return [reason for check in CHECKS if (reason := check(args, model)) is not None]


@refusal
def _packing(args: Any, model: nn.Module) -> str | None:
    if getattr(args, "packing", False):
        return (
            "packing=True concatenates several examples into one sequence, so gradients can no "
            "longer be split per example; set packing=False in SFTConfig"
        )
    if getattr(args, "padding_free", False):
        return "padding_free=True flattens the batch into one sequence; set padding_free=False"
    return None


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def _accelerate_uses_deepspeed() -> bool:
    """Whether accelerate was set up for DeepSpeed (its state, when already created)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    state = getattr(AcceleratorState, "_shared_state", {})
    return bool(state) and state.get("distributed_type") == DistributedType.DEEPSPEED


@refusal
def _deepspeed(args: Any, model: nn.Module) -> str | None:
    enabled = (
        bool(getattr(args, "deepspeed", None))
        or getattr(args, "hf_deepspeed_config", None) is not None
        or _true(os.environ.get("ACCELERATE_USE_DEEPSPEED"))
        or _accelerate_uses_deepspeed()
        or any(hasattr(p, "ds_id") for p in model.parameters())  # ZeRO-3 parameters
    )
    if not enabled:
        return None
    return (
        "DeepSpeed (set through TrainingArguments, the accelerate config or "
        "ACCELERATE_USE_DEEPSPEED) partitions parameters and gradients outside the module "
        "hooks, so per-example gradients would be wrong; train with DDP or FSDP2 (accelerate "
        "config distributed_type FSDP, fsdp_version 2) instead"
    )


@refusal
def _fsdp1(args: Any, model: nn.Module) -> str | None:
    wrapped = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    config = getattr(args, "fsdp_config", None) or {}
    version = int(config.get("version", config.get("fsdp_version", 1)) or 1)
    if not wrapped and not (getattr(args, "fsdp", None) and version == 1):
        return None
    return (
        "FSDP1 flattens parameters, so the hooks cannot tell each layer's gradient apart; use "
        "FSDP2 (fsdp_config {'version': 2}, or fully_shard) or DDP"
    )


@refusal
def _split_parallelism(args: Any, model: nn.Module) -> str | None:
    config = getattr(args, "parallelism_config", None)
    split = {
        name: size
        for name in ("tp_size", "cp_size", "sp_size")
        if (size := getattr(config, name, None) or 1) > 1
    }
    tp_size = getattr(model, "_tp_size", None)
    if isinstance(tp_size, int) and tp_size > 1:  # a tp_plan applied by transformers
        split["tp_size"] = tp_size
    if not split:
        return None
    return (
        f"{', '.join(f'{k}={v}' for k, v in split.items())} splits each layer or each sequence "
        "across ranks, so no rank sees an example's whole gradient; train with data "
        "parallelism only (DDP or FSDP2; parallelism_config dp sizes only, no tp_plan)"
    )


def _fully_sharded(module: nn.Module, ancestors: list[nn.Module]) -> bool:
    return any(isinstance(m, FSDPModule) for m in (*ancestors, module))


@refusal
def _tensor_parallel(args: Any, model: nn.Module) -> str | None:
    """DTensor parameters are supported only as FSDP2 places them: managed by a
    ``fully_shard``-ed module, sharded on dim 0 over the data-parallel mesh (HSDP: also
    replicated on its replicate dimension)."""
    allowed = {(Shard(0),), (Replicate(), Shard(0))}

    def visit(module: nn.Module, ancestors: list[nn.Module]) -> str | None:
        for name, param in module.named_parameters(recurse=False):
            if not isinstance(param, DTensor):
                continue
            placements = tuple(param.placements)
            if not _fully_sharded(module, ancestors) or placements not in allowed:
                return f"{type(module).__name__}.{name} ({placements})"
        for child in module.children():
            found = visit(child, [*ancestors, module])
            if found is not None:
                return found
        return None

    found = visit(model, [])
    if found is None:
        return None
    return (
        f"parameter {found} is a DTensor sharded as tensor parallelism shards it, so each rank "
        "holds part of each per-example gradient; train without tp_plan/tensor parallelism "
        "(DDP or FSDP2 only)"
    )


@refusal
def _several_devices(args: Any, model: nn.Module) -> str | None:
    devices = {p.device for p in model.parameters()}
    if len(devices) <= 1:
        return None
    return (
        f"the model's parameters are on {len(devices)} devices ({sorted(map(str, devices))}): "
        "a model split by device_map or a pipeline is not supported; load the whole model on "
        "one device per process and use DDP or FSDP2 to spread it"
    )


@refusal
def _compiled(args: Any, model: nn.Module) -> str | None:
    if type(model).__name__ != "OptimizedModule":
        return None
    return "the model is torch.compile'd, which bypasses module hooks; pass the uncompiled model"
