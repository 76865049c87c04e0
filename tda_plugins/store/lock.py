"""One writer per rank directory: an exclusive ``flock`` held for the writer's lifetime.

A writer of the same rank directory in another process (another ``tda capture``, another
trainer) fails at once with the holder's pid and host, which the holder writes into the
lock file. The ranks of one distributed run write different rank directories, so they
never wait for each other; a second run on the same store meets the first at rank 0. The
operating system releases the lock when its holder exits, however it exits (a crash or
SIGKILL included), so a stale lock file never blocks a resumed run.

Within one process, a new writer of a directory takes the lock over from the earlier one
(a training run resumed in the same interpreter after an exception ended the first, whose
objects are still alive), and the earlier writer refuses every later write
(:meth:`WriterLock.check`), so two writers never interleave there either. POSIX only
(``fcntl``).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from weakref import WeakValueDictionary

from tda_plugins.store.layout import StoreError

LOCK_FILE = ".writer.lock"

#: The lock of each rank directory this process holds (the OS lock is per process).
_HELD: WeakValueDictionary[Path, _Descriptor] = WeakValueDictionary()


class _Descriptor:
    """An open, flocked lock file; closing it (or collecting it) releases the lock."""

    def __init__(self, fd: int):
        self.fd: int | None = fd
        #: The writer that holds it now (a later writer in this process takes it over).
        self.owner: WriterLock | None = None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()


class WriterLock:
    """The exclusive writer lock of one rank directory (taken on construction)."""

    def __init__(self, folder: Path):
        self.folder = folder
        key = folder.resolve()
        held = _HELD.get(key)
        if held is not None and held.fd is not None:
            self._descriptor = held  # taken over: the earlier writer's check() now fails
        else:
            self._descriptor = _locked(folder / LOCK_FILE)
        self._descriptor.owner = self
        _HELD[key] = self._descriptor

    def check(self) -> None:
        """Raise unless this writer still holds the lock."""
        if self._descriptor.owner is not self or self._descriptor.fd is None:
            raise StoreError(
                f"another writer in this process took over {self.folder} (or this one was "
                "closed): this one may not write there any more"
            )

    def release(self) -> None:
        """Give the lock up (idempotent; a writer that lost it releases nothing)."""
        if self._descriptor.owner is self:
            self._descriptor.close()


def _locked(path: Path) -> _Descriptor:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise StoreError(
            f"{path.parent} is being written by another process ({holder}); two writers would "
            "corrupt it: wait for that run to end, or write to another directory"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
    return _Descriptor(fd)


def _holder(fd: int) -> str:
    """``pid N on HOST`` from a held lock file (its holder wrote it on taking the lock)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}"
    except (ValueError, KeyError, OSError):
        return "a process that has not written its pid yet"
