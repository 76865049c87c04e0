"""The gradient store: what is written reads back exactly, and nothing committed is lost.

Covered: round trips of every representation (per-token linear factors, compacted dense
gradients, embedding factors, norm scales, factor and dense projections) through
``StoreReader.iter_chunks`` and ``load_all``, against the engine's records and the loop
oracle; the storage rule of ``compact``; inputs shared by q/k/v written once; a SIGKILL
between two micro-batches of a step (a worker process running ``tests.store_worker``) and a
resume that scores like an uninterrupted run; refusal of another format version or
capture config; bad inputs (empty or mismatched queries, NaN gradients, truncation,
appending without resuming); and the merged view of two ranks.

Gradients are each example's own summed token loss (``tests.stores.summed_loss``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, cast

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor, nn

from tda_plugins import (
    CaptureEngine,
    LayerSelection,
    MicroBatchRecord,
    ProjectionConfig,
    RecordCollector,
)
from tda_plugins.capture import CaptureConsumer, content_hash
from tda_plugins.capture.normalization import SummedLoss
from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.embedding import EmbeddingFactors
from tda_plugins.grads.tokens import TokenFactors
from tda_plugins.methods import Scores, method_by_name
from tda_plugins.session.capture import CaptureSession
from tda_plugins.session.settings import CaptureSettings
from tda_plugins.store import (
    FORMAT_VERSION,
    GradientStore,
    StoreError,
    StoreReader,
    medium,
    writer,
)
from tda_plugins.store.index import ShardEntry
from tda_plugins.store.io import atomic_write
from tda_plugins.store.layout import rank_dir, shard_name
from tda_plugins.store.sync import BackgroundSync
from tests import store_worker
from tests.models import lm_batch, tiny_causal_lm
from tests.oracle import max_rel_error
from tests.stores import flat_oracle_grads, summed_loss
from tests.zygote import Worker, Zygote

ALL = LayerSelection("all")
Batch = dict[str, Tensor]
#: Per optimizer step, its micro-batches (one backward each).
Steps = Sequence[Sequence[Batch]]
# The summed loss is computed from fp32 logits (``causal_lm_example_losses``): a padded
# batch and its unpadded examples can round one fp32 ulp apart there (~1e-7 relative).
ORACLE_TOL = 1e-6


# -- capturing and reading -----------------------------------------------------------------


def micro_batches(steps: int, lengths: tuple[int, int], seed: int = 0) -> list[list[Batch]]:
    """Per step: 3 right-padded examples of length ``lengths[0]``, then 2 of ``lengths[1]``."""
    long, short = lengths
    return [
        [
            lm_batch(3, long, lengths=(long, long - 3, long - 5), seed=seed + 10 * s),
            lm_batch(2, short, seed=seed + 10 * s + 1),
        ]
        for s in range(steps)
    ]


def capture(
    model: nn.Module,
    steps: Steps,
    path: Path,
    layers: LayerSelection = ALL,
    projection: ProjectionConfig | None = None,
    keep_tokens: bool = False,
    rank: int = 0,
) -> list[MicroBatchRecord]:
    """Capture ``steps`` into the store at ``path``; returns what the engine handed it."""
    collector = RecordCollector()
    store = GradientStore(path, rank=rank, keep_tokens=keep_tokens)
    with CaptureEngine(
        model, layers=layers, projection=projection, consumers=[store, collector]
    ) as engine:
        for step in steps:
            for batch in step:
                summed_loss(model, batch).backward()
            engine.optimizer_step()
        engine.end()
    model.zero_grad(set_to_none=True)
    return collector.records


def all_batches(steps: Steps) -> list[Batch]:
    return [batch for step in steps for batch in step]


def expected_ids(steps: Steps) -> Tensor:
    """Content hashes of the unpadded examples, in capture order."""
    return torch.cat(
        [content_hash(b["input_ids"], b["attention_mask"]) for b in all_batches(steps)]
    )


def expected_steps(steps: Steps) -> Tensor:
    return torch.cat(
        [torch.full((len(b["input_ids"]),), s) for s, step in enumerate(steps) for b in step]
    )


def records_materialized(records: list[MicroBatchRecord]) -> dict[str, Tensor]:
    """Layer -> ``(N, D)`` gradients of every record, in capture order."""
    names = records[0].layers
    return {n: torch.cat([r.layers[n].grads.materialize() for r in records]) for n in names}


def read_chunks(reader: StoreReader, max_examples: int) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Ids, steps and layer -> ``(N, D)`` gradients over ``iter_chunks(max_examples)``."""
    chunks = list(reader.iter_chunks(max_examples))
    assert all(c.size <= max_examples for c in chunks)
    layers = {n: torch.cat([c.layers[n].materialize() for c in chunks]) for n in reader.layer_names}
    ids = torch.cat([c.example_ids for c in chunks])
    return ids, torch.cat([c.steps for c in chunks]), layers


def stored_kinds(root: Path, record: MicroBatchRecord, rank: int = 0) -> dict[str, str]:
    """Layer -> representation written in ``record``'s shard."""
    with safe_open(rank_dir(root, rank) / shard_name(record.step, record.index), "pt") as f:
        return {n: v["kind"] for n, v in json.loads(f.metadata()["layers"]).items()}


