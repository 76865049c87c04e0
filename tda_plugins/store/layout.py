"""On-disk layout of a gradient store, shared by the writer and the reader.

```
STORE/
  store.json                 format version and the capture config (CaptureConfig)
  examples.jsonl             optional: {"id": ..., "text": ...} per example, for reports
  rank-<r>/examples.jsonl    optional: the same, appended by a training run step by step
  rank-<r>/index.json        committed shards of rank r, in order
  rank-<r>/s<step>-m<mb>.safetensors   one micro-batch: example ids + each layer's grads
  rank-<r>/curvature.safetensors       optional: inline K-FAC statistics of rank r
  rank-<r>/end.json          written when rank r's capture ended: its weights' digest
  rank-<r>/.writer.lock      the writer's lock (holder pid and host)
  fit-cache/                 optional: K-FAC/EK-FAC factorizations of the statistics
                             (:mod:`~tda_plugins.precondition.fit_cache`)
```

Only shards listed in an index are part of the store; a shard file without an index
entry is a step that never completed and is removed when the store is reopened.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tda_plugins.capture.config import CaptureConfig
from tda_plugins.store.io import read_json

#: 2: shard checksums in the index, the fingerprint in store.json, end.json per rank.
FORMAT_VERSION = 2
STORE_FILE = "store.json"
INDEX_FILE = "index.json"
EXAMPLES_FILE = "examples.jsonl"
CURVATURE_FILE = "curvature.safetensors"
END_FILE = "end.json"
#: The ``store.json`` metadata entry naming which tokens of the stored rows carry their loss
#: (:class:`~tda_plugins.integrations.transformers.data.LossTokens`); an append must agree.
LOSS_TOKENS = "loss_tokens"
#: The ``store.json`` metadata entry of a store a training run wrote (true): each step's
#: rows are gradients at that step's weights, not at the weights the run ended with.
TRAINED = "trained"


#: ``loss_tokens`` entries that say how long rows were cut, not which tokens carry the
#: loss: rows cut at other lengths may share a store (each keeps its own tokens).
CUT_ENTRIES = frozenset({"max_length", "keep_end"})


def loss_tokens_differ(stored: object, ours: object) -> bool:
    """Whether two ``loss_tokens`` entries disagree on a switch both record (a store
    written before a switch was recorded compares without it; the cut is no switch)."""
    if not isinstance(stored, dict) or not isinstance(ours, dict):
        return False
    return any(stored[key] != ours[key] for key in (stored.keys() & ours.keys()) - CUT_ENTRIES)


#: The only names a shard file may have (``shard_name``).
SHARD_PATTERN = re.compile(r"s\d{8}-m\d{6}\.safetensors")


class StoreError(ValueError):
    """A gradient store is missing, of another format or config, or asked for bad data."""


def rank_dir(root: Path, rank: int) -> Path:
    return root / f"rank-{rank}"


#: The shard header's metadata entry naming where it was written (:func:`shard_place`).
SHARD_PLACE = "place"


def shard_place(rank: int, step: int, micro_batch: int) -> str:
    """Where a shard belongs, as its header records it: a shard copied to another rank
    folder or listed as another step does not match its index entry."""
    return f"rank {rank} step {step} micro-batch {micro_batch}"


def shard_name(step: int, micro_batch: int) -> str:
    return f"s{step:08d}-m{micro_batch:06d}.safetensors"


@dataclass(frozen=True)
class StoreHeader:
    """``store.json``: the capture config, the model fingerprint (``None`` when the
    capture knew no model) and free-form metadata."""

    config: CaptureConfig
    fingerprint: dict[str, Any] | None
    metadata: dict[str, Any]


def read_store_header(root: Path) -> StoreHeader:
    """The store's header; refuses other formats and damaged headers."""
    path = root / STORE_FILE
    if not path.exists():
        raise StoreError(
            f"no gradient store at {root} (missing {STORE_FILE}); write one with "
            "`tda capture` or a GradientStore consumer"
        )
    try:
        header = read_json(path)
    except ValueError as error:
        raise StoreError(f"{error}; the store header is damaged: recapture") from error
    version = header.get("format_version") if isinstance(header, dict) else None
    if version != FORMAT_VERSION:
        raise StoreError(
            f"{root} was written with store format {version}, this tda-plugins reads format "
            f"{FORMAT_VERSION}; recapture it with this version"
        )
    try:
        config = CaptureConfig.from_json(header["config"])
    except (KeyError, TypeError, ValueError) as error:
        raise StoreError(f"{path} has a damaged capture config ({error!r}); recapture") from error
    return StoreHeader(config, header.get("fingerprint"), header.get("metadata", {}))
