"""The selection schedule of a run, saved at each checkpoint so that a resumed run selects
exactly as an uninterrupted one.

A selection session keeps state across steps that its trainer's checkpoint does not hold:
the target gradient of the last refresh (computed at weights the resumed run no longer
has), the step it was computed at, the global batch size that sets the refresh interval
(``refresh_every=None``), the target pool's cursor (``target_examples``), the draws of
``rule="random"`` and the surgery's summed share of the last step (which picks each layer's
route, so the rounding of scores). :class:`ScheduleState` holds them; the trainer
integrations save one beside each checkpoint (one file per rank:
:func:`write_state`, :func:`read_state`) and restore it when a run resumes.

The file is safetensors (tensors) with the rest as JSON in its metadata; it is written to
a temporary name and renamed, so a crash leaves the previous file or none.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from tda_plugins.data_selection.target import Target
from tda_plugins.grads.blocks import TensorKey, tensor_key
from tda_plugins.grads.tokens import TokenFactors

logger = logging.getLogger(__name__)

#: The file a rank's schedule is saved to, in a trainer's checkpoint folder.
STATE_FILE = "selection-state-rank-{rank}.safetensors"
_FORMAT = 1


class ScheduleStateError(ValueError):
    """A saved schedule cannot be restored (missing, another step, other layers)."""


@dataclass
class ScheduleState:
    """What a selection session needs to go on as if never stopped.

    Attributes:
        step: the optimizer step the run continues at (the checkpoint's step).
        target_step: the step the current target was computed at (``None``: no target yet).
        step_examples: examples of the last selected step's global batch (``None``: none
            selected yet), from which ``refresh_every=None`` derives the interval.
        pool_next: the target pool's cursor (the first example of the next refresh).
        summed_share: the surgery's summed share of the last step (routes the next one).
        rule: the rule's own state (``rule="random"``: the decisions drawn so far).
        target: the current target (``None``: no target yet), vectors ``(D,)`` per layer
            and, where kept, per-token factors.
    """

    step: int
    target_step: int | None
    step_examples: int | None
    pool_next: int
    summed_share: float
    rule: dict[str, int] = field(default_factory=dict)
    target: Target | None = None

    def tensors(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The state as named tensors (copies) and JSON metadata. Factors viewing one input
        (q/k/v) save it once and share one tensor again when loaded."""
        tensors: dict[str, Tensor] = {}
        meta: dict[str, Any] = {
            "format": _FORMAT,
            "step": self.step,
            "target_step": self.target_step,
            "step_examples": self.step_examples,
            "pool_next": self.pool_next,
            "summed_share": self.summed_share,
            "rule": self.rule,
            "vectors": [],
            "factors": {},
        }
        if self.target is not None:
            for name, vector in self.target.vectors.items():
                tensors[f"vector/{name}"] = _own(vector)
                meta["vectors"].append(name)
            inputs: dict[TensorKey, str] = {}
            for name, f in self.target.factors.items():
                key = inputs.setdefault(tensor_key(f.a), f"input/{len(inputs)}")
                tensors.setdefault(key, _own(f.a))
                tensors[f"output/{name}"] = _own(f.g)
                meta["factors"][name] = {"input": key, "bias": f.bias}
        return tensors, meta

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, Tensor], meta: dict[str, Any], device: Any = None
    ) -> ScheduleState:
        """The state :meth:`tensors` gave, its tensors moved to ``device``."""
        if meta.get("format") != _FORMAT:
            raise ScheduleStateError(f"unknown selection state format {meta.get('format')!r}")
        moved = {k: v.to(device) for k, v in tensors.items()}
        target = None
        if meta["target_step"] is not None:
            vectors = {name: moved[f"vector/{name}"] for name in meta["vectors"]}
            factors = {
                name: TokenFactors(moved[f["input"]], moved[f"output/{name}"], f["bias"])
                for name, f in meta["factors"].items()
            }
            target = Target(vectors, factors)
        return cls(
            step=meta["step"],
            target_step=meta["target_step"],
            step_examples=meta["step_examples"],
            pool_next=meta["pool_next"],
            summed_share=meta["summed_share"],
            rule=dict(meta["rule"]),
            target=target,
        )


def _own(t: Tensor) -> Tensor:
    """A contiguous CPU copy of ``t`` (safetensors refuses tensors that share memory)."""
    return t.detach().cpu().clone(memory_format=torch.contiguous_format)


def state_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / STATE_FILE.format(rank=rank)


def write_state(state: ScheduleState, folder: str | Path, rank: int) -> Path:
    """Save ``state`` as ``folder``/:data:`STATE_FILE` (atomically: temporary + rename)."""
    path = state_path(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, meta = state.tensors()
    temporary = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    save_file(tensors, str(temporary), metadata={"selection": json.dumps(meta)})
    os.replace(temporary, path)
    return path


def read_state(folder: str | Path, rank: int, device: Any = None) -> ScheduleState:
    """The state :func:`write_state` saved in ``folder``.

    Raises:
        ScheduleStateError: no such file (naming it), or one of another format.
    """
    path = state_path(folder, rank)
    if not path.is_file():
        raise ScheduleStateError(f"{path} does not exist")
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("selection", "{}"))
    return ScheduleState.from_tensors(load_file(str(path)), meta, device)


def warn_not_restored(cause: str, step: int) -> None:
    """The resumed run selects on a fresh schedule: say why, and what differs."""
    logger.warning(
        "tda-plugins: the data selection schedule saved with the checkpoint of step %d could "
        "not be restored (%s); the selection starts a fresh schedule (the target recomputed "
        "now, the refresh interval and target pool counted from this step), so it will differ "
        "from an uninterrupted run's",
        step,
        cause,
    )
