"""A store in memory (:func:`~tda_plugins.store.memory.memory_store`) keeps the captured
tensors in this process, scores exactly as the same capture on disk, refuses to be read
where its gradients are not, and leaves nothing behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import tda_plugins
from tda_plugins import LayerSelection
from tda_plugins.methods import method_by_name
from tda_plugins.store import GradientStore, StoreError, StoreReader
from tda_plugins.store.layout import SHARD_PATTERN, rank_dir
from tda_plugins.store.medium import FILES
from tda_plugins.store.memory import medium_for, memory_store
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import capture_store

TRAIN = [lm_batch(lengths=(10, 7, 5), seed=1), lm_batch(lengths=(8, 10, 6), seed=2)]
QUERIES = [lm_batch(batch=2, lengths=(10, 4), seed=3)]
LAYERS = LayerSelection("linear")


def stores(root: Path) -> tuple[StoreReader, StoreReader]:
    """:data:`TRAIN` (with K-FAC statistics) and :data:`QUERIES` captured under ``root``."""
    model = tiny_causal_lm("llama", torch.float32)
    store = capture_store(model, TRAIN, root / "train", LAYERS)
    return store, capture_store(model, QUERIES, root / "q", LAYERS, curvature=False)


def scores(root: Path) -> dict[str, torch.Tensor]:
    """GradDot and EK-FAC scores of :data:`QUERIES` against :data:`TRAIN` in ``root``."""
    store, queries = stores(root)
    return {m: method_by_name(m).score(store, queries).values for m in ("graddot", "ekfac")}


def chunk_tensors(store: StoreReader, max_examples: int) -> list[torch.Tensor]:
    """Every tensor of every chunk of ``store``, in order."""
    out: list[torch.Tensor] = []
    for chunk in store.iter_chunks(max_examples):
        out.append(chunk.example_ids)
        for grads in chunk.layers.values():
            grads.map_tensors(lambda t: out.append(t) or t)
    return out


def shard_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if SHARD_PATTERN.fullmatch(p.name)]


def test_scores_through_a_memory_store_equal_the_disk_stores_exactly(tmp_path: Path) -> None:
    on_disk = scores(tmp_path)
    with memory_store() as folder:
        in_memory = scores(folder)
        assert medium_for(folder / "train") is not FILES
        assert not shard_files(folder)  # the gradients never left this process
    assert not folder.exists()
    assert medium_for(folder / "train") is FILES  # the shards were freed with the block
    assert all(torch.equal(in_memory[m], on_disk[m]) for m in on_disk)


@pytest.mark.parametrize("max_examples", [3, 256])  # one shard a chunk, and both together
def test_chunks_read_from_memory_equal_the_disk_stores(tmp_path: Path, max_examples: int) -> None:
    disk = chunk_tensors(stores(tmp_path)[0], max_examples)
    with memory_store() as folder:
        memory = chunk_tensors(stores(folder)[0], max_examples)
    assert len(memory) == len(disk)
    assert all(torch.equal(m, d) for m, d in zip(memory, disk, strict=True))


def test_a_memory_store_read_in_another_process_is_refused_naming_the_way_out(
    tmp_path: Path,
) -> None:
    with memory_store() as folder:
        stores(folder)
        # what another process sees: the folder's files, and no gradients
        shutil.copytree(folder / "train", tmp_path / "train")
    with pytest.raises(StoreError, match=r"memory store.*capture into a folder on disk"):
        StoreReader(tmp_path / "train")
    model = tiny_causal_lm("llama", torch.float32)
    with pytest.raises(StoreError, match="memory store"):
        capture_store(model, TRAIN, tmp_path / "train", LAYERS, curvature=False, append=True)


def test_a_stored_tensor_written_to_in_place_is_refused_on_the_next_read() -> None:
    with memory_store() as folder:
        store, _ = stores(folder)
        chunk = next(store.iter_chunks(max_examples=3))
        name = next(iter(chunk.layers))
        chunk.layers[name].map_tensors(lambda t: t.mul_(2))
        with pytest.raises(StoreError, match="written to in place"):
            next(store.iter_chunks(max_examples=3))


def test_truncate_frees_the_dropped_steps_shards() -> None:
    with memory_store() as folder:
        stores(folder)
        store = GradientStore(folder / "train", append=True)
        store.truncate(from_step=1)
        store.close()
        held = medium_for(folder / "train").shard_paths(rank_dir(folder / "train", 0))
        assert [p.name for p in held] == ["s00000000-m000000.safetensors"]
        assert StoreReader(folder / "train").steps == [0]


def test_another_rank_is_refused_naming_the_way_out() -> None:
    with memory_store() as folder, pytest.raises(StoreError, match="folder on disk"):
        GradientStore(folder / "train", rank=1)


def test_a_folder_that_is_not_there_is_refused(tmp_path: Path) -> None:
    absent = memory_store(under=tmp_path / "absent")
    with pytest.raises(OSError, match="not a folder"), absent:
        pass


def test_the_readmes_memory_path_scores_as_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``capture_examples`` into a memory store and ``attribute`` from it, as the README
    shows, give the disk's scores; the store's writes fsync nothing (no K-FAC statistics
    here: those are saved durably beside any store)."""
    rows = [{"input_ids": [2, 3, 4, 5, 6]}, {"input_ids": [6, 7, 8]}, {"input_ids": [9, 4]}]
    model = tiny_causal_lm("llama", torch.float32)

    def attributed(root: Path) -> torch.Tensor:
        for name in ("train", "queries"):
            tda_plugins.capture_examples(
                model, rows, root / name, progress=False, batch_size=2, curvature=False
            )
        return tda_plugins.attribute(root / "train", root / "queries", "graddot").values

    synced: list[int] = []  # first: no other store's end sync may be running
    with memory_store() as root:
        monkeypatch.setattr(os, "fsync", synced.append)
        in_memory = attributed(root)
        monkeypatch.undo()
        assert not shard_files(root)
    assert synced == []
    on_disk = attributed(tmp_path)
    assert torch.equal(in_memory, on_disk)
