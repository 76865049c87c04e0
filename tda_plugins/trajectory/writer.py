"""Writing a trajectory crash-safely, with the gradient store's protocol.

Each step's file is written to a temporary name, renamed, fsynced and checksummed; only
then is it listed, by an atomic rewrite of the index after an fsync of the folder
(:mod:`tda_plugins.store.io`). Both run on one background thread
(:class:`~tda_plugins.store.sync.BackgroundSync`), beside the next step's forward and
backward; a new step first waits for the previous one, so at most one step's tensors are
held beside the one being recorded. A crash at any moment leaves every listed step
readable and no partial one visible; reopening removes files no index lists.

The folder lives in a rank directory of the store, whose writer lock
(:mod:`tda_plugins.store.lock`) the capture holds: one writer at a time.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save, save_file
from torch import Tensor

from tda_plugins.store.index import file_checksum
from tda_plugins.store.io import atomic_write_bytes, fsync_path, write_renamed
from tda_plugins.store.layout import StoreError
from tda_plugins.store.sync import BackgroundSync
from tda_plugins.trajectory.layout import (
    FORMAT,
    LAYOUT_FILE,
    STEP_PATTERN,
    StepEntry,
    read_step_index,
    step_file,
    trajectory_dir,
    write_step_index,
)

#: A layer's flattened layout: its captured parameters' local names, and ``(D,)`` uint8
#: giving which of them each entry belongs to.
LayerLayout = tuple[tuple[str, ...], Tensor]


class TrajectoryWriter:
    """The trajectory folder of one rank of a store: its listed steps, truncation, and
    crash-safe writes of new steps.

    Opening it removes what a crashed writer left (unlisted step files, temporary files).
    """

    def __init__(self, store_root: str | Path, rank: int):
        self.folder = trajectory_dir(Path(store_root), rank)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._entries = read_step_index(self.folder)
        self._sync = BackgroundSync(f"the trajectory in {self.folder}")
        self._last: Future[None] | None = None
        #: The last step listed or submitted.
        self._last_step = self._entries[-1].step if self._entries else -1
        self._remove_unlisted()

    @property
    def steps(self) -> list[int]:
        """The listed steps, ascending (the last write may still be running: :meth:`flush`)."""
        return [e.step for e in self._entries]

    def truncate(self, from_step: int) -> None:
        """Drop every step ``>= from_step``: the index first, then the files."""
        self.flush()
        kept = [e for e in self._entries if e.step < from_step]
        dropped = [e for e in self._entries if e.step >= from_step]
        if not dropped:
            return
        write_step_index(self.folder, kept)
        self._entries = kept
        self._last_step = kept[-1].step if kept else -1
        for entry in dropped:
            (self.folder / entry.file).unlink(missing_ok=True)

    def write_layout(self, layout: dict[str, LayerLayout]) -> None:
        """Write the layers' layout once; a folder that has one must hold the same."""
        path = self.folder / LAYOUT_FILE
        names = {layer: list(params) for layer, (params, _) in layout.items()}
        tensors = {f"{layer}::param": index for layer, (_, index) in layout.items()}
        if path.exists():
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                same = (
                    meta.get("format") == FORMAT
                    and json.loads(meta.get("params", "null")) == names
                    and set(f.keys()) == set(tensors)
                    and all(torch.equal(f.get_tensor(k), t) for k, t in tensors.items())
                )
            if not same:
                raise StoreError(
                    f"{path} describes other layers than this capture's; the trajectory "
                    "belongs to another run: write to a new store_dir"
                )
            return
        metadata = {"format": FORMAT, "params": json.dumps(names)}
        atomic_write_bytes(path, save(tensors, metadata=metadata))

    def write_step(self, step: int, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
        """Write step ``step`` (CPU tensors, no longer changed by the caller) and list it,
        in the background; waits first for the previous step's write."""
        if step <= self._last_step:
            raise StoreError(f"step {step} is already in the trajectory (last: {self._last_step})")
        self._sync.wait_for(self._last)
        self._last_step = step
        name = step_file(step)
        path = self.folder / name
        entries = self._entries

        def write() -> None:
            write_renamed(path, lambda tmp: save_file(tensors, tmp, metadata))
            fsync_path(path)
            entries.append(StepEntry(step, name, file_checksum(path)))
            fsync_path(self.folder)
            write_step_index(self.folder, list(entries))

        self._last = self._sync.submit(write)

    def flush(self) -> None:
        """Wait until every step written so far is on disk and listed."""
        self._sync.wait()
        self._last = None

    def close(self) -> None:
        """:meth:`flush` and stop the background thread."""
        self._sync.close()
        self._last = None

    def _remove_unlisted(self) -> None:
        listed = {e.file for e in self._entries}
        for path in self.folder.iterdir():
            unlisted = STEP_PATTERN.fullmatch(path.name) and path.name not in listed
            half_written = path.name.startswith(".") and ".tmp-" in path.name
            if unlisted or half_written:
                path.unlink()
