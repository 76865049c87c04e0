"""The gradient store under crafted, damaged and concurrent use: it refuses, names the
input, touches nothing outside its own files, and never hands out a wrong value.

Each test builds a small real store (tiny Llama, ``tests.stores.capture_store``), breaks
one thing the way an attacker or a careless user would, and asserts the exact outcome: the
error and what it names, that a sentinel file outside the store keeps its bytes, and that
a refused operation leaves the store byte for byte as it was.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tda_plugins import CaptureEngine, LayerSelection, ProjectionConfig
from tda_plugins.capture.normalization import SummedLoss
from tda_plugins.methods import Scores, method_by_name
from tda_plugins.precondition import load_curvature
from tda_plugins.session.capture import CaptureSession
from tda_plugins.session.settings import CaptureSettings
from tda_plugins.store import GradientStore, StoreError, StoreReader
from tda_plugins.store.index import file_checksum
from tda_plugins.store.io import atomic_write_json
from tda_plugins.store.layout import CURVATURE_FILE, EXAMPLES_FILE, rank_dir, shard_name
from tda_plugins.store.lock import LOCK_FILE
from tda_plugins.store.texts import TextRecorder, example_line, read_texts
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import capture_store, summed_loss
from tests.trainers import word_tokenizer
from tests.zygote import Worker, Zygote

ALL = LayerSelection("linear")


def model(seed: int = 0) -> torch.nn.Module:
    return tiny_causal_lm("llama", seed=seed)


def batches(steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [lm_batch(2, 8, seed=seed + s) for s in range(steps)]


def store_of(
    path: Path, steps: int = 3, net: torch.nn.Module | None = None, layers: LayerSelection = ALL
) -> Path:
    """A committed store of ``steps`` steps of 2 examples, written with its model (so it
    has a fingerprint and end-of-capture weights) through a session's store."""
    net = net if net is not None else model()
    store = GradientStore(path, model=net)
    with CaptureEngine(net, layers=layers, consumers=[store]) as engine:
        for batch in batches(steps):
            summed_loss(net, batch).backward()
            net.zero_grad(set_to_none=True)
            engine.optimizer_step()
        engine.end()
    return path


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: its bytes and modification time (the writer lock file
    aside: each writer that takes the lock writes its pid there, and it holds no data)."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def index_path(store: Path) -> Path:
    return rank_dir(store, 0) / "index.json"


def edit_index(store: Path, change: Callable[[list[dict[str, Any]]], None]) -> None:
    index = json.loads(index_path(store).read_text())
    change(index["shards"])
    index_path(store).write_text(json.dumps(index))


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    """A file beside the store that nothing may touch."""
    path = tmp_path / "victim.txt"
    path.write_text("not the store's\n")
    return path


def assert_untouched(path: Path, before: tuple[bytes, int]) -> None:
    assert path.exists(), f"{path} was removed"
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


