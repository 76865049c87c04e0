"""``durability="end"`` (one-pass captures): no fsync until the end, then every shard, the
folder and the index once; the store reads exactly as a ``"step"`` store does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tda_plugins.store import GradientStore, StoreReader
from tda_plugins.store import writer as writer_module
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import run_captured

BATCHES = [lm_batch(2, 8, seed=s) for s in range(3)]


def _capture(path: Path, durability: str, synced: list[Path]) -> tuple[StoreReader, int]:
    """Capture BATCHES (one step each); returns the store and how many fsyncs ran before
    the end of capture."""
    store = GradientStore(path, durability=durability)  # type: ignore[arg-type]
    before_end: list[int] = []

    original_end = store.on_end

    def on_end() -> None:
        store.flush()
        before_end.append(len(synced))
        original_end()

    store.on_end = on_end  # type: ignore[method-assign]
    run_captured(tiny_causal_lm("llama"), BATCHES, [store], None, None)
    return StoreReader(path), before_end[0]


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path the store fsyncs, in order."""
    calls: list[Path] = []
    real = writer_module.fsync_path

    def counting(path: Path) -> None:
        calls.append(Path(path))
        real(path)

    monkeypatch.setattr(writer_module, "fsync_path", counting)
    return calls


def test_end_durability_syncs_only_at_the_end_and_reads_the_same(
    tmp_path: Path, synced: list[Path]
) -> None:
    step_store, step_before = _capture(tmp_path / "step", "step", synced)
    assert step_before >= len(BATCHES)  # every shard (and the folder) as it is committed
    synced.clear()
    end_store, end_before = _capture(tmp_path / "end", "end", synced)
    assert end_before == 0
    shards = {p.name for p in (tmp_path / "end" / "rank-0").glob("s*.safetensors")}
    assert {p.name for p in synced} >= shards | {"rank-0"}  # every shard, then the folder
    a, b = step_store.load_all(), end_store.load_all()
    assert torch.equal(a.example_ids, b.example_ids) and torch.equal(a.steps, b.steps)
    for name, grads in a.layers.items():
        assert torch.equal(grads.materialize(), b.layers[name].materialize())


def test_unknown_durability_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="durability"):
        GradientStore(tmp_path, durability="never")  # type: ignore[arg-type]
