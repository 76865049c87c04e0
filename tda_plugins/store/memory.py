"""A store held in this process's memory, for small jobs: no shard is ever written.

Inside ``with memory_store() as root:``, a :class:`~tda_plugins.store.GradientStore`
written under ``root`` keeps a copy of each micro-batch's tensors in a
:class:`MemoryShards`, made on its background thread where a file would be written (no
file, no page cache, no fsync, no checksum of the bytes), and a
:class:`~tda_plugins.store.StoreReader` opened under ``root`` in the same process reads
them back through the same interface, chunk for chunk: every method scores exactly as
on the same store on disk. The store's small files (header, indexes, end markers, K-FAC
statistics) go to ``root``, a fresh temporary folder; the block's end frees the
gradients and removes the folder.

Why a registry: a store is addressed by its folder everywhere (``capture_examples(model,
rows, root / "train")``, ``tda_plugins.attribute(root / "train", root / "queries")``), so
the writer and the reader find a memory store's shards by the folder they are given.
:data:`_OPEN` maps each open memory store's folder to its shards for exactly as long as
its ``with`` block runs; every other folder is a store on disk (:data:`FILES`).

Limits: one process (a store another process or rank opens holds no gradients there,
and says so); the gradients take RAM for as long as the block runs.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from torch import Tensor

from tda_plugins.store.layout import StoreError
from tda_plugins.store.medium import FILES, OpenShard, ShardMedium

#: The store header's metadata key that marks a store held in memory.
IN_MEMORY = "in_memory"


@dataclass(frozen=True)
class _Held:
    """One shard held in memory: its tensors, metadata, and each tensor's version
    counter when saved (any in-place write to it since shows as a higher version)."""

    tensors: dict[str, Tensor]
    metadata: dict[str, str]
    versions: dict[str, int]


class MemoryShard:
    """A shard held in memory, opened: :class:`~tda_plugins.store.medium.OpenShard` over
    its tensors (``mapped`` gives the stored tensor itself)."""

    def __init__(self, path: Path, held: _Held):
        self.path = path
        self.metadata = held.metadata
        self._tensors = held.tensors

    def __enter__(self) -> MemoryShard:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensor(key).shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensor(key).dtype

    def read(self, key: str) -> Tensor:
        return self._tensor(key).clone()

    def mapped(self, key: str) -> Tensor:
        return self._tensor(key)

    def read_into(self, key: str, out: Tensor) -> None:
        tensor = self._tensor(key)
        if out.shape != tensor.shape:
            raise StoreError(f"{self.path.name}: {key} has shape {tensor.shape}, not {out.shape}")
        out.copy_(tensor)

    def _tensor(self, key: str) -> Tensor:
        if key not in self._tensors:
            raise StoreError(f"{self.path.name} holds no tensor {key!r}")
        return self._tensors[key]


class MemoryShards:
    """The shards of one memory store (a :class:`~tda_plugins.store.medium.ShardMedium`),
    by path, in this process; safe to use from the writer's background thread."""

    on_disk = False

    def __init__(self, folder: Path):
        self.folder = folder
        self._held: dict[Path, _Held] = {}
        self._lock = threading.Lock()

    def holds(self, path: Path) -> bool:
        """Whether ``path`` lies inside this store's folder."""
        return path.resolve().is_relative_to(self.folder)

    def save(self, path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
        """Keep a copy of ``tensors`` (made on the writer's thread, as a file's write would
        be: the captured tensors are then freed, and the capture's next allocations reuse
        their memory instead of asking the system for new pages)."""
        kept = {key: t.clone() for key, t in tensors.items()}
        versions = {key: t._version for key, t in kept.items()}
        with self._lock:
            self._held[path.resolve()] = _Held(kept, dict(metadata), versions)

    def checksum(self, path: Path) -> str:
        """XXH3-64 of the shard's description (each tensor's key, shape, dtype and
        version): the tensors are this process's own, so no byte can change unseen but by
        an in-place write, which the version counter shows."""
        held = self._get(path, damaged="")
        description = {
            key: [list(t.shape), str(t.dtype), t._version] for key, t in held.tensors.items()
        }
        return xxhash.xxh3_64_hexdigest(json.dumps(description, sort_keys=True).encode())

    def verify(self, path: Path, expected: str, *, damaged: str) -> None:
        if self.checksum(path) != expected:
            raise StoreError(f"{path} is not the shard its index lists; {damaged}")

    def open(self, path: Path) -> OpenShard:
        held = self._get(path, damaged="the store is damaged: recapture")
        changed = [k for k, t in held.tensors.items() if t._version != held.versions[k]]
        if changed:
            raise StoreError(
                f"{path.name}'s tensor {changed[0]!r} was written to in place after it was "
                "stored (a consumer of the capture, or of a chunk read from the store, "
                "modified it): its scores would be wrong. Recapture, and clone a tensor "
                "before changing it"
            )
        return MemoryShard(path, held)

    def remove(self, path: Path) -> None:
        with self._lock:
            self._held.pop(path.resolve(), None)

    def shard_paths(self, folder: Path) -> list[Path]:
        folder = folder.resolve()
        with self._lock:
            return [p for p in self._held if p.parent == folder]

    def clear(self) -> None:
        """Free every shard's tensors."""
        with self._lock:
            self._held.clear()

    def _get(self, path: Path, *, damaged: str) -> _Held:
        with self._lock:
            held = self._held.get(path.resolve())
        if held is None:
            raise StoreError(f"the memory store holds no shard {path}; {damaged}")
        return held


#: Folder -> shards of each memory store whose ``with`` block is running (see above).
_OPEN: dict[Path, MemoryShards] = {}
_OPEN_LOCK = threading.Lock()


def medium_for(root: Path) -> ShardMedium:
    """The shards of the store at ``root``: those of the open memory store whose folder
    holds it, else files on disk."""
    with _OPEN_LOCK:
        memories = list(_OPEN.values())
    return next((m for m in memories if m.holds(root)), FILES)


def not_in_this_process(root: Path) -> StoreError:
    """The error for a memory store's folder read where its gradients are not."""
    return StoreError(
        f"{root} was captured into a memory store (tda_plugins.store.memory_store): its "
        "gradients live in the memory of the process that captured it, inside its `with` "
        "block, and are gone once that ends. Score it there, or capture into a folder on "
        "disk to score it elsewhere"
    )


@contextmanager
def memory_store(*, under: Path | None = None) -> Iterator[Path]:
    """A new empty folder (in ``under``, default the system's temporary folder) whose
    stores keep their gradients in this process's memory; at exit they are freed and the
    folder removed.

    Raises:
        OSError: ``under`` is not a folder.
    """
    if under is not None and not under.is_dir():
        raise OSError(f"no memory store here: {under} is not a folder; pass an existing one")
    folder = Path(tempfile.mkdtemp(prefix="tda-store-", dir=under)).resolve()
    shards = MemoryShards(folder)
    with _OPEN_LOCK:
        _OPEN[folder] = shards
    try:
        yield folder
    finally:
        with _OPEN_LOCK:
            del _OPEN[folder]
        shards.clear()
        shutil.rmtree(folder, ignore_errors=True)
