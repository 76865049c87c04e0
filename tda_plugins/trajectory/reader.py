"""``TrajectoryReader``: the recorded optimizer steps of a training store, checked on read.

    trajectory = TrajectoryReader("run/grads")
    for step in trajectory.steps:
        record = trajectory.record(step)          # ids, loss scales, clip, groups, layers
        v = trajectory.second_moment(step, layer)  # (D,) Adam's exp_avg_sq after the step
        terms = trajectory.adam_terms(step, layer)  # per-entry lr, betas, eps, decay

Everything read from disk is validated: the index entries (no path outside the folder),
each step file's checksum (once per reader), its record's fields, and each second moment's
shape against the layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from tda_plugins.store.layout import StoreError
from tda_plugins.store.reader import StoreReader
from tda_plugins.trajectory.adam import AdamTerms
from tda_plugins.trajectory.layout import (
    FORMAT,
    LAYOUT_FILE,
    SECOND_MOMENT,
    StepEntry,
    read_step_index,
    trajectory_dir,
)
from tda_plugins.trajectory.record import StepRecord

NO_TRAJECTORY = (
    "capture the training run with record_trajectory=True (GradientCaptureCallback("
    "..., record_trajectory=True), or CaptureSettings(record_trajectory=True) for OLMo-core)"
)


class TrajectoryReader:
    """The trajectory recorded beside the store at ``store_root`` (one process's run).

    Raises a :class:`StoreError` naming the fix when the store has none.
    """

    def __init__(self, store_root: str | Path):
        self.root = Path(store_root)
        folders = sorted(p.parent for p in self.root.glob("rank-*/trajectory/index.json"))
        if not folders:
            raise StoreError(f"the store {self.root} has no recorded trajectory; {NO_TRAJECTORY}")
        if folders != [trajectory_dir(self.root, 0)]:
            raise StoreError(
                f"the store {self.root} holds trajectories of several ranks "
                f"({[str(f.parent.name) for f in folders]}); a trajectory is recorded by one "
                "process only"
            )
        self.folder = folders[0]
        self._entries = {e.step: e for e in read_step_index(self.folder)}
        self._params, self._entry_params = self._read_layout()
        self._verified: set[int] = set()

    def _read_layout(self) -> tuple[dict[str, tuple[str, ...]], dict[str, Tensor]]:
        path = self.folder / LAYOUT_FILE
        if not path.exists():
            raise StoreError(f"{self.folder} has no {LAYOUT_FILE}; the trajectory is damaged")
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise StoreError(f"{path} is not of format {FORMAT}")
            try:
                params = {k: tuple(v) for k, v in json.loads(meta["params"]).items()}
            except (KeyError, ValueError, AttributeError, TypeError) as error:
                raise StoreError(f"{path} has damaged parameter names ({error!r})") from error
            if set(f.keys()) != {f"{layer}::param" for layer in params}:
                raise StoreError(f"{path} does not hold one entry map per layer")
            maps = {layer: f.get_tensor(f"{layer}::param") for layer in params}
        for layer, index in maps.items():
            if index.dtype != torch.uint8 or index.dim() != 1:
                raise StoreError(f"{path}: the entry map of {layer} must be (D,) uint8")
            if index.numel() and int(index.max()) >= len(params[layer]):
                raise StoreError(f"{path}: the entry map of {layer} names a missing parameter")
        return params, maps

    @property
    def steps(self) -> list[int]:
        """The recorded optimizer steps, ascending."""
        return sorted(self._entries)

    @property
    def layers(self) -> list[str]:
        """The captured layers, in model order."""
        return list(self._params)

    def parameter_names(self, layer: str) -> tuple[str, ...]:
        """The local names of ``layer``'s captured parameters, in layout order."""
        return self._params[self._known(layer)]

    def entry_parameters(self, layer: str) -> Tensor:
        """``(D,)`` uint8: the index (into :meth:`parameter_names`) of the parameter each
        entry of ``layer``'s flattened gradient belongs to."""
        return self._entry_params[self._known(layer)]

    def record(self, step: int) -> StepRecord:
        """Step ``step``'s record (example ids, loss scales, clip, groups, layer updates)."""
        path = self._path(step)
        with safe_open(path, framework="pt") as f:
            record = StepRecord.parse(
                f.metadata(), f.get_tensor("example_ids"), f.get_tensor("loss_scale"), str(path)
            )
        if record.step != step or sorted(record.layers) != sorted(self._params):
            raise StoreError(f"{path} records another step or other layers than its index")
        for layer, update in record.layers.items():
            if len(update.groups) != len(self._params[layer]):
                raise StoreError(f"{path}: layer {layer} lists a group per parameter")
        return record

    def second_moment(self, step: int, layer: str) -> Tensor:
        """``(D,)`` Adam's ``exp_avg_sq`` of ``layer`` after step ``step``, in the store's
        flattened layout (fp32, or fp64 where the optimizer kept fp64)."""
        path = self._path(step)
        with safe_open(path, framework="pt") as f:
            value = f.get_tensor(f"{self._known(layer)}::{SECOND_MOMENT}")
        expected = self._entry_params[layer].shape
        if value.shape != expected or not value.is_floating_point():
            raise StoreError(
                f"{path}: the second moment of {layer} is not a {tuple(expected)} float"
            )
        if not bool(value.isfinite().all()) or bool((value < 0).any()):
            raise StoreError(f"{path}: the second moment of {layer} is negative or not finite")
        return value

    def adam_terms(self, step: int, layer: str) -> AdamTerms:
        """``layer``'s per-entry Adam terms at ``step`` (its update scale, decay, betas)."""
        record = self.record(step)
        return AdamTerms.of(
            record, layer, self.second_moment(step, layer), self.entry_parameters(layer)
        )

    def require_covers(self, store: StoreReader) -> None:
        """Refuse unless the trajectory records exactly the store's steps, each with the
        examples the store holds for it, and the store's layers, unprojected."""
        if store.config.projection is not None:
            raise StoreError(
                f"the store {store.root} holds projected gradients, and a trajectory method "
                "divides each entry by Adam's per-parameter denominator: capture without "
                "projection"
            )
        if list(self._params) != store.layer_names:
            raise StoreError(f"the trajectory of {self.root} records other layers than its store")
        held = store.step_example_ids()
        if self.steps != sorted(held):
            missing = sorted(set(held) - set(self.steps))
            raise StoreError(
                f"the store {store.root} holds steps {missing[:5]} that its trajectory does not "
                "record (a run that stopped between a step's gradients and its update, or a "
                f"resumed run that did not record them); {NO_TRAJECTORY}, or score with a "
                "method that needs no trajectory"
                if missing
                else f"the trajectory of {store.root} records steps the store does not hold"
            )
        for step, ids in held.items():
            if sorted(self.record(step).example_ids.tolist()) != sorted(ids):
                raise StoreError(
                    f"step {step} of the trajectory of {store.root} trained on other examples "
                    "than the store holds for it; the store and its trajectory are of "
                    "different runs"
                )

    def _known(self, layer: str) -> str:
        if layer not in self._params:
            raise StoreError(f"the trajectory of {self.root} has no layer {layer!r}")
        return layer

    def _path(self, step: int) -> Path:
        entry: StepEntry | None = self._entries.get(step)
        if entry is None:
            raise StoreError(f"the trajectory of {self.root} has no step {step}")
        if step in self._verified:
            return self.folder / entry.file
        path = entry.verify(self.folder)
        self._verified.add(step)
        return path
