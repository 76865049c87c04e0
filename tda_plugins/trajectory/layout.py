"""On-disk layout of a recorded optimizer trajectory, shared by its writer and reader.

```
STORE/rank-<r>/trajectory/
  layout.safetensors   per captured layer, which parameter each entry of its flattened
                       gradient belongs to ("<layer>::param", uint8, (D,)); metadata:
                       "format", "params" (layer -> local parameter names, JSON)
  index.json           {"format": ..., "steps": [{"step", "file", "xxh3"}, ...]}
  t<step>.safetensors  one optimizer step: "example_ids" (N,) int64, "loss_scale" (N,)
                       float64, "<layer>::exp_avg_sq" (D,) after the step; metadata
                       "record": the step's hyperparameters (JSON, :class:`StepRecord`)
```

Only step files listed in the index are part of the trajectory; an unlisted one is a
step that never completed and is removed when the writer reopens. Index entries are
untrusted input: each names exactly the file its step gives, so no entry can name a path
outside its folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tda_plugins.store.index import file_checksum
from tda_plugins.store.io import atomic_write_json, read_json
from tda_plugins.store.layout import StoreError, rank_dir

FORMAT = "tda-trajectory/1"
FOLDER = "trajectory"
LAYOUT_FILE = "layout.safetensors"
INDEX_FILE = "index.json"
#: The only names a step file may have (:func:`step_file`).
STEP_PATTERN = re.compile(r"t\d{8}\.safetensors")
_CHECKSUM = re.compile(r"[0-9a-f]{16}")
#: The optimizer state a step file keeps per layer (Adam's second moment after the step).
SECOND_MOMENT = "exp_avg_sq"


def trajectory_dir(store_root: Path, rank: int) -> Path:
    """The trajectory folder of rank ``rank`` of the store at ``store_root``."""
    return rank_dir(store_root, rank) / FOLDER


def step_file(step: int) -> str:
    return f"t{step:08d}.safetensors"


@dataclass(frozen=True)
class StepEntry:
    """One recorded optimizer step in the index: its file and the file's XXH3-64."""

    step: int
    file: str
    xxh3: str

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "file": self.file, "xxh3": self.xxh3}

    @classmethod
    def from_json(cls, value: Any, where: str) -> StepEntry:
        """Validate one index entry; ``where`` names it in errors."""
        if not isinstance(value, dict) or sorted(value) != ["file", "step", "xxh3"]:
            raise StoreError(f"{where} is not a step entry; the trajectory index is damaged")
        step, name, digest = value["step"], value["file"], value["xxh3"]
        if type(step) is not int or step < 0:
            raise StoreError(f"{where}: step must be an integer >= 0")
        if not isinstance(name, str) or name != step_file(step):
            raise StoreError(
                f"{where} names the file {name!r}, not the file of step {step} (a path "
                "outside the trajectory, or a damaged index); nothing was read or removed"
            )
        if not isinstance(digest, str) or not _CHECKSUM.fullmatch(digest):
            raise StoreError(f"{where}: xxh3 must be a 16-digit hex checksum")
        return cls(step, name, digest)

    def verify(self, folder: Path) -> Path:
        """The step's file in ``folder``, checked against its checksum."""
        path = folder / self.file
        try:
            digest = file_checksum(path)
        except OSError as error:
            raise StoreError(f"cannot read the trajectory step {path} ({error})") from error
        if digest != self.xxh3:
            raise StoreError(
                f"{path} does not match its checksum (its bytes changed after it was written); "
                "the trajectory is damaged: retrain with record_trajectory=True"
            )
        return path


def read_step_index(folder: Path) -> list[StepEntry]:
    """The validated entries of a trajectory index, ascending by step (``[]`` if none)."""
    path = folder / INDEX_FILE
    if not path.exists():
        return []
    try:
        value = read_json(path)
    except ValueError as error:
        raise StoreError(f"{error}; the trajectory index is damaged") from error
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        raise StoreError(f"{path} is not a trajectory index of format {FORMAT}")
    raw = value.get("steps")
    if not isinstance(raw, list):
        raise StoreError(f"{path} has no 'steps' list; the trajectory index is damaged")
    entries = [StepEntry.from_json(v, f"{path} entry {i}") for i, v in enumerate(raw)]
    steps = [e.step for e in entries]
    if steps != sorted(set(steps)):
        raise StoreError(f"{path} lists steps out of order or twice; the index is damaged")
    return entries


def write_step_index(folder: Path, entries: list[StepEntry]) -> None:
    """Replace the index atomically."""
    atomic_write_json(
        folder / INDEX_FILE, {"format": FORMAT, "steps": [e.to_json() for e in entries]}
    )
