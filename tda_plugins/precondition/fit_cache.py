"""A store's factorizations kept for the next fit: ``STORE/fit-cache/``.

K-FAC's damped inverses and EK-FAC's eigendecompositions depend on the store's K-FAC
statistics alone (and K-FAC's on its damping), not on the queries, yet they are most of a
curvature method's time on wide factors (SmolLM2-135M with LoRA on every linear layer:
62 s of EK-FAC's 72 s in 840 fp64 eigendecompositions). So each rank keeps the tensors it
fitted in ``fit-cache/<kind>-rank<r>-of<n>.safetensors`` beside the store, and the next
fit of the same kind on the same statistics reads them back instead.

The file is used only when its key matches: the kind (the method, its damping where the
fit depends on it) and the store's values dtype (the one fits keep their results in), a
format number, and, for every
file of the statistics set it was fitted from, its name, size, modification time and
inode. Every writer of statistics replaces its file by a rename (a new inode), so an
appended capture or a recapture never meets an old fit. A cache that cannot be read is
ignored (and rewritten); one that cannot be written (a read-only store) is skipped with
a log line. Deleting the folder only costs the next fit its time. A memory store
(:func:`~tda_plugins.store.memory_store`) keeps no cache: it does not outlive its process.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from safetensors import SafetensorError, safe_open

from tda_plugins.parallel.ranks import LayerTensors, Ranks
from tda_plugins.precondition.snapshots import StatisticsSet
from tda_plugins.store.io import write_renamed
from tda_plugins.store.reader import StoreReader
from tda_plugins.store.shardfile import write_streamed
from tda_plugins.utils.progress import end_of_run_bar

logger = logging.getLogger(__name__)

CACHE_FOLDER = "fit-cache"
#: Changes whenever what a fit of a given kind computes changes.
FORMAT = 1


class FitCache:
    """One rank's cached fit of one kind for one store (see the module docstring); ``kind``
    names the fit and whatever it depends on beyond the statistics and the store's dtype.

    Attributes:
        path: the cache file.
        key: what the file's ``key`` metadata must equal for it to be used.
    """

    def __init__(self, store: StoreReader, found: StatisticsSet, ranks: Ranks, kind: str):
        kind = f"{kind}-{str(store.values_dtype()).removeprefix('torch.')}"
        self.path = (
            store.root / CACHE_FOLDER / f"{kind}-rank{ranks.rank}-of{ranks.size}.safetensors"
        )
        self.kept = store.on_disk
        statistics = []
        for rank, path in sorted(found.files.items()):
            stat = path.stat()
            statistics.append([rank, path.name, stat.st_size, stat.st_mtime_ns, stat.st_ino])
        self.key = json.dumps(
            {"format": FORMAT, "kind": kind, "statistics": statistics}, sort_keys=True
        )

    def load(self) -> dict[str, LayerTensors]:
        """Layer -> its cached fitted tensors (on the CPU); empty when there is no file
        or its key does not match."""
        if not self.kept or not self.path.exists():
            return {}
        try:
            with safe_open(self.path, framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("key") != self.key:
                    return {}
                counts: dict[str, int] = json.loads(meta["layers"])
                return {
                    name: tuple(f.get_tensor(f"{name}::{i}") for i in range(count))
                    for name, count in counts.items()
                }
        except (OSError, SafetensorError, KeyError, ValueError) as exc:
            logger.warning("ignoring the unreadable fit cache %s (%s); refitting", self.path, exc)
            return {}

    def save(self, fitted: Mapping[str, LayerTensors]) -> None:
        """Keep ``fitted`` (layer -> its fitted CPU tensors) for the next fit; a store
        that cannot take the file goes without it."""
        if not self.kept:
            return
        entries = [
            (f"{name}::{i}", t.dtype, tuple(t.shape))
            for name, ts in fitted.items()
            for i, t in enumerate(ts)
        ]
        tensors = [t for ts in fitted.values() for t in ts]
        counts = {name: len(ts) for name, ts in fitted.items()}
        metadata = {"key": self.key, "layers": json.dumps(counts)}
        total = sum(t.nbytes for t in tensors)

        def write(tmp: Path) -> None:
            with end_of_run_bar(total, f"keeping the fit ({CACHE_FOLDER}/{self.path.name})") as bar:
                write_streamed(tmp, entries, tensors, metadata, bar.update)

        try:
            self.path.parent.mkdir(exist_ok=True)
            write_renamed(self.path, write)
        except OSError as exc:
            logger.info("no fit cache for %s: %s", self.path.parent.parent, exc)
