"""The store's durability modes: ``"step"`` fsyncs before each step is listed, ``"end"``
once the capture has ended (on a thread of its own, off the capture's path), ``"none"``
never; what each leaves after a crash."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import tda_plugins
from tda_plugins import CaptureEngine, LayerSelection
from tda_plugins.precondition import statistics
from tda_plugins.store import GradientStore, StoreError, StoreReader, io, medium, sync, writer
from tda_plugins.store.layout import (
    CURVATURE_FILE,
    END_FILE,
    EXAMPLES_FILE,
    INDEX_FILE,
    STORE_FILE,
    rank_dir,
)
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import summed_loss

STEPS = [[lm_batch(2, 8, seed=10 * s + m) for m in range(2)] for s in range(2)]


def fsync_log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Record the name of every path the store and the K-FAC statistics fsync, and
    whether the calling thread ran it (the real fsync still runs)."""
    names: list[tuple[str, bool]] = []
    real = writer.fsync_path
    caller = threading.current_thread()

    def fsync(path: Path) -> None:
        names.append((path.name, threading.current_thread() is caller))
        real(path)

    for module in (writer, io, sync):  # io: the atomic writes'; sync: the later ones
        monkeypatch.setattr(module, "fsync_path", fsync)
    return names


def capture(path: Path, durability: str, *, end: bool = True) -> GradientStore:
    """Capture :data:`STEPS` (one step each); without ``end`` the capture is left as a
    crashed process leaves it (committed, flushed, never ended)."""
    model = tiny_causal_lm("llama", seed=0)
    store = GradientStore(path, model=model, durability=durability, in_flight_bytes=2**30)
    with CaptureEngine(model, layers=LayerSelection(), consumers=[store]) as engine:
        for step in STEPS:
            for batch in step:
                summed_loss(model, batch).backward()
            engine.optimizer_step()
        store.flush()
        if end:
            engine.end()
    return store


def grads(path: Path) -> dict[str, torch.Tensor]:
    """Layer -> ``(N, d_out, d_in)`` stored gradients of every example, in store order."""
    chunk = StoreReader(path).load_all()
    return {name: g.materialize() for name, g in chunk.layers.items()}


@pytest.mark.parametrize("durability", ["end", "none"])
def test_no_fsync_on_the_callers_path_and_the_same_store_as_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str
) -> None:
    """``"end"`` and ``"none"`` fsync nothing while capturing, not even the header. After
    the end, ``"end"`` fsyncs every shard, the index, the end marker and the header, then
    the folders that name them, and the example texts saved then, all on other threads
    than the caller's; ``"none"`` fsyncs nothing. Either store reads back exactly the
    ``"step"`` store."""
    capture(tmp_path / "step", "step")
    names = fsync_log(monkeypatch)
    root = tmp_path / durability
    store = capture(root, durability, end=False)
    assert names == []
    store.on_end()
    store.write_examples({0: "an example"})
    store.flush()
    assert not any(on_caller for _, on_caller in names)
    synced = [name for name, _ in names]
    shards = {p.name for p in rank_dir(root, 0).glob("*.safetensors")}
    if durability == "end":
        files = shards | {INDEX_FILE, END_FILE, STORE_FILE, EXAMPLES_FILE}
        assert len(shards) == 4 and set(synced) == files | {"rank-0", durability}
        assert synced.index("rank-0") > max(synced.index(f) for f in shards)
        last_root = len(synced) - 1 - synced[::-1].index(durability)  # texts' may be first
        assert last_root > synced.index(STORE_FILE)
    else:
        assert synced == []
    expected, got = grads(tmp_path / "step"), grads(root)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_one_pass_capture_fsyncs_nothing_on_the_callers_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``capture_examples`` (``"end"``) with K-FAC statistics and texts returns without an
    fsync of its own (on ext4 one would wait for everything the end sync writes back):
    the shards, the header, the statistics and the texts are made durable on other
    threads, which the process waits for at exit."""
    names = fsync_log(monkeypatch)
    rows = [{"text": "a b c d", "input_ids": [2, 3, 4, 5]}, {"input_ids": [6, 7, 8]}]
    store = tda_plugins.capture_examples(
        tiny_causal_lm("llama"), rows, tmp_path / "s", progress=False, curvature=True
    )
    for thread in threading.enumerate():
        if thread.name == "tda-store-end-sync":
            thread.join()
    assert names and not any(on_caller for _, on_caller in names)
    synced = {name for name, _ in names}
    assert (rank_dir(store.root, 0) / CURVATURE_FILE).exists()
    assert {STORE_FILE, EXAMPLES_FILE, INDEX_FILE, END_FILE, CURVATURE_FILE} <= synced


def test_step_durability_fsyncs_on_the_callers_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``"step"``: the header before the first micro-batch, each shard before its step is
    listed, the example texts before ``write_examples`` returns."""
    names = fsync_log(monkeypatch)
    store = capture(tmp_path, "step", end=False)
    assert (f".{STORE_FILE}", True) == (names[0][0].split(".tmp-")[0], names[0][1])
    store.on_end()
    store.flush()
    del names[:]
    store.write_examples({0: "an example"})
    assert [n.split(".tmp-")[0] for n, on_caller in names if on_caller] == [
        f".{EXAMPLES_FILE}",
        tmp_path.name,
    ]


