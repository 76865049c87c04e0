"""A store held in memory, for small jobs: the same files in a RAM-backed folder.

:func:`memory_store` gives a fresh folder on the machine's shared-memory filesystem
(``/dev/shm``, tmpfs on Linux), removed when the block ends. A
:class:`~tda_plugins.store.GradientStore` written there (best with ``durability="none"``:
there is no disk to sync) and the :class:`~tda_plugins.store.StoreReader` and K-FAC
statistics read from it are the on-disk ones, byte for byte, so every consumer of the
reader works unchanged; nothing outlives the block, and a crash leaves nothing to resume.
The gradients take RAM (the filesystem's size is the limit): for jobs whose store fits.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Where a memory store's folder is made: the RAM-backed filesystem of Linux.
SHARED_MEMORY = Path("/dev/shm")


@contextmanager
def memory_store(*, under: Path = SHARED_MEMORY) -> Iterator[Path]:
    """A new empty store folder in RAM (``under``, default ``/dev/shm``), removed at exit.

    Raises:
        OSError: ``under`` is not a writable folder (no shared-memory filesystem on this
            system); capture into a folder on disk instead.
    """
    if not under.is_dir():
        raise OSError(
            f"no memory store here: {under} is not a folder (a Linux tmpfs); capture into "
            "a folder on disk instead"
        )
    folder = Path(tempfile.mkdtemp(prefix="tda-store-", dir=under))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
