"""On-disk layout of a gradient store, shared by the writer and the reader.

```
STORE/
  store.json                 format version and the capture config (CaptureConfig)
  examples.jsonl             optional: {"id": ..., "text": ...} per example, for reports
  rank-<r>/index.json        committed shards of rank r, in order
  rank-<r>/s<step>-m<mb>.safetensors   one micro-batch: example ids + each layer's grads
  rank-<r>/curvature.safetensors       optional: inline K-FAC statistics of rank r
```

Only shards listed in an index are part of the store; a shard file without an index
entry is a step that never completed and is removed when the store is reopened.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tda_plugins.capture.config import CaptureConfig
from tda_plugins.store.io import read_json

FORMAT_VERSION = 1
STORE_FILE = "store.json"
INDEX_FILE = "index.json"
EXAMPLES_FILE = "examples.jsonl"
CURVATURE_FILE = "curvature.safetensors"


class StoreError(ValueError):
    """A gradient store is missing, of another format or config, or asked for bad data."""


def rank_dir(root: Path, rank: int) -> Path:
    return root / f"rank-{rank}"


def shard_name(step: int, micro_batch: int) -> str:
    return f"s{step:08d}-m{micro_batch:06d}.safetensors"


def read_header(root: Path) -> tuple[CaptureConfig, dict[str, Any]]:
    """The store's capture config and its free-form metadata; refuses other formats."""
    path = root / STORE_FILE
    if not path.exists():
        raise StoreError(
            f"no gradient store at {root} (missing {STORE_FILE}); write one with "
            "`tda capture` or a GradientStore consumer"
        )
    header = read_json(path)
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise StoreError(
            f"{root} was written with store format {version}, this tda-plugins reads format "
            f"{FORMAT_VERSION}; recapture it with this version"
        )
    return CaptureConfig.from_json(header["config"]), header.get("metadata", {})