def unchanged(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


# -- index entries are names inside the store -------------------------------------------------

CRAFTED_FILES = {
    "traversal": "../../victim.txt",
    "absolute": "/tmp/victim.txt",
    "separator": "rank-0/s00000000-m000000.safetensors",
    "other step's name": "s00000009-m000000.safetensors",
}


@pytest.mark.parametrize("case", sorted(CRAFTED_FILES))
def test_a_crafted_file_name_in_the_index_is_refused_on_read(
    case: str, tmp_path: Path, sentinel: Path
) -> None:
    """An entry naming anything but its own shard file is refused before any read."""
    store = store_of(tmp_path / "store")
    edit_index(store, lambda shards: shards[0].update(file=CRAFTED_FILES[case]))
    before = unchanged(sentinel)
    with pytest.raises(StoreError, match="entry 0"):
        StoreReader(store)
    assert_untouched(sentinel, before)


def test_a_traversal_entry_is_refused_on_resume_and_nothing_is_removed(
    tmp_path: Path, sentinel: Path
) -> None:
    """A resumed run (which truncates later steps) refuses a store whose index names a file
    outside it, before removing anything: the issue's ``../../victim.txt`` case."""
    store = store_of(tmp_path / "store")
    edit_index(store, lambda shards: shards[-1].update(file="../../victim.txt"))
    before, files = unchanged(sentinel), snapshot(store)
    settings = CaptureSettings.from_options(store_dir=str(store), layers="linear", curvature=False)
    with pytest.raises(StoreError, match=r"victim\.txt"):
        CaptureSession(settings, model=model(), normalization=SummedLoss(), start_step=1)
    assert_untouched(sentinel, before)
    assert snapshot(store) == files


@pytest.mark.parametrize("key", ["file", "step", "micro_batch", "example_ids", "xxh3"])
def test_an_index_entry_missing_a_key_is_refused_naming_it(key: str, tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    edit_index(store, lambda shards: shards[1].pop(key))
    with pytest.raises(StoreError, match=rf"entry 1 lacks \['{key}'\]"):
        StoreReader(store)


def test_an_index_entry_of_the_wrong_type_is_refused(tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    edit_index(store, lambda shards: shards[0].update(step="0"))
    with pytest.raises(StoreError, match="step and micro_batch must be integers"):
        StoreReader(store)


def test_a_shard_listed_twice_is_refused(tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    edit_index(store, lambda shards: shards.append(dict(shards[0])))
    with pytest.raises(StoreError, match=f"lists {shard_name(0, 0)} a second time"):
        StoreReader(store)


def test_an_index_listing_other_examples_than_its_shard_is_refused(tmp_path: Path) -> None:
    """Counts and ids are checked against the shard's own rows when it is read."""
    store = store_of(tmp_path / "store")
    edit_index(store, lambda shards: shards[0].update(example_ids=shards[0]["example_ids"][:1]))
    with pytest.raises(StoreError, match="other examples than their index lists"):
        StoreReader(store).load_all()


def test_a_damaged_index_file_is_refused(tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    index_path(store).write_text('{"shards": [')
    with pytest.raises(StoreError, match="index is damaged"):
        StoreReader(store)


def test_a_damaged_store_header_is_refused(tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    (store / "store.json").write_text("{not json")
    with pytest.raises(StoreError, match="store header is damaged"):
        StoreReader(store)


# -- values: checksums and finiteness ----------------------------------------------------------


def test_a_flipped_byte_in_shard_data_is_detected_naming_the_shard(tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    shard = rank_dir(store, 0) / shard_name(1, 1)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40  # inside the last tensor's bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"{shard.name} does not match its checksum"):
        StoreReader(store).load_all()


def test_a_truncated_shard_is_detected(tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    shard = rank_dir(store, 0) / shard_name(2, 2)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(StoreError, match="does not match its checksum"):
        StoreReader(store).load_all()


def test_nan_in_a_shard_with_a_matching_checksum_is_reported_with_the_example_id(
    tmp_path: Path,
) -> None:
    """A crafted shard (NaN written and its checksum recomputed) is caught by the value
    check, which names the example."""
    store = store_of(tmp_path / "store")
    shard = rank_dir(store, 0) / shard_name(0, 0)
    tensors = load_file(shard)
    from safetensors import safe_open

    with safe_open(shard, "pt") as f:
        metadata = f.metadata()
    key = next(k for k, t in tensors.items() if t.is_floating_point())
    tensors[key][1].view(-1)[0] = float("nan")
    save_file(tensors, shard, metadata)
    edit_index(store, lambda shards: shards[0].update(xxh3=file_checksum(shard)))
    victim = int(tensors["example_ids"][1])
    with pytest.raises(StoreError, match=f"example {victim} in layer"):
        StoreReader(store).load_all()


def test_non_finite_scores_never_reach_json(tmp_path: Path) -> None:
    """``Scores.save`` refuses a NaN score naming both ids, and writes nothing."""
    values = torch.tensor([[1.0, float("nan")], [0.5, 2.0]])
    scores = Scores(torch.tensor([10, 11]), torch.tensor([20, 21]), values, "graddot")
    with pytest.raises(StoreError, match="training example 10 on query 21"):
        scores.save(tmp_path / "out")
    assert not (tmp_path / "out" / "topk.json").exists()


def test_json_written_by_the_store_is_strict(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="JSON compliant"):
        atomic_write_json(tmp_path / "x.json", {"score": float("inf")})
    assert not (tmp_path / "x.json").exists()


def test_a_damaged_curvature_file_is_a_store_error(tmp_path: Path) -> None:
    net = model()
    capture_store(net, batches(2), tmp_path / "store", ALL)
    path = rank_dir(tmp_path / "store", 0) / CURVATURE_FILE
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(StoreError, match=f"cannot read K-FAC statistics {path}"):
        load_curvature(tmp_path / "store")


# -- one writer --------------------------------------------------------------------------------


def hold_store(store: str) -> None:
    """In a worker: hold the store's rank-0 writer lock until a line comes on stdin."""
    GradientStore(store)
    print("holding", flush=True)
    sys.stdin.readline()


def hold(zygote: Zygote, store: Path) -> Worker:
    """Another process holding the store's rank-0 writer lock until a line on its stdin
    (its standard error: ``<store>.holder.log``)."""
    log = store.with_suffix(".holder.log")
    with log.open("w") as err:
        holder = zygote.popen(
            "tests.faults.test_store_faults:hold_store", str(store), stderr=err.fileno()
        )
    assert holder.stdout.readline().strip() == "holding", log.read_text()
    return holder


def test_a_second_writer_process_is_refused_naming_the_holder(
    tmp_path: Path, zygote: Zygote
) -> None:
    store = store_of(tmp_path / "store")
    with hold(zygote, store) as holder:
        files = snapshot(store)
        with pytest.raises(StoreError, match=f"another process \\(pid {holder.pid} on "):
            GradientStore(store, append=True)
        assert snapshot(store) == files
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=30) == 0


def test_the_lock_of_a_killed_writer_does_not_block_the_next_one(
    tmp_path: Path, zygote: Zygote
) -> None:
    store = store_of(tmp_path / "store")
    with hold(zygote, store) as holder:
        holder.kill()
        assert holder.wait(timeout=30) == -signal.SIGKILL
    GradientStore(store, append=True).close()


def test_a_later_writer_in_the_same_process_takes_over_and_the_first_stops(
    tmp_path: Path,
) -> None:
    """In one interpreter (a run resumed after an exception, its objects still alive) the
    new writer takes the directory and the earlier one refuses to write any more."""
    store = store_of(tmp_path / "store")
    first = GradientStore(store, append=True)
    second = GradientStore(store, append=True)
    with pytest.raises(StoreError, match="took over"):
        first.truncate(1)
    assert StoreReader(store).steps == [0, 1, 2]
    second.close()


# -- destructive steps only after every check -------------------------------------------------


def test_a_resume_refused_for_a_missing_curvature_snapshot_changes_nothing(
    tmp_path: Path,
) -> None:
    """The issue's case: the refused resume used to truncate steps first."""
    store = tmp_path / "store"
    net = model()
    settings = CaptureSettings.from_options(store_dir=str(store), layers="linear", curvature=True)
    session = CaptureSession(settings, model=net, normalization=SummedLoss())
    for batch in batches(4):
        summed_loss(net, batch).backward()
        net.zero_grad(set_to_none=True)
        session.step()
    session.end()
    files = snapshot(store)
    with pytest.raises(StoreError, match=r"no K-FAC statistics saved at step 2.*Nothing"):
        CaptureSession(settings, model=net, normalization=SummedLoss(), start_step=2)
    assert snapshot(store) == files


def test_checkpoint_statistics_go_only_when_a_later_checkpoint_is_seen(tmp_path: Path) -> None:
    """A checkpoint folder never seen (another node's disk, or still being written) keeps
    its K-FAC statistics; once a later checkpoint's folder is there and an earlier one's
    is not, the earlier one's statistics go, and only those."""
    store, saves = tmp_path / "store", tmp_path / "saves"
    net = model()
    settings = CaptureSettings.from_options(store_dir=str(store), layers="linear", curvature=True)
    session = CaptureSession(settings, model=net, normalization=SummedLoss())
    for step, batch in enumerate(batches(3), start=1):
        summed_loss(net, batch).backward()
        net.zero_grad(set_to_none=True)
        session.step()
        session.save_checkpoint(step, saves / f"checkpoint-{step}")

    def copies() -> list[int]:
        return sorted(int(p.stem.rsplit("step", 1)[1]) for p in store.glob("rank-0/*before-*"))

    session.drop_deleted_checkpoints()  # no folder seen: nothing goes
    assert copies() == [1, 2, 3]
    (saves / "checkpoint-3").mkdir(parents=True)  # 1 was written and removed, 2 is there
    (saves / "checkpoint-2").mkdir()
    session.drop_deleted_checkpoints()
    assert copies() == [2, 3]
    session.end()


#: refused session start -> (layer kind, start step, what the error says)
REFUSED_STARTS = {
    "resume past the store's end": ("linear", 7, "steps would be missing"),
    "fresh run on a store with steps": ("linear", 0, "of another run"),
    "resume with another layer selection": ("all", 1, "layers differ"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_STARTS))
def test_a_refused_session_start_changes_nothing(case: str, tmp_path: Path) -> None:
    layers, start, message = REFUSED_STARTS[case]
    store = store_of(tmp_path / "store")
    files = snapshot(store)
    settings = CaptureSettings.from_options(store_dir=str(store), layers=layers, curvature=False)
    with pytest.raises(StoreError, match=message):
        CaptureSession(settings, model=model(), normalization=SummedLoss(), start_step=start)
    assert snapshot(store) == files


def test_reopening_removes_only_its_own_leftovers(tmp_path: Path) -> None:
    """A crashed writer's unlisted shard and half-written temp file go; anything else in
    the rank directory (a user's note, a curvature file) stays."""
    store = store_of(tmp_path / "store")
    folder = rank_dir(store, 0)
    orphan = folder / shard_name(5, 9)
    orphan.write_bytes(b"cut short")
    temp = folder / f".{shard_name(5, 10)}.tmp-123"
    temp.write_bytes(b"cut short")
    note = folder / "notes.txt"
    note.write_text("mine")
    before = unchanged(note)
    with CaptureEngine(model(), layers=ALL, consumers=[GradientStore(store, append=True)]):
        pass
    assert not orphan.exists() and not temp.exists()
    assert_untouched(note, before)


# -- appending and ids ----------------------------------------------------------------------


def test_capturing_into_a_store_with_steps_needs_append(tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    files = snapshot(store)
    with (
        pytest.raises(StoreError, match=r"already holds steps 0\.\.2; pass append=True"),
        CaptureEngine(model(), layers=ALL, consumers=[GradientStore(store)]),
    ):
        pass
    assert snapshot(store) == files


def test_appending_with_another_model_is_refused(tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    files = snapshot(store)
    other = tiny_causal_lm("gpt2")
    with (
        pytest.raises(StoreError, match="another config or model"),
        CaptureEngine(
            other, layers=ALL, consumers=[GradientStore(store, append=True, model=other)]
        ),
    ):
        pass
    assert snapshot(store) == files


def capture_with_ids(store: GradientStore, net: torch.nn.Module, ids: list[list[int]]) -> None:
    """One step per id list (2 examples each), with those explicit ids."""
    with CaptureEngine(net, layers=ALL, consumers=[store]) as engine:
        for step, step_ids in enumerate(ids):
            engine.set_example_ids(torch.tensor(step_ids))
            summed_loss(net, lm_batch(2, 8, seed=step)).backward()
            net.zero_grad(set_to_none=True)
            engine.optimizer_step()
        engine.end()


def test_the_same_id_twice_in_one_step_is_refused(tmp_path: Path) -> None:
    """Explicit ids repeat within a step where the ids are not unique, or where the sampler
    drew one row twice (with replacement): the refusal names both causes."""
    with pytest.raises(StoreError, match="example id 7 occurs twice in step 0") as refused:
        capture_with_ids(GradientStore(tmp_path / "s"), model(), [[7, 7]])
    assert "sampling with replacement" in str(refused.value)


def test_a_one_pass_capture_refuses_an_id_seen_in_an_earlier_step(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="example id 2 occurs twice in this capture"):
        capture_with_ids(GradientStore(tmp_path / "s", unique_ids=True), model(), [[1, 2], [2, 3]])
    assert StoreReader(tmp_path / "s").steps == [0]


def test_a_training_store_accepts_an_id_again_at_a_later_step(tmp_path: Path) -> None:
    """The next epoch sees the same example: legitimate in a training store."""
    capture_with_ids(GradientStore(tmp_path / "s"), model(), [[1, 2], [2, 1]])
    chunk = StoreReader(tmp_path / "s").load_all()
    assert chunk.example_ids.tolist() == [1, 2, 2, 1] and chunk.steps.tolist() == [0, 0, 1, 1]


# -- the queries' model -----------------------------------------------------------------------


def test_queries_of_other_weights_with_the_same_shapes_are_refused(tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    queries = store_of(tmp_path / "queries", steps=1, net=model(seed=1))
    graddot = method_by_name("graddot")
    with pytest.raises(StoreError, match="other weights than the training run ended with"):
        graddot.score(StoreReader(store), StoreReader(queries))
    scores = graddot.score(StoreReader(store), StoreReader(queries), allow_mismatch=True)
    assert scores.values.shape == (6, 2)


NO_HEAD = LayerSelection("linear", exclude=r"lm_head")


def test_queries_with_more_layers_than_the_store_are_scored_on_the_stores_layers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A training store without the LM head (as TRL's fused head leaves it) against queries
    captured with it: checked and scored on the store's layers, equal to queries captured
    with exactly those, and the layers left out are named in a warning."""
    store = StoreReader(store_of(tmp_path / "store", layers=NO_HEAD))
    assert "lm_head" not in store.layer_names
    more = StoreReader(store_of(tmp_path / "more", steps=1))
    same = StoreReader(store_of(tmp_path / "same", steps=1, layers=NO_HEAD))
    assert "lm_head" in more.layer_names
    for name in ("graddot", "gradcos"):
        with caplog.at_level("WARNING"):
            caplog.clear()
            got = method_by_name(name).score(store, more)
        assert "hold 1 layer(s) the store" in caplog.text and "lm_head" in caplog.text
        assert torch.equal(got.values, method_by_name(name).score(store, same).values), name


def test_queries_with_more_layers_are_refused_when_a_store_layer_has_other_weights(
    tmp_path: Path,
) -> None:
    store = store_of(tmp_path / "store", layers=NO_HEAD)
    other = model()
    with torch.no_grad():
        other.get_submodule("model.layers.1.mlp.down_proj").weight.mul_(2)
    queries = store_of(tmp_path / "queries", steps=1, net=other)
    with pytest.raises(StoreError, match=r"other weights .*\(layers \['model\.layers\.1\.mlp"):
        StoreReader(store).require_compatible(StoreReader(queries))


def without_layer_digests(store: Path) -> None:
    """Rewrite ``end.json`` as a tda-plugins that recorded only the whole digest wrote it."""
    path = rank_dir(store, 0) / "end.json"
    end = json.loads(path.read_text())
    del end["layer_weights_xxh3"]
    atomic_write_json(path, end)


def test_stores_without_layer_digests_compare_whole_and_refuse_more_layers(
    tmp_path: Path,
) -> None:
    """Written before the per-layer digests: the same layers still compare by the whole
    digest; queries with more layers cannot be checked, and the refusal says what to do."""
    store = store_of(tmp_path / "store", layers=NO_HEAD)
    same = store_of(tmp_path / "same", steps=1, layers=NO_HEAD)
    more = store_of(tmp_path / "more", steps=1)
    for path in (store, same):
        without_layer_digests(path)
    StoreReader(store).require_compatible(StoreReader(same))
    with pytest.raises(StoreError, match="capture the queries with the store's layers"):
        StoreReader(store).require_compatible(StoreReader(more))


def test_queries_of_another_model_config_are_refused_naming_the_key(tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    other = model()
    other.config.rms_norm_eps = 1e-3
    queries = store_of(tmp_path / "queries", steps=1, net=other)
    with pytest.raises(StoreError, match=r"model config rms_norm_eps=1e-06 vs 0\.001"):
        StoreReader(store).require_compatible(StoreReader(queries))


def test_queries_of_another_projection_are_refused_even_when_mismatch_is_allowed(
    tmp_path: Path,
) -> None:
    store = store_of(tmp_path / "store")
    capture_store(
        model(), batches(1), tmp_path / "q", ALL, ProjectionConfig("factor", k_a=4, k_g=4)
    )
    with pytest.raises(StoreError, match="projection differs"):
        StoreReader(store).require_compatible(StoreReader(tmp_path / "q"), allow_mismatch=True)


def test_queries_against_an_unfinished_capture_are_refused_unless_allowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store whose capture never ended has no final weights to check queries against;
    allowed, it is scored with a warning that it holds only the steps it committed."""
    store = store_of(tmp_path / "store")
    (rank_dir(store, 0) / "end.json").unlink()
    queries = store_of(tmp_path / "queries", steps=1)
    with pytest.raises(StoreError, match="its capture did not finish"):
        StoreReader(store).require_compatible(StoreReader(queries))
    with caplog.at_level(logging.WARNING):
        StoreReader(store).require_compatible(StoreReader(queries), allow_mismatch=True)
    assert f"scoring {store}, whose capture did not finish" in caplog.text


def test_a_one_pass_capture_killed_before_its_end_is_named_and_not_appended_to_with_curvature(
    tmp_path: Path,
) -> None:
    """A one-pass capture (``tda capture``) saves its K-FAC statistics at its end; killed
    before it, the store holds committed steps, no statistics and no end marker (made
    here by removing them from a finished capture). K-FAC then names the unfinished
    capture rather than asking for curvature; appending more rows with curvature, which
    would sum the new examples alone, is refused before anything is written; without
    curvature the rows are appended."""
    from tda_plugins import attribute, capture_examples
    from tests.trainers import token_rows

    model = tiny_causal_lm("llama")
    rows = [{"input_ids": r} for r in token_rows(8)]
    store = tmp_path / "store"
    options = {"layers": "linear", "batch_size": 2, "progress": False}
    capture_examples(model, rows[:4], store, curvature=True, **options)
    queries = capture_examples(model, rows[:1], tmp_path / "q", **options)
    for path in [*store.glob("rank-*/curvature*"), *store.glob("rank-*/end.json")]:
        path.unlink()
    with pytest.raises(StoreError, match="its capture did not finish"):
        attribute(store, queries, "kfac", allow_mismatch=True)
    with pytest.raises(ValueError, match=r"holds steps 0\.\.1 but K-FAC statistics of none"):
        capture_examples(model, rows[4:], store, append=True, curvature=True, **options)
    assert StoreReader(store).steps == [0, 1]
    capture_examples(model, rows[4:], store, append=True, curvature=False, **options)
    assert StoreReader(store).steps == [0, 1, 2, 3]


def test_a_one_pass_capture_stopped_after_its_first_step_keeps_every_text(
    tmp_path: Path,
) -> None:
    """The texts are written once the first batch is committed, not at the end: a capture
    stopped at its second batch (here by an error in the model's forward) holds the text
    of every example, and after appending the rows it did not reach every stored
    example has its text, as an uninterrupted capture's does."""
    from tda_plugins import capture_examples
    from tests.trainers import token_rows, word_tokenizer

    model = tiny_causal_lm("llama")
    rows = [{"text": " ".join(map(str, r)), "id": 50 + i} for i, r in enumerate(token_rows(6))]
    store = tmp_path / "store"
    options = {"layers": "linear", "batch_size": 2, "progress": False, "curvature": False}

    class Stop(RuntimeError):
        pass

    calls = {"n": 0}

    def stop_at_the_second_batch(module: Any, args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise Stop

    hook = model.register_forward_pre_hook(stop_at_the_second_batch)
    with pytest.raises(Stop):
        capture_examples(model, rows, store, tokenizer=word_tokenizer(), **options)
    hook.remove()
    assert StoreReader(store).steps == [0]
    done = set(StoreReader(store).load_all().example_ids.tolist())
    assert done == {50, 51}
    capture_examples(model, rows[2:], store, append=True, tokenizer=word_tokenizer(), **options)
    reader = StoreReader(store)
    texts = reader.texts()
    assert set(reader.load_all().example_ids.tolist()) == set(range(50, 56))
    assert {i: texts[i] for i in range(50, 56)} == {50 + i: r["text"] for i, r in enumerate(rows)}


# -- an index, a rank folder or a shard that is not the capture's own ---------------------


@pytest.mark.parametrize("cut", ["last", "middle"])
def test_an_index_cut_short_after_the_capture_is_refused(tmp_path: Path, cut: str) -> None:
    """Entries removed from a finished rank's index (each left valid): the store would be
    scored as a smaller one; its end marker's last step and shard count refuse it."""
    store = store_of(tmp_path / "store", steps=4)
    edit_index(store, lambda shards: shards.pop(-1 if cut == "last" else 1))
    with pytest.raises(StoreError, match=r"lists 3 shards .* ended with 4 shards .*cut short"):
        StoreReader(store)


def test_a_shard_listed_again_as_another_step_is_refused(tmp_path: Path) -> None:
    """A shard's file copied in as a new step, its checksum with it: refused by the shard
    count at the end (finished store) and, without the end marker, by the place the
    shard's header says it was written at."""
    store = store_of(tmp_path / "store", steps=2)
    folder = rank_dir(store, 0)
    copy = "s00000002-m000000.safetensors"
    (folder / copy).write_bytes((folder / "s00000000-m000000.safetensors").read_bytes())

    def add_copy(shards: list[dict[str, Any]]) -> None:
        shards.append({**shards[0], "file": copy, "step": 2})

    edit_index(store, add_copy)
    with pytest.raises(StoreError, match="cut short"):
        StoreReader(store)
    (folder / "end.json").unlink()
    with pytest.raises(StoreError, match=r"written as rank 0 step 0 .* lists it as rank 0 step 2"):
        StoreReader(store).load_all()


@pytest.mark.parametrize("name", ["rank-1", "rank-00"])
def test_a_rank_folder_copied_beside_itself_is_refused(tmp_path: Path, name: str) -> None:
    """``cp -r rank-0 <name>``: its examples would count twice (every score doubled).
    ``rank-00`` is no name the writer gives; ``rank-1``'s shards say they are rank 0's."""
    import shutil

    store = store_of(tmp_path / "store")
    shutil.copytree(rank_dir(store, 0), store / name)
    with pytest.raises(StoreError, match="copied"):
        StoreReader(store).load_all()


def test_an_append_stopped_before_its_end_leaves_the_store_unfinished(tmp_path: Path) -> None:
    """The end marker of the capture appended to goes when the append starts: stopped
    midway, the store reads as unfinished (queries refused unless allowed), not as the
    finished capture it was."""
    store = store_of(tmp_path / "store", steps=2)
    net = model()
    writer = GradientStore(store, model=net, append=True)
    with CaptureEngine(net, layers=ALL, consumers=[writer]) as engine:
        engine.resume_at_step(writer.next_step)
        summed_loss(net, batches(1, seed=5)[0]).backward()
        engine.optimizer_step()
        writer.flush()  # stopped here: no end
    queries = store_of(tmp_path / "queries", steps=1)
    reader = StoreReader(store)
    assert reader.steps == [0, 1, 2]
    with pytest.raises(StoreError, match="its capture did not finish"):
        reader.require_compatible(StoreReader(queries))


def test_appending_rows_with_other_loss_tokens_is_refused(tmp_path: Path) -> None:
    """A store of prompt/completion rows trained on their completions: appending rows that
    carry their loss on every token would mix two conventions under one label."""
    from tda_plugins import capture_examples
    from tests.trainers import prompt_completion_pairs, word_tokenizer

    net = model()
    rows = [pair.row() for pair in prompt_completion_pairs(6)]
    options = {"layers": "linear", "batch_size": 2, "progress": False, "curvature": False}
    store = tmp_path / "store"
    capture_examples(net, rows[:4], store, tokenizer=word_tokenizer(), **options)
    before = snapshot(store)
    with pytest.raises(StoreError, match="carry their loss on"):
        capture_examples(
            net,
            rows[4:],
            store,
            tokenizer=word_tokenizer(),
            append=True,
            completion_only_loss=False,
            **options,
        )
    assert snapshot(store) == before


def test_appending_rows_cut_at_another_length_is_accepted(tmp_path: Path) -> None:
    """The cut (``max_length``) is recorded but is no loss switch: each row keeps the
    tokens it was captured on, so rows cut at another length may join the store."""
    from tda_plugins import capture_examples
    from tests.trainers import prompt_completion_pairs, word_tokenizer

    net = model()
    rows = [pair.row() for pair in prompt_completion_pairs(6)]
    options = {"layers": "linear", "batch_size": 2, "progress": False, "curvature": False}
    store = tmp_path / "store"
    capture_examples(net, rows[:4], store, tokenizer=word_tokenizer(), max_length=32, **options)
    assert StoreReader(store).metadata["loss_tokens"]["max_length"] == 32
    capture_examples(net, rows[4:], store, tokenizer=word_tokenizer(), append=True, **options)
    assert StoreReader(store).num_examples == 6


def test_allowing_other_queries_still_refuses_ranks_that_ended_at_different_weights(
    tmp_path: Path,
) -> None:
    """``allow_mismatch`` is for queries of another model, not for a store whose own
    ranks disagree (rank 1 captured at other weights of the same config)."""
    store = store_of(tmp_path / "store")
    other = model(seed=1)
    writer = GradientStore(store, rank=1, model=other)
    with CaptureEngine(other, layers=ALL, consumers=[writer]) as engine:
        summed_loss(other, batches(1, seed=7)[0]).backward()
        engine.optimizer_step()
        engine.end()
    queries = store_of(tmp_path / "queries", steps=1)
    with pytest.raises(StoreError, match="ended at different weights"):
        StoreReader(store).require_compatible(StoreReader(queries), allow_mismatch=True)


def test_a_rank_folder_of_a_capture_with_other_loss_tokens_is_refused(tmp_path: Path) -> None:
    """Rank 1 of another two-rank capture, whose rows carried their loss on every token,
    copied beside a completion-only capture's rank 0: its end marker names its loss
    tokens, which are not the store's."""
    import shutil

    from tda_plugins.store.layout import LOSS_TOKENS

    def capture(root: Path, rank: int, completion_only: bool) -> None:
        net = model()
        tokens = {"completion_only_loss": completion_only, "assistant_only_loss": False}
        store = GradientStore(root, rank=rank, model=net, metadata={LOSS_TOKENS: tokens})
        with CaptureEngine(net, layers=ALL, consumers=[store]) as engine:
            summed_loss(net, batches(1, seed=rank)[0]).backward()
            engine.optimizer_step()
            engine.end()

    capture(tmp_path / "store", 0, completion_only=True)
    for rank in (0, 1):
        capture(tmp_path / "other", rank, completion_only=False)
    shutil.copytree(rank_dir(tmp_path / "other", 1), rank_dir(tmp_path / "store", 1))
    with pytest.raises(StoreError, match=r"rank-1 was captured with its rows' loss on"):
        StoreReader(tmp_path / "store")
    StoreReader(tmp_path / "other").load_all()  # the rank folder itself is sound


def test_a_store_written_before_eos_was_recorded_is_appended_to(tmp_path: Path) -> None:
    """A store whose ``loss_tokens`` lacks ``eos`` (written before it was recorded) takes
    an append that agrees on the switches it does record; the ones it lacks are not
    compared."""
    from tda_plugins import capture_examples
    from tests.trainers import prompt_completion_pairs, word_tokenizer

    net = model()
    rows = [pair.row() for pair in prompt_completion_pairs(6)]
    options = {"layers": "linear", "batch_size": 2, "progress": False, "curvature": False}
    store = tmp_path / "store"
    capture_examples(net, rows[:4], store, tokenizer=word_tokenizer(), **options)
    for path in (store / "store.json", rank_dir(store, 0) / "end.json"):
        data = json.loads(path.read_text())
        entry = data["metadata"] if path.name == "store.json" else data
        del entry["loss_tokens"]["eos"]
        path.write_text(json.dumps(data))
    capture_examples(net, rows[4:], store, tokenizer=word_tokenizer(), append=True, **options)
    assert StoreReader(store).num_examples == 6


def test_texts_appended_after_a_killed_run_cut_its_unfinished_line_first(tmp_path: Path) -> None:
    """A run killed while appending texts leaves an unfinished last line; the resumed run's
    recorder cuts it before appending, so the file reads whole (its complete lines and the
    new ones) rather than holding a damaged line in its middle."""
    texts = rank_dir(tmp_path, 0) / EXAMPLES_FILE
    texts.parent.mkdir(parents=True)
    texts.write_text(example_line(7, "kept from the first run") + '{"id": 8, "text": "cut sh')
    model = tiny_causal_lm("llama")
    recorder = TextRecorder(tmp_path, 0, word_tokenizer())
    batch = lm_batch(2, 6, seed=3)
    with CaptureEngine(model, layers=LayerSelection("linear"), consumers=[recorder]) as engine:
        summed_loss(model, batch).backward()
        engine.optimizer_step()
        engine.end()
    read = read_texts(tmp_path)
    assert read.pop(7) == "kept from the first run" and 8 not in read
    assert len(read) == 2 and all(text.startswith("w") for text in read.values())
    assert texts.read_text().endswith("\n")
