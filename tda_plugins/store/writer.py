"""GradientStore: the consumer that writes each micro-batch's per-example gradients to disk.

Writes are crash-safe at optimizer-step granularity: each micro-batch goes to its own
shard file, and a step becomes visible only when the rank's index is rewritten
atomically after its shards are on disk. A crash at any moment leaves every durably
committed step readable and no partial one visible.

The disk work (each shard's write and fsync, the folder's fsync and the index write) runs
on a background thread (:class:`~tda_plugins.store.sync.BackgroundSync`), overlapping the
next micro-batch's forward and backward: a commit is durable shortly after
:meth:`GradientStore.commit` returns. The jobs run in order, so a step's shards are
written only once the previous commit is on disk. The shard's tensors are held until
written, and each shard waits for the previous one's write (with it, every earlier
job), so at most one micro-batch's gradients are held beside the one being captured,
and at most one committed step is not yet on disk. :meth:`GradientStore.flush`,
the end of capture, the engine's detach, :meth:`~GradientStore.truncate` and a trainer
checkpoint (:meth:`~tda_plugins.session.capture.CaptureSession.save_checkpoint`) wait for all of
it; the trainer callbacks also wait at the end of each step
(:meth:`~tda_plugins.session.capture.CaptureSession.finish_step`), after the optimizer update.
A crash can therefore lose the last committed step along with the one in progress; a
reader opened while the writer is attached may not see the latest commit yet. A one-pass
capture (``tda capture``, :func:`~tda_plugins.session.dataset.capture_examples`) lets
shards queue for the disk instead (``in_flight_bytes``): the next micro-batch waits only
once that many bytes are not yet written, so a disk slower than the capture stalls it
only when the queue is full.

Durability (``durability``, :data:`DURABILITY`): ``"step"`` (the default, for training)
fsyncs each shard and the folder before its step is listed, as above. ``"end"`` (one-pass
captures: ``tda capture``, :func:`~tda_plugins.session.dataset.capture_examples`) writes
shards, index and end marker to the page cache only; once the capture has ended, one pass
on a thread of its own (:class:`~tda_plugins.store.sync.EndSync`) fsyncs them all and the
store's header, then the folders, while the caller goes on; example texts saved after
the end are fsynced the same way. No fsync is on the caller's path: on ext4 an fsync
waits for the journal, which waits for whatever that end sync is writing back, so one
on the caller's path (a second store's header, say) would wait for the whole first
store. A store scored right after its capture is read from the page cache. The
interpreter waits for these syncs at exit, and :meth:`GradientStore.flush` waits for
them. ``"none"`` never fsyncs
(scratch stores). Either way a step is listed only after its shards are completely
written and checksummed, so a crashed *process* leaves every listed step readable; a
crashed *machine* before the end sync may leave a listed shard torn, which the reader's
checksum refuses ("the store is damaged: recapture") -- never a silently half-written
store.

Memory stores: under a :func:`~tda_plugins.store.memory.memory_store` folder the shards
are not files but copies of the captured tensors, kept in this process
(:class:`~tda_plugins.store.memory.MemoryShards`, through the same
:class:`~tda_plugins.store.medium.ShardMedium` interface as files); nothing is fsynced
(``durability`` is ``"none"``: nothing of it outlives the process), and only rank 0 may
write one.

Integrity: each writer holds an exclusive lock on its rank directory for its lifetime
(:class:`~tda_plugins.store.lock.WriterLock`), each shard's XXH3 checksum is listed in
the index (computed on the background thread after the shard's write) and verified by the
reader, and non-finite gradients are refused before anything is written. A store that
already holds steps is only added to with ``append=True``, and only by a capture with the
same layers, projection and model (:mod:`~tda_plugins.store.fingerprint`); every check
runs before anything on disk changes.

Loss convention: stored gradients are each example's own gradient of its *summed*
token loss (``record.loss_scale`` converts the trainer's mean loss).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tda_plugins.capture.config import CaptureConfig
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.store.codec import compact, encode
from tda_plugins.store.fingerprint import (
    fingerprint_differences,
    model_fingerprint,
    weights_digest,
)
from tda_plugins.store.index import ShardEntry, read_index, write_index
from tda_plugins.store.io import atomic_write_bytes, atomic_write_json, fsync_path
from tda_plugins.store.layout import (
    END_FILE,
    EXAMPLES_FILE,
    FORMAT_VERSION,
    INDEX_FILE,
    LOSS_TOKENS,
    SHARD_PLACE,
    STORE_FILE,
    StoreError,
    loss_tokens_differ,
    rank_dir,
    read_store_header,
    shard_name,
    shard_place,
)
from tda_plugins.store.lock import LOCK_FILE, WriterLock
from tda_plugins.store.memory import IN_MEMORY, medium_for, not_in_this_process
from tda_plugins.store.sync import (
    DURABILITY,
    BackgroundSync,
    EndSync,
    durability_mode,
    run_together,
    sync_later,
)
from tda_plugins.store.texts import TokenTexts, example_line
from tda_plugins.utils.finite import first_non_finite

#: Shard fsyncs in flight at once in the end sync (each waits on the disk, not the CPU).
_END_SYNC_THREADS = 8


@dataclass
class _Written:
    """A micro-batch whose shard is being written; ``digest`` is set by the write job."""

    file: str
    step: int
    micro_batch: int
    example_ids: tuple[int, ...]
    digest: str | None = None

    def entry(self) -> ShardEntry:
        if self.digest is None:
            raise StoreError(f"{self.file} was committed before its write finished")
        return ShardEntry(self.file, self.step, self.micro_batch, self.example_ids, self.digest)


class GradientStore(CaptureConsumer):
    """Writes captured per-example gradients to ``path`` (one directory per rank).

    Args:
        path: store directory; created if missing.
        rank: this process's rank; each rank writes its own ``rank-<r>/`` directory, and
            holds its writer lock (:mod:`~tda_plugins.store.lock`) from construction until
            the engine detaches it (or :meth:`close`).
        keep_tokens: keep per-token factors even where materialized gradients are
            smaller (needed for token-level scores); default stores the smaller form.
        metadata: free-form JSON facts saved with the store (model name, data file...).
        append: add to a rank directory that already holds committed steps (a resumed
            training run, ``tda capture --append``); without it such a directory is
            refused. Either way, a store captured with other layers, projection or model
            is refused.
        unique_ids: refuse an example id already in the store (one-pass captures, where a
            repeated id is a duplicated example); a training store (the default) accepts
            an id again at a later step (the next epoch), never twice in one step.
        model: the captured model, for the store's fingerprint (its configuration at the
            start, its captured weights at the end); ``None``: nothing to compare later.
        tokenizer: the tokenizer, for the fingerprint (optional).
        in_flight_bytes: ``None`` (training): a micro-batch waits until the previous
            one's shard is on disk, so one shard's tensors are held at most and at most
            one committed step is not yet durable. A number: shards queue for the disk
            until their tensors pass that many bytes (then the oldest is waited for).
        durability: ``"step"`` (default: each step durable once committed), ``"end"``
            (one fsync pass once the capture has ended, off its critical path: one-pass
            captures) or ``"none"`` (page cache only); see :data:`DURABILITY` and the
            module docstring for what a crash leaves.
    """

    def __init__(
        self,
        path: str | Path,
        rank: int = 0,
        *,
        keep_tokens: bool = False,
        metadata: dict[str, Any] | None = None,
        append: bool = False,
        unique_ids: bool = False,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        in_flight_bytes: int | None = None,
        durability: str = "step",
    ):
        mode = durability_mode(durability)
        self.root = Path(path)
        #: Where the shards go: files, or this process's memory (a memory store's folder).
        self._medium = medium_for(self.root)
        if not self._medium.on_disk and rank != 0:
            raise StoreError(
                f"rank {rank} cannot write to the memory store {self.root}: a memory store "
                "holds one process's gradients. Capture several ranks into a folder on disk"
            )
        # nothing of a memory store outlives its process, so there is nothing to fsync
        self.durability = mode if self._medium.on_disk else DURABILITY["none"]
        #: Shard files written without their fsync (for the end sync).
        self._unsynced: list[Path] = []
        if in_flight_bytes is not None and in_flight_bytes < 0:
            raise ValueError(f"in_flight_bytes must be >= 0 or None, got {in_flight_bytes}")
        self.in_flight_bytes = in_flight_bytes
        self.rank = rank
        self.keep_tokens = keep_tokens
        self.metadata = dict(metadata or {})
        self.append = append
        self.unique_ids = unique_ids
        self.model = model
        self.fingerprint = None if model is None else model_fingerprint(model, tokenizer)
        self._dir = rank_dir(self.root, rank)
        #: The folders this writer makes (innermost first), for :meth:`close_unwritten`.
        self._made = [p for p in (self._dir, self.root) if not p.exists()]
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock = WriterLock(self._dir)
        self._shards: list[ShardEntry] = read_index(self._dir / INDEX_FILE)
        self._steps = {s.step for s in self._shards}
        self._ids = {i for s in self._shards for i in s.example_ids} if unique_ids else set()
        self._step_ids: tuple[int, set[int]] = (-1, set())
        self._pending: list[_Written] = []
        self._sync = BackgroundSync(f"the gradient store {self.root}")
        #: ``"end"``: the fsyncs after the end of capture, running after it returned.
        self._end_syncs: list[EndSync] = []
        #: ``"end"``: this writer wrote the store's header, not yet fsynced.
        self._header_unsynced = False
        #: Shards not known to be on disk yet: their background write and tensor bytes.
        self._in_flight: deque[tuple[Future[None], int]] = deque()
        self._shards_lock = threading.Lock()  # _shards grows on the background thread
        self.config: CaptureConfig | None = None
        self._layers: dict[str, Any] = {}

    # -- consumer events ---------------------------------------------------------------

    def check_compatible(self, config: CaptureConfig) -> None:
        """Refuse, before anything on disk changes, a capture that may not write here:
        another config or model than the store's, or a rank directory with committed
        steps without ``append``."""
        if (self.root / STORE_FILE).exists():
            header = read_store_header(self.root)
            if header.metadata.get(IN_MEMORY) and self._medium.on_disk:
                raise not_in_this_process(self.root)
            differences = header.config.differences(config)
            if self.fingerprint is not None and header.fingerprint is not None:
                differences += fingerprint_differences(header.fingerprint, self.fingerprint)
            stored, ours = header.metadata.get(LOSS_TOKENS), self.metadata.get(LOSS_TOKENS)
            if loss_tokens_differ(stored, ours):
                differences.append(f"its rows carry their loss on {stored}, these on {ours}")
            if differences:
                raise StoreError(
                    f"{self.root} holds a store captured with another config or model: "
                    f"{'; '.join(differences)}; write to a new directory"
                )
        if self._shards and not self.append:
            steps = sorted(self._steps)
            raise StoreError(
                f"{self._dir} already holds steps {steps[0]}..{steps[-1]}; pass append=True "
                "(`tda capture --append`) to add to it, or write to a new directory"
            )

    def on_attach(self, config: CaptureConfig) -> None:
        self.check_compatible(config)
        end = self._dir / END_FILE
        if end.exists():  # an append: unfinished until its own end marker
            end.unlink()
            if self.durability.per_step:
                fsync_path(self._dir)
        if not (self.root / STORE_FILE).exists():
            header = {
                "format_version": FORMAT_VERSION,
                "config": config.to_json(),
                "fingerprint": self.fingerprint,
                "metadata": {
                    **self.metadata,
                    "keep_tokens": self.keep_tokens,
                    IN_MEMORY: not self._medium.on_disk,
                },
            }
            # "end": fsynced by the end sync
            atomic_write_json(self.root / STORE_FILE, header, durable=self.durability.per_step)
            self._header_unsynced = self.durability.deferred
        self.config = config
        self._remove_uncommitted()

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        if self._steps and record.step <= max(self._steps):
            raise StoreError(
                f"step {record.step} is already committed in {self.root} (last committed step: "
                f"{max(self._steps)}); continue with engine.resume_at_step({self.next_step}), "
                f"or truncate(from_step={record.step}) to redo it"
            )
        self._lock.check()
        ids = record.example_ids.tolist()
        self._check_ids(record.step, ids, record.content_ids)
        self._wait_for_room()
        cpu = record.to("cpu", non_blocking=False)
        tensors = {"example_ids": cpu.example_ids.contiguous()}
        layers: dict[str, Any] = {}
        # Layers fed by one tensor (q/k/v projections) share their input factor: it is
        # written once and the other keys point at it. The key is the exact view (storage,
        # offset, shape, strides), and every keyed tensor stays alive until the shard is
        # written, so a freed address can never be mistaken for another tensor.
        written: dict[tuple[Any, ...], str] = {}
        keyed: list[torch.Tensor] = []
        aliases: dict[str, str] = {}
        for name, grads in cpu.example_grads().items():
            kind, parts, attrs = encode(compact(grads, self.keep_tokens))
            for field, tensor in parts.items():
                key = f"{name}::{field}"
                keyed.append(tensor)
                identity = (
                    tensor.untyped_storage().data_ptr(),
                    tensor.storage_offset(),
                    tuple(tensor.shape),
                    tuple(tensor.stride()),
                    tensor.dtype,
                )
                if identity in written:
                    aliases[key] = written[identity]
                else:
                    written[identity] = key
                    tensors[key] = tensor.contiguous()
            layers[name] = {"kind": kind, "attrs": attrs, "fields": list(parts)}
        _require_finite(tensors, record.step)
        name = shard_name(record.step, record.index)
        metadata = {
            "layers": json.dumps(layers),
            "aliases": json.dumps(aliases),
            SHARD_PLACE: shard_place(self.rank, record.step, record.index),
        }
        # The shard is unlisted until its step's index write, which runs after its fsync
        # and checksum; the closure holds the tensors until then.
        path = self._dir / name
        shard = _Written(name, record.step, record.index, tuple(ids))

        def write() -> None:
            self._medium.save(path, tensors, metadata)
            if self.durability.per_step:
                fsync_path(path)
            elif self.durability.at_end:
                self._unsynced.append(path)
            shard.digest = self._medium.checksum(path)

        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._in_flight.append((self._sync.submit(write), nbytes))
        self._pending.append(shard)

    def _wait_for_room(self) -> None:
        """Before a micro-batch: wait for the oldest shards until at most the budget is in
        flight (none allowed by default: the previous shard is then on disk, and with it
        every earlier commit, as the jobs run in order)."""
        budget = self.in_flight_bytes or 0
        while self._in_flight and (
            self._in_flight[0][0].done()
            or self.in_flight_bytes is None
            or sum(n for _, n in self._in_flight) > budget
        ):
            self._sync.wait_for(self._in_flight.popleft()[0])

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        self.commit()

    def on_end(self) -> None:
        self.commit()
        if self.model is not None and self.config is not None:
            digest = weights_digest(self.model, self.config.layers)
            end = {
                "weights_sha256": digest.whole,
                "layer_weights_xxh3": digest.layers,
                "base_weights_xxh3": digest.base,
                "weights_dtypes": list(digest.dtypes),
                "last_step": max(self._steps, default=None),
                LOSS_TOKENS: self.metadata.get(LOSS_TOKENS),
            }
            durable = self.durability.per_step

            def write_end() -> None:  # after every commit queued before it
                with self._shards_lock:
                    end["shards"] = len(self._shards)  # what the index holds at the end
                atomic_write_json(self._dir / END_FILE, end, durable=durable)

            self._sync.submit(write_end)
        self._sync.close()  # every shard, the index and the end marker are written
        if self.durability.deferred:
            written, self._unsynced = self._unsynced, []
            header, self._header_unsynced = self._header_unsynced, False
            self._end_syncs.append(
                EndSync(
                    f"the gradient store {self.root}",
                    lambda: self._sync_written(written, header),
                )
            )

    def _sync_written(self, shards: list[Path], header: bool) -> None:
        """The end sync (its own thread, after the capture returned): the written
        ``shards`` (several at once), the index, the end marker and, if ``header``, the
        store's header; then the folders that name them."""
        files = [self._dir / INDEX_FILE, self._dir / END_FILE]
        files = shards + [f for f in files if f.exists()]
        folders = [self._dir]
        if header:
            files.append(self.root / STORE_FILE)
            folders.append(self.root)
        run_together(fsync_path, files, _END_SYNC_THREADS)  # the disk queues them together
        for folder in dict.fromkeys(folders):
            fsync_path(folder)

    def on_detach(self) -> None:
        try:
            self._sync.close()
        finally:
            self.close()

    def close(self) -> None:
        """Release the writer lock (after an end or a detach; idempotent)."""
        self._lock.release()

    def close_unwritten(self) -> None:
        """Release the writer lock and remove the folders this writer made, with its lock
        file, as long as nothing else was written there: a start refused before its first
        write leaves the store as it found it."""
        self.close()
        if self._dir in self._made:
            (self._dir / LOCK_FILE).unlink(missing_ok=True)
        for folder in self._made:
            with contextlib.suppress(OSError):  # not empty: something was written there
                folder.rmdir()

    # -- store operations --------------------------------------------------------------

    def commit(self) -> None:
        """Make every written micro-batch part of the store: one atomic index write, in
        the background once their shards are on disk with their checksums (:meth:`flush`
        waits for it)."""
        if not self._pending:
            return
        self._lock.check()
        pending, self._pending = self._pending, []
        self._steps.update(w.step for w in pending)

        def publish() -> None:  # the shards' writes, fsyncs and checksums ran before this
            with self._shards_lock:
                self._shards.extend(w.entry() for w in pending)
                shards = list(self._shards)
            if self.durability.per_step:
                fsync_path(self._dir)
            write_index(self._dir / INDEX_FILE, shards, durable=self.durability.per_step)

        self._sync.submit(publish)

    def flush(self) -> None:
        """Wait until every commit so far is on disk, and after the end of an ``"end"``
        capture until its end sync is done (raising a background failure)."""
        self._sync.wait()
        for end_sync in self._end_syncs:
            end_sync.wait()

    def truncate(self, from_step: int) -> None:
        """Drop every committed step ``>= from_step`` (resuming from an earlier checkpoint):
        the index first, then the dropped shards' files (names checked when the index was
        read, so only this rank's shard files are ever removed).

        K-FAC statistics saved beside the store are sums and are not rolled back.
        """
        self.flush()
        self._lock.check()
        with self._shards_lock:
            kept = [s for s in self._shards if s.step < from_step]
            dropped = [s for s in self._shards if s.step >= from_step]
            self._shards = kept
        write_index(self._dir / INDEX_FILE, kept)
        self._steps = {s.step for s in kept}
        for shard in dropped:
            self._medium.remove(shard.path(self._dir))

    @property
    def committed_steps(self) -> list[int]:
        """Distinct optimizer steps committed (their index write may still be running in
        the background: :meth:`flush` waits for it), ascending."""
        return sorted(self._steps)

    @property
    def next_step(self) -> int:
        """The first step number a run appending to this store may use."""
        return max(self._steps) + 1 if self._steps else 0

    def write_examples(
        self, texts: dict[int, str], tokens: dict[int, TokenTexts] | None = None
    ) -> None:
        """Save example texts (id -> text) for reports, and the tokens of those that
        ``tokens`` gives, merged with the lines already saved (fsynced before this returns
        under ``"step"`` durability, on a thread of its own under ``"end"``, never under
        ``"none"``)."""
        path = self.root / EXAMPLES_FILE
        known: dict[int, str] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                known[int(json.loads(line)["id"])] = line + "\n"
        pieces = tokens or {}
        known.update({i: example_line(i, t, pieces.get(i)) for i, t in texts.items()})
        data = "".join(known[i] for i in sorted(known)).encode()
        atomic_write_bytes(path, data, durable=self.durability.per_step)
        if self.durability.deferred:
            self._end_syncs.append(sync_later(f"the example texts of {self.root}", path, self.root))

    # -- checks and clean-up -----------------------------------------------------------

    def check_new_ids(self, ids: list[int]) -> None:
        """Refuse, before a one-pass capture writes anything, ids that repeat among
        ``ids`` or (with ``unique_ids``) are already stored."""
        seen: set[int] = set()
        for i in ids:
            if self.unique_ids and i in self._ids:
                already = sum(1 for j in ids if j in self._ids)
                raise StoreError(
                    f"{self.root} already holds example id {i} ({already} of the {len(ids)} "
                    "examples to append are in it: a capture appended to before, or resumed "
                    "after a crash): append only the examples it does not hold yet"
                )
            if i in seen:
                raise StoreError(_repeated_id(i, "this capture", self.root))
            seen.add(i)

    def _check_ids(self, step: int, ids: list[int], content: bool) -> None:
        """Refuse an id twice in one step, and with ``unique_ids`` an id already stored.
        A content hash (``content``) may repeat within a step: duplicated rows are one
        example trained twice, and its scores sum its rows."""
        if self._step_ids[0] != step:
            self._step_ids = (step, set())
        seen = self._step_ids[1]
        repeated = [i for i in ids if i in seen or (self.unique_ids and i in self._ids)]
        if len(set(ids)) != len(ids):
            repeated += [i for i in ids if ids.count(i) > 1]
        if repeated and not (content and not self.unique_ids):
            where = "this capture" if self.unique_ids else f"step {step}"
            raise StoreError(_repeated_id(repeated[0], where, self.root))
        seen.update(ids)
        if self.unique_ids:
            self._ids.update(ids)

    def _remove_uncommitted(self) -> None:
        """Remove what a crashed writer left: shards no index entry lists, and
        half-written temporary files (under the lock): ours (``.<name>.tmp-<pid>``), and
        the one ``safetensors`` writes a shard through (``.tmp`` and six characters)."""
        listed = {s.file for s in self._shards} | {w.file for w in self._pending}
        for path in self._medium.shard_paths(self._dir):
            if path.name not in listed:
                self._medium.remove(path)
        for path in self._dir.iterdir():
            name = path.name
            ours = name.startswith(".") and ".tmp-" in name
            if ours or _SAFETENSORS_TEMP.fullmatch(name):
                path.unlink()