def allowed_kinds(grads: PerExampleGrad, keep_tokens: bool) -> set[str]:
    """docs/design.md section 3.5: factors are smaller when ``T < N_i N_o / (N_i + N_o)``; at
    equality both forms take the same bytes, so either is right."""
    if isinstance(grads, EmbeddingFactors):
        return {"embedding_factors"}
    if isinstance(grads, DenseGrad):
        return {"dense"}
    if keep_tokens:
        return {"token_factors"}
    factors = grads.tokens * (grads.in_dim + grads.out_dim)
    if factors == grads.dim:
        return {"token_factors", "dense"}
    return {"token_factors"} if factors < grads.dim else {"dense"}


def snapshot(root: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under ``root``."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def graddot(store: StoreReader, queries: StoreReader, chunk_examples: int = 256) -> Scores:
    return method_by_name("graddot").score(store, queries, chunk_examples)


def by_train_id(scores: Scores) -> tuple[Tensor, Tensor]:
    """Train ids and score rows, sorted by train id."""
    order = torch.argsort(scores.train_ids)
    return scores.train_ids[order], scores.values[order]


# -- 1. round trip ---------------------------------------------------------------------


ROUND_TRIPS = {
    # (lengths of the two micro-batches of a step, projection, keep_tokens)
    "factors": ((10, 7), None, False),
    "compacted": ((20, 12), None, False),
    "keep_tokens": ((20, 12), None, True),
    "factor_projection": ((20, 12), ProjectionConfig("factor", k_a=24, k_g=24), False),
    "dense_projection": ((10, 7), ProjectionConfig("dense", k=24), False),
}
#: Representations each case must actually write (so the case tests what it says).
MUST_WRITE = {
    "factors": {"token_factors", "embedding_factors", "dense"},
    "compacted": {"token_factors", "embedding_factors", "dense"},
    "keep_tokens": {"token_factors", "embedding_factors", "dense"},
    "factor_projection": {"token_factors", "dense"},
    "dense_projection": {"dense"},
}
#: Cases where a layer is stored in one form in a step's first micro-batch and in the
#: other in its second (the longer sequences compact to dense gradients).
MIXED_WITHIN_A_STEP = {"compacted", "factor_projection"}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_store_reads_back_the_captured_gradients_ids_and_steps(case: str, tmp_path: Path) -> None:
    """Three steps of two micro-batches each (right padding, two sequence lengths) read back,
    in chunks and all at once, with the example ids (content hashes), the steps, and each
    layer's gradients exactly as the engine captured them (and, unprojected, as the loop
    oracle computes them); each layer of each shard is stored in the smaller form."""
    lengths, projection, keep_tokens = ROUND_TRIPS[case]
    model, steps = tiny_causal_lm("llama"), micro_batches(3, lengths)
    records = capture(model, steps, tmp_path, projection=projection, keep_tokens=keep_tokens)
    reader = StoreReader(tmp_path)
    assert reader.steps == [0, 1, 2] and reader.num_examples == 15

    written: set[str] = set()
    for record in records:
        kinds = stored_kinds(tmp_path, record)
        assert kinds.keys() == record.layers.keys()
        for name, layer in record.layers.items():
            assert kinds[name] in allowed_kinds(layer.grads, keep_tokens), (name, record.index)
        written |= set(kinds.values())
    assert written == MUST_WRITE[case]
    # some cases also read layers whose form changes within a chunk (one step)
    first, second = (stored_kinds(tmp_path, r) for r in records[:2])
    assert any(first[n] != second[n] for n in first) == (case in MIXED_WITHIN_A_STEP)

    captured = records_materialized(records)
    everything = reader.load_all()
    ids, step_of, grads = read_chunks(reader, max_examples=5)  # 3 + 2 examples per chunk
    assert torch.equal(ids, expected_ids(steps)) and torch.equal(everything.example_ids, ids)
    assert torch.equal(step_of, expected_steps(steps)) and torch.equal(everything.steps, step_of)
    assert list(grads) == list(captured) == reader.layer_names
    for name, expected in captured.items():
        assert torch.equal(grads[name], expected), name
        assert torch.equal(everything.layers[name].materialize(), expected), name

    if projection is None:
        # Every captured Llama module has one parameter, `weight`, in the stored layout.
        names = [f"{layer}.weight" for layer in reader.layer_names]
        oracle = flat_oracle_grads(model, all_batches(steps), names)
        stored = torch.cat([grads[n] for n in reader.layer_names], dim=1)
        assert max_rel_error({"all": stored}, {"all": oracle}) < ORACLE_TOL


def test_keep_tokens_reads_back_per_token_factors(tmp_path: Path) -> None:
    """With ``keep_tokens`` a long sequence keeps its per-token factors, so token-level
    scores stay possible; without it the same layers are compacted to dense gradients."""
    model, steps = tiny_causal_lm("llama"), micro_batches(1, (20, 20))
    capture(model, steps, tmp_path / "tokens", keep_tokens=True)
    capture(model, steps, tmp_path / "compact")
    q_proj = "model.layers.0.self_attn.q_proj"
    kept = StoreReader(tmp_path / "tokens").load_all().layers[q_proj]
    compacted = StoreReader(tmp_path / "compact").load_all().layers[q_proj]
    assert isinstance(kept, TokenFactors) and kept.tokens == 20
    assert isinstance(compacted, DenseGrad)
    assert torch.equal(kept.materialize(), compacted.materialize())


def test_layers_fed_by_one_input_store_it_once(tmp_path: Path) -> None:
    """q/k/v read one normalized hidden state, and gate/up another: each such input factor
    is one tensor in the shard, the other layers name it as an alias, and the shard is
    smaller than the same tensors written separately. Read back, the layers share it
    again."""
    model = tiny_causal_lm("llama")
    records = capture(model, micro_batches(1, (10, 7)), tmp_path, keep_tokens=True)
    shard = rank_dir(tmp_path, 0) / shard_name(0, 0)
    with safe_open(shard, "pt") as f:
        keys = set(f.keys())
        metadata = f.metadata()
        full = {k: f.get_tensor(k) for k in keys}
    aliases = json.loads(metadata["aliases"])
    expected = {}
    for block in range(2):
        attn, mlp = f"model.layers.{block}.self_attn", f"model.layers.{block}.mlp"
        expected[f"{attn}.k_proj::a"] = expected[f"{attn}.v_proj::a"] = f"{attn}.q_proj::a"
        expected[f"{mlp}.up_proj::a"] = f"{mlp}.gate_proj::a"
    assert aliases == expected
    assert not keys & aliases.keys() and set(aliases.values()) <= keys
    full.update({alias: full[target].clone() for alias, target in aliases.items()})
    separate = len(save(full, metadata=metadata))
    assert separate - shard.stat().st_size >= sum(full[alias].nbytes for alias in aliases)
    first = records[0].layers
    read = StoreReader(tmp_path).load_all().layers  # two shards: one chunk buffer per tensor
    for alias, target in aliases.items():
        layer = alias.split("::")[0]
        assert torch.equal(read[layer].materialize()[:3], first[layer].grads.materialize())
        shared = cast(TokenFactors, read[target.split("::")[0]]).a
        assert cast(TokenFactors, read[layer]).a is shared  # read once, as captured


def test_layer_sizes_from_the_header_add_up_to_the_shard_tensors(tmp_path: Path) -> None:
    """``layer_nbytes`` (from a shard's header, without reading its tensors) gives each
    layer's bytes per example; over the shard's examples they add up to its tensors, a
    shared input counted with its first layer only."""
    model = tiny_causal_lm("llama")
    capture(model, micro_batches(1, (10, 7)), tmp_path, keep_tokens=True)
    reader = StoreReader(tmp_path)
    sizes = reader.layer_nbytes()
    with safe_open(rank_dir(tmp_path, 0) / shard_name(0, 0), "pt") as f:
        keys = set(f.keys()) - {"example_ids"}
        stored = {k: f.get_tensor(k).nbytes for k in keys}
        examples = f.get_tensor("example_ids").numel()
    assert sorted(sizes) == sorted(reader.layer_names)
    assert sum(sizes.values()) * examples == sum(stored.values())
    q_proj = "model.layers.0.self_attn.q_proj"
    k_proj = "model.layers.0.self_attn.k_proj"
    assert sizes[q_proj] * examples == stored[f"{q_proj}::a"] + stored[f"{q_proj}::g"]
    assert sizes[k_proj] * examples == stored[f"{k_proj}::g"]


class TokenAndChannelMixer(nn.Module):
    """MLP-Mixer style: one linear mixes a ``(B, T, N)`` input over channels, another over
    tokens (applied to its transpose). With ``T == N`` the transposed view has the input's
    address, shape and dtype, but other values."""

    def __init__(self, width: int):
        super().__init__()
        self.channels = nn.Linear(width, width, bias=False)
        self.tokens = nn.Linear(width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        mixed = self.channels(x) + self.tokens(x.transpose(1, 2)).transpose(1, 2)
        return mixed.pow(2).sum(dim=(1, 2))


def test_a_transposed_view_of_an_input_is_not_stored_as_an_alias(tmp_path: Path) -> None:
    """The input dedupe must share only identical tensors: a view with the same address,
    shape and dtype but other strides holds other values and reads back as itself."""
    torch.manual_seed(0)
    model = TokenAndChannelMixer(4).double()
    collector = RecordCollector()
    store = GradientStore(tmp_path, keep_tokens=True)
    with CaptureEngine(
        model, layers=LayerSelection("linear"), consumers=[store, collector]
    ) as engine:
        engine.set_example_ids(torch.arange(2))
        model(torch.randn(2, 4, 4, dtype=torch.float64)).sum().backward()
        engine.optimizer_step()
    read = StoreReader(tmp_path).load_all().layers
    captured = records_materialized(collector.records)
    assert not torch.equal(captured["tokens"], captured["channels"])
    for name in ("channels", "tokens"):
        assert torch.equal(read[name].materialize(), captured[name]), name


# -- 2. crash safety ---------------------------------------------------------------------


def start_worker(
    zygote: Zygote, store: Path, checkpoints: Path, pause: tuple[int, int], stderr: IO[str]
) -> Worker:
    """``tests/store_worker.py`` in a worker process that stops at ``pause``."""
    argv = [str(store), str(checkpoints), "--pause", *map(str, pause)]
    return zygote.popen("tests.store_worker:main", argv, stderr=stderr.fileno())


def wait_for_line(proc: Worker, expected: str, log: Path, timeout: float = 120) -> None:
    """Block until the worker prints ``expected`` (fail with its stderr if it dies first)."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if not ready:
            break
        line = proc.stdout.readline()
        if line.strip() == expected:
            return
        if not line:
            pytest.fail(f"worker exited ({proc.wait()}) before {expected!r}:\n{log.read_text()}")
    pytest.fail(f"worker did not print {expected!r} in {timeout} s:\n{log.read_text()}")


def shard_files(root: Path, rank: int = 0) -> set[str]:
    return {p.name for p in rank_dir(root, rank).glob("*.safetensors")}


def indexed_files(root: Path, rank: int = 0) -> set[str]:
    index = json.loads((rank_dir(root, rank) / "index.json").read_text())
    return {entry["file"] for entry in index["shards"]}


@pytest.mark.slow
def test_sigkill_between_micro_batches_loses_only_that_step_and_resume_is_exact(
    tmp_path: Path, zygote: Zygote
) -> None:
    """A run killed (SIGKILL) after two of the three micro-batches of step 2 (their shards
    written or being written, unlisted) reopens with exactly steps 0 and 1; reattaching
    removes the orphaned shards (and a half-written temp file) without touching committed
    ones; resuming from the checkpoint at step 2
    (``resume_at_step``) ends with a store whose GradDot scores are bit-identical to an
    uninterrupted run's."""
    killed, checkpoints, log = tmp_path / "killed", tmp_path / "killed-ckpt", tmp_path / "log"
    with log.open("w") as stderr, start_worker(zygote, killed, checkpoints, (2, 1), stderr) as proc:
        try:
            wait_for_line(proc, "paused", log)
            # the first shard of step 2 is written (the second waited for its write);
            # the second's background write may still be running when the kill lands
            orphans = shard_files(killed) - indexed_files(killed)
            assert shard_name(2, 6) in orphans <= {shard_name(2, 6), shard_name(2, 7)}
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()

    per_step = store_worker.MICRO_BATCHES * 2
    reader = StoreReader(killed)
    assert reader.steps == [0, 1] and reader.num_examples == 2 * per_step
    half_written = rank_dir(killed, 0) / f".{shard_name(2, 8)}.tmp-4242"
    half_written.write_bytes(b"a write cut short by the kill")
    # the temporary file safetensors writes a shard into, before renaming it to ours
    in_safetensors = rank_dir(killed, 0) / ".tmp6NfWdN"
    in_safetensors.write_bytes(b"a shard cut short inside save_file")
    committed = {f: (rank_dir(killed, 0) / f).read_bytes() for f in indexed_files(killed)}
    with CaptureEngine(tiny_causal_lm("llama"), consumers=[GradientStore(killed, append=True)]):
        pass
    assert shard_files(killed) == set(committed) and not half_written.exists()
    assert not in_safetensors.exists()
    assert {f: (rank_dir(killed, 0) / f).read_bytes() for f in committed} == committed

    assert store_worker.latest_checkpoint(checkpoints) == 2
    store_worker.train(killed, checkpoints)
    store_worker.train(tmp_path / "straight", tmp_path / "straight-ckpt")
    resumed, straight = StoreReader(killed), StoreReader(tmp_path / "straight")
    assert resumed.steps == straight.steps == list(range(store_worker.STEPS))

    query_model = tiny_causal_lm("llama", seed=1)
    capture(query_model, [[lm_batch(2, 8, seed=99)]], tmp_path / "queries", LayerSelection())
    queries = StoreReader(tmp_path / "queries")
    got, expected = graddot(resumed, queries, 5), graddot(straight, queries, 5)
    assert got.values.shape == (store_worker.STEPS * per_step, 2)
    assert expected.values.abs().min() > 0
    assert torch.equal(got.train_ids, expected.train_ids)
    assert torch.equal(got.values, expected.values)


class DiskLog:
    """Stands in for the store's disk work: logs each finished shard write, fsync and
    index write in the order they happen (from either thread). Shard writes and fsyncs
    can be held until released (at most 10 s: a writer that waits for held disk work
    fails the test, not hangs it), fsyncs slowed by ``delay`` seconds, or failed for a
    shard (``fail_shards``)."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, delay: float = 0.0, fail_shards: bool = False
    ):
        self.events: list[tuple[str, str]] = []
        self.release = threading.Event()
        self.release.set()
        real_write, real_index = medium.write_renamed, writer.write_index

        def fsync(path: Path) -> None:
            self.release.wait(timeout=10)
            time.sleep(delay)
            if fail_shards and path.suffix == ".safetensors":
                raise OSError(28, "No space left on device")
            self.events.append(("fsync", path.name))

        def write(path: Path, fill: Callable[[Path], object]) -> None:
            self.release.wait(timeout=10)
            real_write(path, fill)
            self.events.append(("write", path.name))

        def publish(path: Path, entries: list[ShardEntry], *, durable: bool = True) -> None:
            self.events.append(("index", ",".join(e.file for e in entries)))
            real_index(path, entries, durable=durable)

        monkeypatch.setattr(writer, "fsync_path", fsync)
        monkeypatch.setattr(medium, "write_renamed", write)
        monkeypatch.setattr(writer, "write_index", publish)

    def position(self, event: tuple[str, str]) -> int:
        return self.events.index(event)

    def returned(self, call: str, *, release_after: float | None = None) -> None:
        """Log that the test's own ``call`` returned; ``release_after``: let the held disk
        work go that many seconds later (timed from here, so a slow machine cannot let
        the disk go before ``call`` has returned)."""
        self.events.append(("returned", call))
        if release_after is not None:
            threading.Timer(release_after, self.release.set).start()


def test_a_step_is_committed_without_waiting_for_the_disk_and_published_once_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the disk held, the micro-batch and its commit return (the shard's write and
    fsyncs wait on the background thread): the shard is not written and no index lists
    it; once released, ``flush`` returns with the shard written, fsynced, then its
    folder, then the index listing it."""
    disk = DiskLog(monkeypatch)
    disk.release.clear()
    model = tiny_causal_lm("llama")
    store = GradientStore(tmp_path)
    with CaptureEngine(model, consumers=[store]) as engine:
        summed_loss(model, lm_batch(2, 8, seed=0)).backward()
        engine.optimizer_step()  # returns although the shard's write is held
        assert store.committed_steps == [0]
        assert disk.events == []  # nothing written yet
        assert not (rank_dir(tmp_path, 0) / "index.json").exists()
        disk.release.set()
        store.flush()
        shard = shard_name(0, 0)
        assert indexed_files(tmp_path) == {shard}
        assert disk.events == [
            ("write", shard),
            ("fsync", shard),
            ("fsync", rank_dir(tmp_path, 0).name),
            ("index", shard),
        ]


def test_the_next_step_starts_writing_only_after_the_last_commit_is_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's shards follow the previous commit: the first shard of step n + 1 is
    written after the index that publishes step n, and each index lists only shards
    fsynced before it."""
    disk = DiskLog(monkeypatch, delay=0.2)  # the disk slower than the tiny model's steps
    steps = [[lm_batch(2, 8, seed=10 * s + m) for m in range(2)] for s in range(3)]
    capture(tiny_causal_lm("llama"), steps, tmp_path, LayerSelection())
    indexes = [i for i, (kind, _) in enumerate(disk.events) if kind == "index"]
    assert len(indexes) == 3
    for step in range(3):
        listed = disk.events[indexes[step]][1].split(",")
        assert all(disk.position(("fsync", f)) < indexes[step] for f in listed)
        if step:
            assert disk.position(("write", shard_name(step, 2 * step))) > indexes[step - 1]
    assert StoreReader(tmp_path).steps == [0, 1, 2]


def test_a_micro_batch_waits_for_the_previous_shards_write_so_one_is_held_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background write holds a shard's tensors until it runs; the next micro-batch
    of the step waits for that write before queuing its own, so a slow disk holds one
    earlier micro-batch's gradients at most (the disk is released here 0.3 s after the
    first micro-batch has returned)."""
    disk = DiskLog(monkeypatch)
    disk.release.clear()
    model = tiny_causal_lm("llama")
    store = GradientStore(tmp_path)
    with CaptureEngine(model, consumers=[store]) as engine:
        summed_loss(model, lm_batch(2, 8, seed=0)).backward()  # queued, write held
        disk.returned("micro-batch 0", release_after=0.3)
        summed_loss(model, lm_batch(2, 8, seed=1)).backward()
        disk.returned("micro-batch 1")
        engine.optimizer_step()
        engine.end()
    first = ("write", shard_name(0, 0))
    assert disk.position(("returned", "micro-batch 0")) < disk.position(first)
    assert disk.position(first) < disk.position(("returned", "micro-batch 1"))
    assert indexed_files(tmp_path) == {shard_name(0, 0), shard_name(0, 1)}


@pytest.mark.parametrize("budget", [2**30, 0])
def test_queued_shards_wait_for_the_disk_only_past_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    """With ``in_flight_bytes`` (one-pass captures) micro-batches go on while earlier shards
    wait for a held disk, as long as their bytes stay within the budget (1 GiB: all three
    return before any write); past it the next one waits for the oldest (0: the second
    waits for the first shard's write). Everything is listed once the disk is released."""
    disk = DiskLog(monkeypatch)
    disk.release.clear()
    model = tiny_causal_lm("llama")
    store = GradientStore(tmp_path, in_flight_bytes=budget)
    # the disk is released once all three have returned (within the budget), or 0.3 s
    # after the first (past it: the second must wait for that)
    release = {2: 0.0} if budget else {0: 0.3}
    with CaptureEngine(model, consumers=[store]) as engine:
        for k in range(3):
            summed_loss(model, lm_batch(2, 8, seed=k)).backward()
            disk.returned(f"micro-batch {k}", release_after=release.get(k))
        engine.optimizer_step()
        engine.end()
    first = disk.position(("write", shard_name(0, 0)))
    if budget:
        assert disk.position(("returned", "micro-batch 2")) < first
    else:
        assert disk.position(("returned", "micro-batch 0")) < first
        assert first < disk.position(("returned", "micro-batch 1"))
    assert indexed_files(tmp_path) == {shard_name(0, k) for k in range(3)}


def test_a_failed_background_fsync_is_raised_and_nothing_after_it_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk error in a shard's fsync surfaces as a StoreError naming the store and the
    cause by the end of capture at the latest, and the index job queued after it (whose
    own fsync would succeed) does not run: no index lists that shard."""
    DiskLog(monkeypatch, fail_shards=True)
    failed = pytest.raises(StoreError, match=r"to disk failed in the background.*No space left")
    with failed as info:
        capture(tiny_causal_lm("llama"), [[lm_batch(2, 8, seed=0)]], tmp_path, LayerSelection())
    assert str(info.value).count("check the disk (free space") == 1  # the way out, once
    assert not (rank_dir(tmp_path, 0) / "index.json").exists()


def test_background_sync_stops_after_a_failure_and_reports_it_once_at_close() -> None:
    """After a failed job no later job runs; every wait raises the failure, and close
    raises it only when nothing reported it before (a detach after a failed end does not
    raise a second error)."""
    sync, ran = BackgroundSync("the test store"), []

    def fail() -> None:
        raise OSError(5, "Input/output error")

    sync.submit(fail)
    with pytest.raises(StoreError, match=r"the test store to disk failed.*Input/output"):
        sync.wait()
    with pytest.raises(StoreError, match="Input/output"):
        sync.submit(lambda: ran.append("after"))
    sync.close()  # already reported: no second error
    assert ran == []
    unreported = BackgroundSync("another store")
    unreported.submit(fail)
    with pytest.raises(StoreError, match="another store"):
        unreported.close()


def test_a_trainer_checkpoint_waits_until_every_committed_step_is_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CaptureSession.save_checkpoint`` (the trainer integrations' checkpoint hook)
    returns only once the steps committed so far are listed by the index on disk, so a
    checkpoint never runs ahead of the store."""
    disk = DiskLog(monkeypatch, delay=0.2)
    model = tiny_causal_lm("llama")
    session = CaptureSession(
        CaptureSettings.from_options(store_dir=str(tmp_path), curvature=False),
        model=model,
        normalization=SummedLoss(),
    )
    for step in range(2):
        summed_loss(model, lm_batch(2, 8, seed=step)).backward()
        session.step()
        model.zero_grad(set_to_none=True)
    session.save_checkpoint(2)
    assert indexed_files(tmp_path) == {shard_name(0, 0), shard_name(1, 1)}
    assert disk.events[-1] == ("index", f"{shard_name(0, 0)},{shard_name(1, 1)}")
    session.end()


def test_a_finished_trainer_step_is_on_disk_before_the_next_one_begins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CaptureSession.finish_step`` (the trainer callbacks' end-of-step hook) returns
    once that step's commit is on disk: an exception raised before the next step's
    first backward (which ends no capture) still leaves the step readable."""
    disk = DiskLog(monkeypatch, delay=0.2)
    model = tiny_causal_lm("llama")
    session = CaptureSession(
        CaptureSettings.from_options(store_dir=str(tmp_path), curvature=False),
        model=model,
        normalization=SummedLoss(),
    )
    summed_loss(model, lm_batch(2, 8, seed=0)).backward()
    session.step()
    session.finish_step()
    assert StoreReader(tmp_path).steps == [0]
    assert disk.events[-1] == ("index", shard_name(0, 0))
    session.end()


# -- 3. refusals -------------------------------------------------------------------------


CONFIG_MISMATCHES = {
    "layers": (LayerSelection("linear"), None, "layers differ"),
    "projection": (ALL, ProjectionConfig("factor", k_a=8, k_g=8), "projection differs"),
}


@pytest.mark.parametrize("mismatch", list(CONFIG_MISMATCHES))
def test_reopening_with_another_capture_config_is_refused(mismatch: str, tmp_path: Path) -> None:
    """Appending to a store with other layers or another projection fails with an error
    naming what differs, and leaves every file of the store as it was."""
    layers, projection, cause = CONFIG_MISMATCHES[mismatch]
    model = tiny_causal_lm("llama")
    capture(model, micro_batches(1, (10, 7)), tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(StoreError, match=f"another config or model: {cause}"):
        capture(model, micro_batches(1, (10, 7), seed=5), tmp_path, layers, projection)
    assert snapshot(tmp_path) == before


def test_a_store_of_another_format_version_is_refused(tmp_path: Path) -> None:
    """Reading or appending to a store whose ``store.json`` names another format version
    fails with an error naming both versions, and changes nothing."""
    model = tiny_causal_lm("llama")
    capture(model, micro_batches(1, (10, 7)), tmp_path)
    header_path = tmp_path / "store.json"
    header = json.loads(header_path.read_text())
    header["format_version"] = FORMAT_VERSION + 1
    header_path.write_text(json.dumps(header))
    before = snapshot(tmp_path)
    cause = f"store format {FORMAT_VERSION + 1}, this tda-plugins reads format {FORMAT_VERSION}"
    with pytest.raises(StoreError, match=cause):
        StoreReader(tmp_path)
    with pytest.raises(StoreError, match=cause):
        capture(model, micro_batches(1, (10, 7), seed=5), tmp_path)
    assert snapshot(tmp_path) == before


def test_reading_a_missing_store_names_the_command_that_writes_one(tmp_path: Path) -> None:
    """A directory without a store points the user at ``tda capture``."""
    with pytest.raises(StoreError, match=r"no gradient store .* `tda capture`"):
        StoreReader(tmp_path / "missing")


# -- 4. bad input ------------------------------------------------------------------------


def test_scoring_with_an_empty_store_fails_clearly(tmp_path: Path) -> None:
    """A capture of zero batches commits no step: scoring against such queries, or such a
    training store, is an error that says the store is empty."""
    model = tiny_causal_lm("llama")
    capture(model, micro_batches(1, (10, 7)), tmp_path / "train")
    capture(model, [], tmp_path / "empty")
    train, empty = StoreReader(tmp_path / "train"), StoreReader(tmp_path / "empty")
    assert empty.num_examples == 0 and empty.steps == []
    with pytest.raises(StoreError, match=r"query store .* holds no example; capture queries"):
        graddot(train, empty)
    with pytest.raises(StoreError, match="holds no committed step"):
        graddot(empty, train)


QUERY_MISMATCHES = {
    "layers the store holds": (
        LayerSelection("linear"),
        None,
        r"the queries lack layers the store holds",
    ),
    "projection": CONFIG_MISMATCHES["projection"],
}


@pytest.mark.parametrize("mismatch", list(QUERY_MISMATCHES))
def test_queries_captured_with_another_config_are_refused(mismatch: str, tmp_path: Path) -> None:
    """Queries that lack some of the store's layers, or are captured with another
    projection, cannot be scored against it; the error names what differs."""
    layers, projection, cause = QUERY_MISMATCHES[mismatch]
    model = tiny_causal_lm("llama")
    capture(model, micro_batches(1, (10, 7)), tmp_path / "train")
    capture(model, [[lm_batch(2, 8, seed=99)]], tmp_path / "queries", layers, projection)
    train, queries = StoreReader(tmp_path / "train"), StoreReader(tmp_path / "queries")
    with pytest.raises(StoreError, match=rf"do not match the store .*: {cause}"):
        graddot(train, queries)


def test_nan_gradients_stop_the_capture_and_keep_every_committed_step(tmp_path: Path) -> None:
    """After two good steps and one good micro-batch of step 2, a NaN weight makes the next
    micro-batch raise a StoreError naming non-finite gradients and the step; the store
    still reads exactly steps 0 and 1, with their files byte for byte unchanged."""
    model, steps = tiny_causal_lm("llama"), micro_batches(3, (10, 7))
    store = GradientStore(tmp_path)
    with CaptureEngine(model, layers=ALL, consumers=[store]) as engine:
        for step in steps[:2]:
            for batch in step:
                summed_loss(model, batch).backward()
            engine.optimizer_step()
        store.flush()  # read while attached: the last commit on disk first
        before = snapshot(tmp_path)
        good = StoreReader(tmp_path).load_all()
        summed_loss(model, steps[2][0]).backward()
        with torch.no_grad():
            model.lm_head.weight[0, 0] = float("nan")
        with pytest.raises(StoreError, match=r"non-finite gradients .* at step 2"):
            summed_loss(model, steps[2][1]).backward()
    reader = StoreReader(tmp_path)
    assert reader.steps == [0, 1]
    after = snapshot(tmp_path)
    assert {name: after.get(name) for name in before} == before
    read = reader.load_all()
    assert torch.equal(read.example_ids, good.example_ids)
    assert torch.equal(read.example_ids, expected_ids(steps[:2]))
    for name, grads in good.layers.items():
        assert torch.equal(read.layers[name].materialize(), grads.materialize()), name


class _Poison(CaptureConsumer):
    """Sets one entry of one layer's captured tensor to ``value`` before the store sees it."""

    def __init__(self, layer: str, value: float, last: bool):
        self.layer, self.value, self.last = layer, value, last

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        grads = record.layers[self.layer].grads
        assert isinstance(grads, TokenFactors)
        flat = grads.g.view(-1)
        flat[flat.numel() - 1 if self.last else 0] = self.value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("last", [False, True])
def test_one_non_finite_entry_anywhere_refuses_the_micro_batch_and_names_its_layer(
    tmp_path: Path, dtype: torch.dtype, value: float, last: bool
) -> None:
    """A single NaN or +-inf entry, at the first or the last position of one layer's
    gradient (every other entry finite), is refused with the layer's name; nothing of that
    micro-batch is written."""
    model = tiny_causal_lm("llama", dtype)
    layer = "model.layers.1.mlp.down_proj"
    consumers = [_Poison(layer, value, last), GradientStore(tmp_path)]
    refused = pytest.raises(StoreError, match=rf"non-finite .* in layer '{layer}' at step 0")
    with CaptureEngine(model, layers=ALL, consumers=consumers), refused:
        summed_loss(model, micro_batches(1, (10, 7))[0][0]).backward()
    assert shard_files(tmp_path) == set()
    assert not list(rank_dir(tmp_path, 0).glob(".*tmp*"))


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    """A writer that fails half-way leaves ``path`` as it was and no temp file beside it."""
    path = tmp_path / "shard.safetensors"
    path.write_bytes(b"old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["shard.safetensors"]


def test_a_failed_write_names_its_file_and_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk, a file-size limit or an I/O error while writing surfaces as the OS
    error it is (its type and errno, which callers that handle one rely on), naming the
    file and what to do, not a bare ``[Errno 5]`` or numpy's short-write message."""
    import errno
    import os

    from tda_plugins.store import io as store_io
    from tda_plugins.store.shardfile import write_streamed

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(store_io.os, "fsync", failing_fsync)
    path = tmp_path / "store.json"
    with pytest.raises(OSError) as info:
        atomic_write(path, lambda tmp: tmp.write_bytes(b"{}"))
    assert info.value.errno == errno.EIO  # its temp file beside it, .store.json.tmp-<pid>
    assert f"writing {tmp_path}/.store.json.tmp-" in str(info.value)
    assert "check the disk (free space, the file-size limit" in str(info.value)
    monkeypatch.setattr(store_io.os, "fsync", os.fsync)

    def short_write() -> Iterator[torch.Tensor]:
        raise OSError("8192 requested and 3160 written")  # numpy's tofile on a full disk
        yield torch.zeros(2)

    shard = tmp_path / "factors.safetensors"
    with pytest.raises(OSError, match=r"writing .*factors.safetensors failed \(8192 requested"):
        write_streamed(shard, [("a", torch.float32, (2,))], short_write(), {})


def test_truncate_drops_later_steps_and_their_files(tmp_path: Path) -> None:
    """``truncate(2)`` on an attached store of four steps leaves steps 0 and 1 with their
    files untouched, and deletes the shard files of steps 2 and 3."""
    model, steps = tiny_causal_lm("llama"), micro_batches(4, (10, 7))
    capture(model, steps, tmp_path)
    kept = {n for n in shard_files(tmp_path) if n.startswith(("s00000000", "s00000001"))}
    assert len(kept) == 4 and len(shard_files(tmp_path)) == 8
    before = {n: b for n, b in snapshot(tmp_path).items() if Path(n).name in kept}
    store = GradientStore(tmp_path, append=True)
    with CaptureEngine(model, layers=ALL, consumers=[store]):
        store.truncate(2)
        assert store.committed_steps == [0, 1]
    reader = StoreReader(tmp_path)
    assert reader.steps == [0, 1]
    assert shard_files(tmp_path) == kept == indexed_files(tmp_path)
    assert {n: b for n, b in snapshot(tmp_path).items() if n in before} == before
    assert torch.equal(reader.load_all().example_ids, expected_ids(steps[:2]))


def test_truncate_before_attaching_never_loses_earlier_steps(tmp_path: Path) -> None:
    """A resume script may truncate a store right after opening it: ``truncate(1)`` must
    either refuse (StoreError) or drop only steps >= 1; step 0 always survives."""
    model, steps = tiny_causal_lm("llama"), micro_batches(3, (10, 7))
    capture(model, steps, tmp_path)
    with contextlib.suppress(StoreError):
        GradientStore(tmp_path).truncate(1)
    reader = StoreReader(tmp_path)
    assert reader.steps in ([0], [0, 1, 2])
    assert torch.equal(reader.load_all().example_ids[:5], expected_ids(steps[:1]))


def test_a_new_run_on_a_store_never_overwrites_committed_steps(tmp_path: Path) -> None:
    """A second run attached to a store without ``resume_at_step`` numbers its steps from
    0 again: it must be refused or add to the store, never overwrite a committed shard
    (every earlier example stays, exactly once)."""
    model = tiny_causal_lm("llama")
    first = micro_batches(2, (10, 7))
    capture(model, first, tmp_path)
    before = {n: b for n, b in snapshot(tmp_path).items() if n.endswith(".safetensors")}
    with contextlib.suppress(StoreError):
        capture(model, micro_batches(1, (10, 7), seed=50), tmp_path)
    after = snapshot(tmp_path)
    assert {name: after.get(name) for name in before} == before
    ids = StoreReader(tmp_path).load_all().example_ids.tolist()
    assert all(ids.count(i) == 1 for i in expected_ids(first).tolist())


# -- 5. several ranks --------------------------------------------------------------------


def test_two_ranks_read_as_one_store_that_scores_like_a_single_rank(tmp_path: Path) -> None:
    """Ranks 0 and 1 write disjoint micro-batches of each step into one root (rank 1
    first); the reader merges them ordered by (step, rank, micro-batch), and GradDot
    scores equal those of one rank that captured the same examples."""
    model, steps = tiny_causal_lm("llama"), micro_batches(3, (10, 7))
    capture(model, steps, tmp_path / "single")
    merged = tmp_path / "merged"
    capture(model, [[step[1]] for step in steps], merged, rank=1)
    capture(model, [[step[0]] for step in steps], merged, rank=0)
    assert sorted(p.name for p in merged.iterdir()) == ["rank-0", "rank-1", "store.json"]
    reader = StoreReader(merged)
    assert reader.steps == [0, 1, 2] and reader.num_examples == 15
    # Each step: rank 0's 3 examples, then rank 1's 2, the order of the single-rank store.
    everything = reader.load_all()
    assert torch.equal(everything.example_ids, expected_ids(steps))
    assert torch.equal(everything.steps, expected_steps(steps))

    capture(model, [[lm_batch(2, 8, seed=99)]], tmp_path / "queries")
    queries = StoreReader(tmp_path / "queries")
    single_ids, single = by_train_id(graddot(StoreReader(tmp_path / "single"), queries, 5))
    merged_ids, scores = by_train_id(graddot(reader, queries, 5))
    assert torch.equal(merged_ids, single_ids) and len(set(merged_ids.tolist())) == 15
    assert scores.abs().min() > 0
    assert torch.equal(scores, single)
