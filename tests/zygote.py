"""A template process that starts the tests' worker processes by forking.

Why: on a slow 2-core machine a fresh Python process spends 20-100 s of CPU importing
torch, transformers and OLMo-core before its first line of work, and the multi-process
tests start a dozen such processes. The test process has made those imports already, so
a worker forked from it starts at once.

Why a template rather than a fork of the test process itself: a worker must start as a
fresh process would, not with what earlier tests left behind (accelerate's shared state,
an initialized process group, loggers, random state). So each test process forks one
``Zygote`` right after collection (every module imported, no test run yet), and the
zygote forks each worker from that clean image. A worker runs ``module:function(*args)``
with the environment, standard streams and exit of a process of its own: it returns
exit code 0, 1 on an exception (its traceback on its standard error), ``SystemExit``'s
code, or minus the signal that killed it (``subprocess.Popen``'s convention).
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import IO, Any

_HEADER = struct.Struct("!I")


class Zygote:
    """The test process's handle on its template process (see the module docstring)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            ours.close()
            _serve(theirs)
        theirs.close()
        self.pid = pid
        self._socket = ours
        self._unread = b""
        self._exits: dict[int, int] = {}

    def start(
        self,
        target: str,
        *args: Any,
        env: dict[str, str] | None = None,
        stdin: int | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
    ) -> int:
        """Fork a worker that runs ``target`` (``"module:function"``) on ``args`` (pickled)
        with ``env`` added to its environment and the given file descriptors as its
        standard input, output and error (``/dev/null`` where ``None``). Returns its pid."""
        message = pickle.dumps((target, args, env or {}))
        with open(os.devnull, "r+b") as null:
            fds = [null.fileno() if fd is None else fd for fd in (stdin, stdout, stderr)]
            socket.send_fds(self._socket, [_HEADER.pack(len(message)) + message], fds)
        while True:
            reply = self._reply(None)
            assert reply is not None
            if "started" in reply:
                return int(reply["started"])
            if "failed" in reply:
                raise RuntimeError(f"the zygote could not start {target}: {reply['failed']}")

    def wait(self, pid: int, timeout: float | None = None) -> int | None:
        """The exit code of worker ``pid`` once it has exited; ``None`` if it is still
        running after ``timeout`` seconds (``None``: wait as long as it runs)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self._exits:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._reply(left) is None:
                return None
        return self._exits[pid]

    def popen(self, target: str, *args: Any, stderr: int) -> Worker:
        """Start ``target`` on ``args`` in a worker whose standard input and output are
        pipes to this process, as ``subprocess.Popen(..., stdin=PIPE, stdout=PIPE,
        text=True)`` would; its standard error goes to ``stderr``."""
        stdin_read, stdin_write = os.pipe()
        stdout_read, stdout_write = os.pipe()
        try:
            pid = self.start(target, *args, stdin=stdin_read, stdout=stdout_write, stderr=stderr)
        finally:
            os.close(stdin_read)
            os.close(stdout_write)
        return Worker(self, pid, open(stdin_write, "w"), open(stdout_read))

    def run(
        self, target: str, *args: Any, timeout: float, env: dict[str, str] | None = None
    ) -> tuple[int, str]:
        """Run ``target`` on ``args`` in a worker and wait for it, as ``subprocess.run``
        would: returns its exit code and its standard output and error, together. A worker
        still running after ``timeout`` seconds is killed and fails the call."""
        with tempfile.TemporaryFile("w+") as output:
            fd = output.fileno()
            pid = self.start(target, *args, env=env, stdout=fd, stderr=fd)
            code = self.wait(pid, timeout)
            if code is None:
                os.kill(pid, signal.SIGKILL)
                self.wait(pid)
            output.seek(0)
            shown = output.read()
        if code is None:
            raise TimeoutError(f"{target} ran past {timeout} s:\n{shown[-3000:]}")
        return code, shown

    def close(self) -> None:
        """End the template process; a worker still running is killed."""
        self._socket.close()
        os.waitpid(self.pid, 0)

    def _reply(self, timeout: float | None) -> dict[str, Any] | None:
        """The next reply (an ``exited`` one is also filed), or ``None`` after
        ``timeout`` seconds without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._unread:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._socket], [], [], left)
            if not ready:
                return None
            data = self._socket.recv(65536)
            if not data:
                raise RuntimeError(f"the zygote (pid {self.pid}) has exited")
            self._unread += data
        line, self._unread = self._unread.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        if "exited" in reply:
            self._exits[int(reply["exited"])] = int(reply["code"])
        return reply


class Worker:
    """A worker started by :meth:`Zygote.popen`, used as a ``subprocess.Popen`` is: its
    ``pid``, ``stdin`` and ``stdout``, ``poll``, ``wait`` and ``kill``; leaving its
    ``with`` block closes the pipes and kills and reaps it if it still runs."""

    def __init__(self, zygote: Zygote, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self._zygote = zygote

    def poll(self) -> int | None:
        return self._zygote.wait(self.pid, timeout=0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0)
        return code

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stdin.close()
        self.stdout.close()
        if self.poll() is None:
            self.kill()
            self.wait()


# -- the template process -------------------------------------------------------------------


def _serve(requests: socket.socket) -> None:
    """The template's loop: fork a worker per request, report each start and exit; when
    the test process closes its end, kill what still runs and exit."""
    _as_a_fresh_process()
    workers: set[int] = set()
    try:
        while True:
            ready, _, _ = select.select([requests], [], [], 0.05)
            for pid, code in _reaped(workers):
                _send(requests, {"exited": pid, "code": code})
            if not ready:
                continue
            request = _receive(requests)
            if request is None:
                break
            message, fds = request
            try:
                pid = os.fork()
            except OSError as error:
                _send(requests, {"failed": str(error)})
            else:
                if pid == 0:
                    requests.close()
                    _run(message, fds)
                workers.add(pid)
                _send(requests, {"started": pid})
            finally:
                for fd in fds:
                    os.close(fd)
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        os._exit(0)


def _as_a_fresh_process() -> None:
    """Drop what the test process had set up for itself: its streams (the test runner's
    pipes), signal handlers, log handlers and exit handlers."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    atexit._clear()


def _reaped(workers: set[int]) -> list[tuple[int, int]]:
    done = []
    for pid in list(workers):
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            workers.discard(pid)
            done.append((pid, os.waitstatus_to_exitcode(status)))
    return done


def _send(channel: socket.socket, reply: dict[str, Any]) -> None:
    channel.sendall(json.dumps(reply).encode() + b"\n")


def _receive(channel: socket.socket) -> tuple[bytes, list[int]] | None:
    """One request: its pickled message and the three descriptors sent with it; ``None``
    when the test process has closed its end."""
    data, fds, _, _ = socket.recv_fds(channel, 65536, 3)
    if not data:
        return None
    (size,) = _HEADER.unpack_from(data)
    while len(data) < _HEADER.size + size:
        more = channel.recv(65536)
        if not more:
            return None
        data += more
    return data[_HEADER.size : _HEADER.size + size], fds


def _run(message: bytes, fds: list[int]) -> None:
    """In the worker: take the three descriptors as standard streams, run the target, and
    exit as the interpreter would (non-daemon threads joined, exit handlers run)."""
    for number, fd in enumerate(fds):
        os.dup2(fd, number)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stream
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    code = 1
    try:
        target, args, env = pickle.loads(message)
        os.environ.update(env)
        module, _, name = target.partition(":")
        getattr(importlib.import_module(module), name)(*args)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else int(done.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