#: The temporary file ``safetensors.save_file`` writes a shard into before renaming it to
#: the name it was given (Rust's ``tempfile`` default: ``.tmp`` and six characters).
_SAFETENSORS_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def _repeated_id(example_id: int, where: str, root: Path) -> str:
    return (
        f"example id {example_id} occurs twice in {where} of {root}: two examples under one "
        "id would be scored as one. Give each example its own id (a content hash collides "
        "for duplicated texts: give explicit ids, the 'id' of a JSONL line or, under a "
        "trainer, use_id_column); with explicit ids that are already unique, the sampler "
        "drew one row twice (sampling with replacement): sample without it, or let content "
        "hashes name the examples (an example drawn twice is then one trained twice)"
    )


def _require_finite(tensors: dict[str, torch.Tensor], step: int) -> None:
    """Refuse a micro-batch with NaN/inf anywhere in its gradients, with one host sync
    (:func:`~tda_plugins.utils.finite.first_non_finite`), naming the layer."""
    keys = list(tensors)
    bad = first_non_finite([tensors[k] for k in keys])
    if bad is None:
        return
    key = keys[bad]
    raise StoreError(
        f"non-finite gradients (NaN/inf) in layer {key.split('::')[0]!r} at step {step}; "
        "the step is not written and earlier steps are intact. "
        "Lower the learning rate or enable gradient clipping/loss scaling"
    )
