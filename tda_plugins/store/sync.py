"""Background disk work: the shard writes and fsyncs of a durable store, off the training
thread.

Copying a shard into the page cache and waiting for the disk need no Python (the GIL is
released), so on one background thread they overlap the next micro-batch's forward and
backward instead of stalling them. Jobs run one at a time in submission order, so a job
that publishes files (an index write) runs only once every earlier job (their writes and
fsyncs) has succeeded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tda_plugins.store.io import DISK_FIX, fsync_path
from tda_plugins.store.layout import StoreError

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Durability:
    """When a store's files are fsynced: each shard before its step is listed
    (``per_step``), or all of them once at the end of capture (``at_end``)."""

    per_step: bool
    at_end: bool

    @property
    def deferred(self) -> bool:
        """Files are fsynced after the capture, on threads of their own (``"end"``)."""
        return self.at_end and not self.per_step


#: The durability modes of a store and of its K-FAC statistics (see
#: :mod:`~tda_plugins.store.writer`).
DURABILITY = {
    "step": Durability(per_step=True, at_end=True),
    "end": Durability(per_step=False, at_end=True),
    "none": Durability(per_step=False, at_end=False),
}


def durability_mode(name: str) -> Durability:
    """The :data:`DURABILITY` mode ``name``; an unknown one is a ``ValueError``."""
    if name not in DURABILITY:
        raise ValueError(f"durability must be one of {sorted(DURABILITY)}, got {name!r}")
    return DURABILITY[name]


class BackgroundSync:
    """Runs durability jobs in order on one lazily started thread.

    After a job fails, no later job runs (it could publish what the failed one did not
    make durable), and every later :meth:`submit` and :meth:`wait` raises a
    :class:`StoreError` naming the failure; :meth:`close` raises it only if nothing did.
    """

    def __init__(self, what: str):
        self.what = what
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[Future[None]] = []
        #: The first failed job's error (set on the background thread).
        self._error: Exception | None = None
        self._reported = False

    def submit(self, job: Callable[[], None]) -> Future[None]:
        """Queue ``job`` after every job submitted before it; its future (see
        :meth:`wait_for`)."""
        self._raise_error()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tda-store-sync")
        self._jobs = [j for j in self._jobs if not j.done()]
        future = self._pool.submit(self._run, job)
        self._jobs.append(future)
        return future

    def wait_for(self, job: Future[None] | None) -> None:
        """Return once ``job`` (a :meth:`submit` future, or ``None``: nothing to wait for)
        and every job before it are done; raise if one failed."""
        if job is not None:
            job.result()  # _run keeps the error instead of raising it
        self._raise_error()

    def wait(self) -> None:
        """Return once every submitted job is done; raise if one failed."""
        self.wait_for(self._jobs[-1] if self._jobs else None)  # jobs run in order
        self._jobs = []

    def close(self) -> None:
        """:meth:`wait`, then stop the thread (a later :meth:`submit` starts another)."""
        reported = self._reported
        try:
            self.wait()
        except StoreError:
            if not reported:
                raise
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    def _run(self, job: Callable[[], None]) -> None:
        if self._error is not None:
            return
        try:
            job()
        except Exception as error:  # kept for the training thread, which raises it
            self._error = error

    def _raise_error(self) -> None:
        if self._error is None:
            return
        self._reported = True
        # an error of store.io's writes names its file and the fix already
        fix = "" if getattr(self._error, "named_path", None) else f": {DISK_FIX}"
        raise StoreError(
            f"writing {self.what} to disk failed in the background ({self._error}); steps "
            f"committed before it are on disk, later ones are not{fix}"
        ) from self._error


class EndSync:
    """One job (a store's end sync) on its own thread, started at once and left running
    when the capture returns. The thread is not a daemon: the interpreter waits for it
    at exit, so a process that ends normally ends with the job done. :meth:`wait` joins
    it and raises its failure; a failure nobody waits for is logged as an error."""

    def __init__(self, what: str, job: Callable[[], None]):
        self.what = what
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, args=(job,), name="tda-store-end-sync")
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception as error:  # kept for wait(), which raises it
            self._error = error
            logger.error("making %s durable failed: %s", self.what, error)

    def wait(self) -> None:
        """Return once the job is done; raise if it failed."""
        self._thread.join()
        if self._error is not None:
            raise StoreError(
                f"making {self.what} durable failed in the background ({self._error}): every "
                "step is written, but a machine crash could tear one; check the disk and "
                "recapture if it cannot be trusted"
            ) from self._error


def run_together(job: Callable[[T], object], items: Sequence[T], threads: int) -> None:
    """``job`` of every item, on up to ``threads`` plain threads at once (fsyncs that the
    disk queues together); raises the first failure once all have stopped. Plain threads,
    not an executor: this also runs while the interpreter shuts down (an :class:`EndSync`
    it waits for), when ``concurrent.futures`` takes no new work."""
    pending = list(reversed(items))
    errors: list[Exception] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending or errors:
                    return
                item = pending.pop()
            try:
                job(item)
            except Exception as error:
                with lock:
                    errors.append(error)

    workers = [threading.Thread(target=worker) for _ in range(min(threads, len(items)))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def sync_later(what: str, *paths: Path) -> EndSync:
    """An :class:`EndSync` that fsyncs ``paths`` in order (a file, then the folder that
    names it): a file written to the page cache made durable off the caller's path."""

    def sync() -> None:
        for path in paths:
            fsync_path(path)

    return EndSync(what, sync)
