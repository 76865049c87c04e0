"""Reading a gradient store: a merged view over every rank, streamed in bounded chunks.

Everything read from disk is checked before it is used: each rank's index entries
(:mod:`~tda_plugins.store.index`), each shard's checksum (once per reader, on first read),
its example ids against its index entry, and its gradients for NaN/inf (named by example
id). A damaged or crafted store is a :class:`StoreError`, never a wrong score.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.blocks import TensorKey, tensor_key
from tda_plugins.store.chunks import ShardContents, read_chunk
from tda_plugins.store.fingerprint import (
    WeightsDigest,
    fingerprint_differences,
    weights_differences,
)
from tda_plugins.store.index import read_index
from tda_plugins.store.io import read_json
from tda_plugins.store.layout import (
    END_FILE,
    INDEX_FILE,
    LOSS_TOKENS,
    SHARD_PLACE,
    StoreError,
    loss_tokens_differ,
    rank_dir,
    read_store_header,
    shard_place,
)
from tda_plugins.store.memory import IN_MEMORY, medium_for, not_in_this_process
from tda_plugins.store.texts import StoreTexts, TokenTexts, read_texts, read_token_texts
from tda_plugins.utils.finite import first_non_finite

logger = logging.getLogger(__name__)


@dataclass
class StoreChunk:
    """Per-example gradients of a run of consecutive stored examples.

    Attributes:
        example_ids: ``(N,)`` int64 ids.
        steps: ``(N,)`` int64 optimizer step each example was captured at.
        layers: layer name -> per-example gradients (``N`` examples), in store order.
    """

    example_ids: Tensor
    steps: Tensor
    layers: dict[str, PerExampleGrad]

    @property
    def size(self) -> int:
        return int(self.example_ids.shape[0])


@dataclass(frozen=True)
class _Shard:
    path: Path
    step: int
    rank: int
    micro_batch: int
    example_ids: tuple[int, ...]
    xxh3: str

    @property
    def size(self) -> int:
        return len(self.example_ids)


def _rank_of(folder: Path) -> int | None:
    """The rank of a ``rank-<r>`` folder (``None``: not a folder of ranks). A name the
    writer never gives (``rank-00``, ``rank-²``) that holds an index is refused: read as a
    rank, a copied folder would count its examples twice."""
    suffix = folder.name.split("-", 1)[1]
    if not folder.is_dir():
        return None
    if (
        suffix.isascii()
        and suffix.isdigit()
        and folder.name == rank_dir(folder.parent, int(suffix)).name
    ):
        return int(suffix)
    if (folder / INDEX_FILE).exists():
        raise StoreError(
            f"{folder} holds an index but is not a rank folder the store writes "
            "(rank-0, rank-1, ...): a copied or renamed folder; remove it"
        )
    return None


def rank_folders(root: Path) -> list[tuple[int, Path]]:
    """Every ``rank-<r>`` folder of the store ``root``, as ``(r, folder)`` in name order."""
    folders = ((_rank_of(folder), folder) for folder in sorted(root.glob("rank-*")))
    return [(rank, folder) for rank, folder in folders if rank is not None]


def committed_steps(root: Path) -> dict[int, list[int]]:
    """Rank -> the optimizer steps its folder of the store ``root`` has committed (sorted,
    distinct; ranks without a committed step left out)."""
    steps = {r: sorted({e.step for e in read_index(f / INDEX_FILE)}) for r, f in rank_folders(root)}
    return {rank: held for rank, held in steps.items() if held}


def _check_end(folder: Path, steps: list[int], loss_tokens: object) -> None:
    """Refuse a rank whose index is not the one its capture ended with (``end.json``:
    its last step and, since it was recorded, its number of shards): an index cut short
    or edited after the capture would be scored as a smaller store. Refuse one whose
    capture carried its rows' loss on other tokens than the store records (a rank folder
    of another capture)."""
    path = folder / END_FILE
    if not path.exists():
        return
    try:
        end = read_json(path)
        last, count = end.get("last_step"), end.get("shards")
        ended_with = end.get(LOSS_TOKENS)
    except (ValueError, AttributeError) as error:
        raise StoreError(f"{path} is damaged ({error!r}); recapture") from error
    if loss_tokens_differ(ended_with, loss_tokens):
        raise StoreError(
            f"{folder} was captured with its rows' loss on {ended_with}, but the store "
            f"records {loss_tokens}: a rank folder of another capture; recapture"
        )
    found_last = max(steps, default=None)
    if (last is not None and last != found_last) or (count is not None and count != len(steps)):
        raise StoreError(
            f"{folder / INDEX_FILE} lists {len(steps)} shards up to step {found_last}, but the "
            f"capture ended with {count if count is not None else 'its'} shards up to step "
            f"{last} ({path}): the index was edited or cut short; recapture"
        )


class StoreReader:
    """Read-only, merged view of a store written by one or more ranks.

    Shards are ordered by (step, rank, micro-batch). Reading never loads more than one
    chunk of ``max_examples`` examples at a time, so stores larger than RAM can be scored.
    A store in a :func:`~tda_plugins.store.memory_store`'s folder is read from this
    process's memory, the same way.
    """

    def __init__(self, path: str | Path):
        self.root = Path(path)
        header = read_store_header(self.root)
        self._medium = medium_for(self.root)
        if header.metadata.get(IN_MEMORY) and self._medium.on_disk:
            raise not_in_this_process(self.root)
        self.config, self.metadata = header.config, header.metadata
        #: What produced the store (see :mod:`~tda_plugins.store.fingerprint`), if known.
        self.fingerprint = header.fingerprint
        self._shards = self._list_shards()
        self._verified: set[Path] = set()

    @property
    def on_disk(self) -> bool:
        """Whether the store's shards are files (``False``: a memory store's, gone with
        the process that holds them)."""
        return self._medium.on_disk

    def _committed(self) -> list[_Shard]:
        """The committed shards, refusing a store that has none."""
        if not self._shards:
            raise StoreError(f"the store {self.root} holds no committed step")
        return self._shards

    def _list_shards(self) -> list[_Shard]:
        shards = []
        for rank, folder in rank_folders(self.root):
            entries = read_index(folder / INDEX_FILE)
            _check_end(folder, [e.step for e in entries], self.metadata.get(LOSS_TOKENS))
            shards += [
                _Shard(e.path(folder), e.step, rank, e.micro_batch, e.example_ids, e.xxh3)
                for e in entries
            ]
        return sorted(shards, key=lambda s: (s.step, s.rank, s.micro_batch))

    def rows_digest(self) -> str:
        """A digest of the committed rows (their shards' checksums, in store order): two
        readers with equal digests hold the same rows."""
        checksums = "".join(f"{s.path.name}:{s.xxh3};" for s in self._committed())
        return hashlib.sha256(checksums.encode()).hexdigest()[:32]

    def end_weights(self) -> WeightsDigest | None:
        """The digest of the captured weights when the capture ended (every rank's must
        agree), or ``None`` if a rank's capture did not end (a crashed run)."""
        folders = {self.root / f"rank-{s.rank}" for s in self._shards}
        digests = {}
        for folder in sorted(folders):
            path = folder / END_FILE
            if not path.exists():
                return None
            try:
                end = read_json(path)
                layers = end.get("layer_weights_xxh3", {})  # absent: written before it was
                base = end.get("base_weights_xxh3")  # absent: written before it was
                digest = WeightsDigest(
                    str(end["weights_sha256"]),
                    {str(k): str(v) for k, v in layers.items()},
                    None if base is None else str(base),
                    tuple(str(d) for d in end.get("weights_dtypes", ())),
                )
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise StoreError(f"{path} is damaged ({error!r}); recapture") from error
            digests[(digest.whole, tuple(sorted(digest.layers.items())))] = digest
        if len(digests) > 1:
            raise StoreError(f"the ranks of {self.root} ended at different weights; recapture")
        return next(iter(digests.values()), None)

    @property
    def layer_names(self) -> list[str]:
        return list(self.config.layers)

    @property
    def num_examples(self) -> int:
        return sum(s.size for s in self._shards)

    @property
    def steps(self) -> list[int]:
        """Distinct committed optimizer steps, ascending."""
        return sorted({s.step for s in self._shards})

    def step_example_ids(self) -> dict[int, list[int]]:
        """Committed step -> its example ids in store order (from the indexes alone)."""
        out: dict[int, list[int]] = {}
        for shard in self._shards:
            out.setdefault(shard.step, []).extend(shard.example_ids)
        return out

    def at_step(self, step: int) -> StoreReader:
        """A view of this store holding optimizer step ``step`` alone (its chunks are read
        exactly as :meth:`iter_chunks` reads them)."""
        view = copy.copy(self)
        view._shards = [s for s in self._shards if s.step == step]
        return view

    def require_compatible(self, other: StoreReader, allow_mismatch: bool = False) -> None:
        """Raise unless ``other`` (queries) was captured with the same layers, projection
        and loss (always required: the gradients could not be paired otherwise) and, when
        both stores know their model, from the same one: configuration, tokenizer, and the
        weights this store's capture ended at. ``allow_mismatch`` accepts another model
        (scores are then computed, but they attribute a model the run did not end with)."""
        differences = self.config.query_differences(other.config)
        if differences:
            raise StoreError(
                f"queries in {other.root} do not match the store {self.root}: "
                f"{'; '.join(differences)}. Capture the queries with the store's options"
            )
        extra = self.config.extra_query_layers(other.config)
        if extra:
            logger.warning(
                "tda-plugins: the queries in %s hold %d layer(s) the store %s does not (%s): "
                "scores cover the store's %d layers",
                other.root,
                len(extra),
                self.root,
                ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else ""),
                len(self.config.layers),
            )
        self._committed()
        ours, theirs = self.end_weights(), other.end_weights()  # each store's ranks agree
        if allow_mismatch:
            partial = [str(s.root) for s, end in ((self, ours), (other, theirs)) if end is None]
            if partial:
                logger.warning(
                    "tda-plugins: scoring %s, whose capture did not finish (allow_mismatch): "
                    "its rows are the steps it committed, not every example it was given",
                    " and ".join(partial),
                )
            return
        if self.fingerprint is None or other.fingerprint is None:
            return  # a store written without its model (GradientStore(model=None)) says nothing
        differences = fingerprint_differences(self.fingerprint, other.fingerprint)
        if ours is None or theirs is None:
            unfinished = self.root if ours is None else other.root
            differences.append(
                f"{unfinished} has no end-of-capture weights (its capture did not finish), so "
                "the queries' weights cannot be checked against the training run's"
            )
        else:
            same = list(other.config.layers) == list(self.config.layers)
            layers = None if same else self.layer_names  # else compared layer by layer
            differences += weights_differences(ours, theirs, layers)
        if differences:
            raise StoreError(
                f"queries in {other.root} come from another model than the store {self.root}: "
                f"{'; '.join(differences)}. Capture the queries with the trained model, or "
                "pass --allow-mismatch (allow_mismatch=True) to score them anyway"
            )

    def token_texts(self, ids: Collection[int] | None = None) -> dict[int, TokenTexts]:
        """Example id -> its tokens, where the capture kept per-token factors and a
        tokenizer (else empty); only the examples ``ids`` names, when given."""
        return read_token_texts(self.root, ids)

    def texts(self, ids: Collection[int] | None = None) -> dict[int, str]:
        """Example id -> text, where the capture saved texts (else empty); only the
        examples ``ids`` names, when given."""
        return read_texts(self.root, ids)

    def lazy_texts(self) -> StoreTexts:
        """The texts as a mapping read when used (a report reads the few it shows)."""
        return StoreTexts(self.root)

    def iter_chunks(
        self, max_examples: int = 256, layers: list[str] | None = None
    ) -> Iterator[StoreChunk]:
        """Consecutive chunks of at most ``max_examples`` examples (whole micro-batches;
        a micro-batch larger than the limit is its own chunk)."""
        shards = self._committed()
        layers = list(self.config.layers) if layers is None else layers
        group: list[_Shard] = []
        for shard in shards:
            if group and sum(s.size for s in group) + shard.size > max_examples:
                yield self._chunk(group, layers)
                group = []
            group.append(shard)
        yield self._chunk(group, layers)

    def _chunk(self, shards: list[_Shard], layers: list[str]) -> StoreChunk:
        for shard in shards:
            self._verify(shard)
        ids, grads = read_chunk(self._medium, [shard.path for shard in shards], layers)
        expected = [i for shard in shards for i in shard.example_ids]
        if ids.tolist() != expected:
            raise StoreError(
                f"the shards {shards[0].path.name}..{shards[-1].path.name} hold other "
                "examples than their index lists; the store is damaged: recapture"
            )
        steps = torch.cat([torch.full((shard.size,), shard.step) for shard in shards])
        chunk = StoreChunk(ids, steps, grads)
        _require_finite(chunk)
        return chunk

    def _verify(self, shard: _Shard) -> None:
        """Check a shard against its checksum and the place it was written at (its rank,
        step and micro-batch, in its header since they were recorded), once per reader."""
        if shard.path in self._verified:
            return
        self._medium.verify(shard.path, shard.xxh3, damaged="the store is damaged: recapture")
        with self._medium.open(shard.path) as f:
            written = f.metadata.get(SHARD_PLACE)
        listed = shard_place(shard.rank, shard.step, shard.micro_batch)
        if written is not None and written != listed:
            raise StoreError(
                f"{shard.path} was written as {written}, but its index lists it as {listed}: "
                "a shard or rank folder copied into the store; remove the copy or recapture"
            )
        self._verified.add(shard.path)

    def load_all(self, layers: list[str] | None = None) -> StoreChunk:
        """Every stored example in one chunk (for query sets), of ``layers`` (default
        all)."""
        return next(self.iter_chunks(max_examples=max(self.num_examples, 1), layers=layers))

    def layer_nbytes(self) -> dict[str, int]:
        """Layer name -> stored bytes per example (a tensor shared by several layers
        counted with the first), read from the first shard's header only."""
        contents = ShardContents.read(self._medium, self._committed()[0].path, self.layer_names)
        return {
            name: -(-sum(t.nbytes for t in entry.fields.values() if not t.shared) // contents.rows)
            for name, entry in contents.layers.items()
        }

    def values_dtype(self) -> torch.dtype:
        """The accumulation dtype of the stored gradients (as :func:`values_dtype` of a
        loaded one): fp64 when any stored gradient tensor is fp64, else fp32; read from
        the first shard's header only."""
        contents = ShardContents.read(self._medium, self._committed()[0].path, self.layer_names)
        dtypes = {t.dtype for layer in contents.layers.values() for t in layer.fields.values()}
        return torch.float64 if torch.float64 in dtypes else torch.float32


def _require_finite(chunk: StoreChunk) -> None:
    """Refuse a chunk holding NaN/inf, naming the first example that does: one pass over
    each tensor (an input shared by several layers once) and one host sync when all is
    finite (:func:`~tda_plugins.utils.finite.first_non_finite`)."""
    tensors: dict[TensorKey, tuple[str, Tensor]] = {}
    for name, grads in chunk.layers.items():

        def keep(t: Tensor, name: str = name) -> Tensor:
            return tensors.setdefault(tensor_key(t), (name, t))[1]

        grads.map_tensors(keep)
    found = list(tensors.values())
    bad = first_non_finite([t for _, t in found])
    if bad is None:
        return
    name, t = found[bad]
    rows = (~t.isfinite()).reshape(t.shape[0], -1).any(dim=1)
    example = int(chunk.example_ids[int(rows.nonzero()[0])])
    raise StoreError(
        f"the stored gradient of example {example} in layer {name!r} holds NaN/inf; "
        "the store is damaged: recapture it (capture refuses non-finite gradients)"
    )