def test_a_crashed_process_leaves_every_committed_step_readable(tmp_path: Path) -> None:
    """Without the end sync (the process died), the listed steps read back (the page
    cache holds them), and queries against the unfinished capture are refused unless
    allowed, as for any crashed capture."""
    capture(tmp_path / "step", "step")
    capture(tmp_path / "end", "end", end=False)
    assert StoreReader(tmp_path / "end").steps == [0, 1]
    assert StoreReader(tmp_path / "end").end_weights() is None
    expected, got = grads(tmp_path / "step"), grads(tmp_path / "end")
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_shard_torn_by_a_machine_crash_before_the_end_sync_is_refused(
    tmp_path: Path,
) -> None:
    """A machine crash before the end sync can lose a listed shard's unsynced bytes: the
    reader's checksum refuses the store instead of scoring what is left."""
    capture(tmp_path, "end", end=False)
    shard = sorted(rank_dir(tmp_path, 0).glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(StoreError, match="damaged: recapture"):
        grads(tmp_path)


def test_under_the_budget_a_micro_batch_never_waits_for_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the shard writes held, every micro-batch of a capture under its in-flight
    budget returns; the writes run once the disk is released."""
    release, returned = threading.Event(), []
    real = medium.write_renamed

    def held(path: Path, fill: object) -> None:
        assert release.wait(timeout=10), "a micro-batch waited for the held disk"
        real(path, fill)  # type: ignore[arg-type]

    monkeypatch.setattr(medium, "write_renamed", held)
    model = tiny_causal_lm("llama", seed=0)
    store = GradientStore(tmp_path, durability="end", in_flight_bytes=2**30)
    with CaptureEngine(model, layers=LayerSelection(), consumers=[store]) as engine:
        for k, batch in enumerate(STEPS[0] + STEPS[1]):
            summed_loss(model, batch).backward()
            returned.append(k)
        assert returned == [0, 1, 2, 3] and not (rank_dir(tmp_path, 0) / INDEX_FILE).exists()
        release.set()
        engine.optimizer_step()
        engine.end()
    assert StoreReader(tmp_path).steps == [0]


@pytest.mark.parametrize("consumer", [GradientStore, statistics.CurvatureAccumulator])
def test_an_unknown_durability_is_refused(tmp_path: Path, consumer: type) -> None:
    with pytest.raises(ValueError, match=r"durability must be one of \['end', 'none', 'step'\]"):
        consumer(tmp_path, durability="sometimes")


def test_the_end_sync_runs_after_the_capture_has_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the disk's fsyncs held, an ``"end"`` capture ends and its store reads back
    whole (from the page cache); :meth:`GradientStore.flush` waits for the held syncs."""
    capture(tmp_path / "step", "step")
    release, synced = threading.Event(), []
    real = writer.fsync_path

    def held(path: Path) -> None:
        assert release.wait(timeout=10), "the capture waited for the end sync"
        real(path)
        synced.append(path.name)

    monkeypatch.setattr(writer, "fsync_path", held)
    store = capture(tmp_path / "end", "end")  # returns with every fsync still held
    assert synced == []
    expected, got = grads(tmp_path / "step"), grads(tmp_path / "end")
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    release.set()
    store.flush()
    assert len(synced) == 9 and synced[-2:] == ["rank-0", "end"]  # + header, root folder


def test_a_failed_end_sync_is_raised_by_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A disk error in the end sync is logged when it happens and raised by ``flush``,
    naming the store and the cause."""

    def failing(path: Path) -> None:
        raise OSError(f"no space left for {path.name}")

    monkeypatch.setattr(writer, "fsync_path", failing)
    store = capture(tmp_path, "end")
    with pytest.raises(StoreError, match=r"durable failed.*no space left"):
        store.flush()
    assert "making the gradient store" in caplog.text and "no space left" in caplog.text


def test_a_process_that_ends_after_the_capture_waits_for_the_end_sync(tmp_path: Path) -> None:
    """A script that captures with ``"end"`` and exits at once (no flush) exits only after
    the end sync, slowed here, has made every file durable: the interpreter waits for it."""
    log = tmp_path / "synced.txt"
    script = f"""
import time
from pathlib import Path
from tda_plugins.store import writer
from tests import test_store_durability as t

real = writer.fsync_path
def slow(path):
    time.sleep(0.2)
    real(path)
    with open({str(log)!r}, "a") as f:
        f.write(path.name + "\\n")
writer.fsync_path = slow
t.capture(Path({str(tmp_path / "store")!r}), "end")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=Path(__file__).parent.parent, capture_output=True
    )
    assert done.returncode == 0 and "failed" not in done.stderr.decode(), done.stderr.decode()
    names = log.read_text().split()
    assert len(names) == 9 and names[-2:] == ["rank-0", "store"]
