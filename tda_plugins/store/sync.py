"""Background disk work: the shard writes and fsyncs of a durable store, off the training
thread.

Copying a shard into the page cache and waiting for the disk need no Python (the GIL is
released), so on one background thread they overlap the next micro-batch's forward and
backward instead of stalling them. Jobs run one at a time in submission order, so a job
that publishes files (an index write) runs only once every earlier job (their writes and
fsyncs) has succeeded.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tda_plugins.store.layout import StoreError


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
        raise StoreError(
            f"writing {self.what} to disk failed in the background ({self._error}); steps "
            "committed before it are on disk, later ones are not: check the disk (space, "
            "permissions) and resume from the last step on disk in a new run"
        ) from self._error
