"""The zygote (``tests/zygote.py``) starts workers as fresh processes would be started:
from the image the test process had after collection, not from what a test has changed
since; with their own environment and standard streams; with ``subprocess``'s exit codes.
And ``tests.launch.forked_ranks`` fails a launch whose rank fails, without waiting for the
ranks left in a collective."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.launch import forked_ranks
from tests.zygote import Zygote

#: Changed by a test below; a worker must see the value the module had at collection.
STATE = "as imported"


def show_state() -> None:
    print(STATE, os.environ.get("TDA_ZYGOTE_PROBE", "unset"))


def show_variable(name: str) -> None:
    print(os.environ[name])


def exit_with(code: int) -> None:
    sys.exit(code)


def fail() -> None:
    raise ValueError("a worker's own error")


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def leave_a_thread_and_an_exit_handler() -> None:
    def late() -> None:
        time.sleep(0.3)
        print("thread done", flush=True)

    threading.Thread(target=late).start()
    atexit.register(print, "exit handler")


def echo_then_wait() -> None:
    print(sys.stdin.readline().strip().upper(), flush=True)
    time.sleep(600)


def test_a_worker_starts_from_the_image_taken_before_any_test(
    zygote: Zygote, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "STATE", "changed by a test")
    monkeypatch.setenv("TDA_ZYGOTE_PROBE", "set by a test")
    assert zygote.run("tests.test_zygote:show_state", timeout=60) == (0, "as imported unset\n")


def test_a_worker_has_the_environment_it_is_given(zygote: Zygote) -> None:
    given = {"TDA_ZYGOTE_PROBE": "given"}
    shown = zygote.run("tests.test_zygote:show_variable", "TDA_ZYGOTE_PROBE", env=given, timeout=60)
    assert shown == (0, "given\n")
    inherited = zygote.run("tests.test_zygote:show_variable", "HF_HUB_OFFLINE", timeout=60)
    assert inherited == (0, "1\n")


def test_a_worker_ends_as_an_interpreter_does(zygote: Zygote) -> None:
    """Its non-daemon threads are joined, then its exit handlers run (the store's end sync
    relies on the first)."""
    got = zygote.run("tests.test_zygote:leave_a_thread_and_an_exit_handler", timeout=60)
    assert got == (0, "thread done\nexit handler\n")


@pytest.mark.parametrize(
    ("target", "code", "shown"),
    [
        ("exit_with:0", 0, ""),
        ("exit_with:3", 3, ""),
        ("fail", 1, "ValueError: a worker's own error"),
        ("kill_self", -signal.SIGKILL, ""),
    ],
)
def test_a_worker_exits_with_subprocess_codes(
    zygote: Zygote, target: str, code: int, shown: str
) -> None:
    name, _, arg = target.partition(":")
    args = (int(arg),) if arg else ()
    got, output = zygote.run(f"tests.test_zygote:{name}", *args, timeout=60)
    assert got == code and shown in output


def test_a_popen_worker_talks_through_pipes_and_dies_when_killed(
    zygote: Zygote, tmp_path: Path
) -> None:
    with (
        (tmp_path / "err").open("w") as err,
        zygote.popen("tests.test_zygote:echo_then_wait", stderr=err.fileno()) as worker,
    ):
        worker.stdin.write("hello\n")
        worker.stdin.flush()
        assert worker.stdout.readline() == "HELLO\n"
        assert worker.poll() is None
        worker.kill()
        assert worker.wait(timeout=30) == -signal.SIGKILL


def test_a_worker_past_its_timeout_is_killed(zygote: Zygote) -> None:
    with pytest.raises(TimeoutError, match="ran past 1 s"):
        zygote.run("tests.test_zygote:echo_then_wait", timeout=1)


def test_a_failing_rank_fails_the_launch_and_the_waiting_rank_is_killed(
    zygote: Zygote, tmp_path: Path
) -> None:
    """Rank 1 raises; rank 0, in the barrier after its job, ends at once (killed, or
    failed by gloo for its lost peer), not at the launch's timeout."""
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"exit codes \[(1|-9), 1\][\s\S]*rank 1 fails"):
        forked_ranks(zygote, tmp_path, "failing_rank_worker", timeout=120)
    assert time.monotonic() - started < 60
