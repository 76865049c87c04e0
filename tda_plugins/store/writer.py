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
checkpoint (:meth:`~tda_plugins.session.CaptureSession.save_checkpoint`) wait for all of
it; the trainer callbacks also wait at the end of each step
(:meth:`~tda_plugins.session.CaptureSession.finish_step`), after the optimizer update.
A crash can therefore lose the last committed step along with the one in progress; a
reader opened while the writer is attached may not see the latest commit yet.

Loss convention: stored gradients are each example's own gradient of its *summed*
token loss (``record.loss_scale`` converts the trainer's mean loss).
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tda_plugins.capture.config import CaptureConfig
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.store.codec import compact, encode
from tda_plugins.store.io import (
    atomic_write_bytes,
    atomic_write_json,
    fsync_path,
    read_json,
    write_renamed,
)
from tda_plugins.store.layout import (
    EXAMPLES_FILE,
    FORMAT_VERSION,
    INDEX_FILE,
    STORE_FILE,
    StoreError,
    rank_dir,
    read_header,
    shard_name,
)
from tda_plugins.store.sync import BackgroundSync


class GradientStore(CaptureConsumer):
    """Writes captured per-example gradients to ``path`` (one directory per rank).

    Args:
        path: store directory; created if missing, appended to if it holds a store with
            the same format and capture config (a resumed run), refused otherwise.
        rank: this process's rank; each rank writes its own ``rank-<r>/`` directory.
        keep_tokens: keep per-token factors even where materialized gradients are
            smaller (needed for token-level scores); default stores the smaller form.
        metadata: free-form JSON facts saved with the store (model name, data file...).
    """

    def __init__(
        self,
        path: str | Path,
        rank: int = 0,
        keep_tokens: bool = False,
        metadata: dict[str, Any] | None = None,
    ):
        self.root = Path(path)
        self.rank = rank
        self.keep_tokens = keep_tokens
        self.metadata = dict(metadata or {})
        self._dir = rank_dir(self.root, rank)
        self._shards: list[dict[str, Any]] = self._read_index()
        self._pending: list[dict[str, Any]] = []
        self._sync = BackgroundSync(f"the gradient store {self.root}")
        self._writing: Future[None] | None = None  # the last shard's background write
        self.config: CaptureConfig | None = None

    # -- consumer events ---------------------------------------------------------------

    def on_attach(self, config: CaptureConfig) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if (self.root / STORE_FILE).exists():
            existing, _ = read_header(self.root)
            differences = existing.differences(config)
            if differences:
                raise StoreError(
                    f"{self.root} holds a store captured with another config: "
                    f"{'; '.join(differences)}; write to a new directory"
                )
        else:
            header = {
                "format_version": FORMAT_VERSION,
                "config": config.to_json(),
                "metadata": {**self.metadata, "keep_tokens": self.keep_tokens},
            }
            atomic_write_json(self.root / STORE_FILE, header)
        self.config = config
        self._dir.mkdir(exist_ok=True)
        self._shards = self._read_index()
        self._remove_uncommitted()

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        if self.committed_steps and record.step <= self.committed_steps[-1]:
            raise StoreError(
                f"step {record.step} is already committed in {self.root} (last committed step: "
                f"{self.committed_steps[-1]}); continue with engine.resume_at_step("
                f"{self.next_step}), or truncate(from_step={record.step}) to redo it"
            )
        # hold at most one earlier micro-batch's tensors (the jobs run in order: once that
        # shard is written, every earlier commit is on disk too)
        self._sync.wait_for(self._writing)
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
        metadata = {"layers": json.dumps(layers), "aliases": json.dumps(aliases)}
        # safetensors writes the tensors straight into the file (no serialized copy),
        # releasing the GIL. The shard is unlisted until its step's index write, which
        # runs after its fsync; the closure holds the tensors until then.
        path = self._dir / name

        def write() -> None:
            write_renamed(path, lambda tmp: save_file(tensors, tmp, metadata))
            fsync_path(path)

        self._writing = self._sync.submit(write)
        self._pending.append(
            {
                "file": name,
                "step": record.step,
                "micro_batch": record.index,
                "example_ids": cpu.example_ids.tolist(),
            }
        )

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        self.commit()

    def on_end(self) -> None:
        self.commit()
        self._sync.close()

    def on_detach(self) -> None:
        self._sync.close()

    # -- store operations --------------------------------------------------------------

    def commit(self) -> None:
        """Make every written micro-batch part of the store: one atomic index write, in
        the background once their shards are on disk (:meth:`flush` waits for it)."""
        if not self._pending:
            return
        self._shards.extend(self._pending)
        self._pending = []
        shards, folder = list(self._shards), self._dir

        def publish() -> None:  # the shards' fsyncs ran before this job
            fsync_path(folder)
            self._write_index(shards)

        self._sync.submit(publish)

    def flush(self) -> None:
        """Wait until every commit so far is on disk (raising a background failure)."""
        self._sync.wait()

    def truncate(self, from_step: int) -> None:
        """Drop every committed step ``>= from_step`` (resuming from an earlier checkpoint).

        K-FAC statistics saved beside the store are sums and are not rolled back.
        """
        self.flush()
        kept = [s for s in self._shards if s["step"] < from_step]
        dropped = [s for s in self._shards if s["step"] >= from_step]
        self._shards = kept
        self._write_index(kept)
        for shard in dropped:
            (self._dir / shard["file"]).unlink(missing_ok=True)

    @property
    def committed_steps(self) -> list[int]:
        """Distinct optimizer steps whose shards are committed, ascending."""
        return sorted({s["step"] for s in self._shards})

    @property
    def next_step(self) -> int:
        """The first step number a run appending to this store may use."""
        steps = self.committed_steps
        return steps[-1] + 1 if steps else 0

    def write_examples(self, texts: dict[int, str]) -> None:
        """Save example texts (id -> text) for reports, merged with any already saved."""
        path = self.root / EXAMPLES_FILE
        known: dict[int, str] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                known[int(row["id"])] = row["text"]
        known.update(texts)
        lines = [json.dumps({"id": i, "text": t}) for i, t in sorted(known.items())]
        atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())

    # -- index -----------------------------------------------------------------------

    def _read_index(self) -> list[dict[str, Any]]:
        path = self._dir / INDEX_FILE
        return list(read_json(path)["shards"]) if path.exists() else []

    def _write_index(self, shards: list[dict[str, Any]]) -> None:
        atomic_write_json(self._dir / INDEX_FILE, {"shards": shards})

    def _remove_uncommitted(self) -> None:
        listed = {s["file"] for s in self._shards}
        for path in self._dir.iterdir():
            unlisted_shard = path.name.startswith("s") and path.suffix == ".safetensors"
            half_written = path.name.startswith(".") and ".tmp-" in path.name
            if (unlisted_shard and path.name not in listed) or half_written:
                path.unlink()


def _require_finite(tensors: dict[str, torch.Tensor], step: int) -> None:
    """Refuse a micro-batch with NaN/inf anywhere in its gradients, with one host sync.

    A tensor is finite exactly when its minimum and maximum are (both propagate NaN), and
    ``aminmax`` reads it once without the boolean copy of ``isfinite``. Only when the
    check fails is each tensor inspected, to name the layer.
    """
    floating = {k: t for k, t in tensors.items() if t.is_floating_point() and t.numel()}
    if not floating:
        return
    extremes = torch.cat([torch.stack(torch.aminmax(t)).double() for t in floating.values()])
    if bool(torch.isfinite(extremes).all()):
        return
    key = next(k for k, t in floating.items() if not bool(torch.isfinite(t).all()))
    raise StoreError(
        f"non-finite gradients (NaN/inf) in layer {key.split('::')[0]!r} at step {step}; "
        "the step is not written and earlier steps are intact. "
        "Lower the learning rate or enable gradient clipping/loss scaling"
    )
