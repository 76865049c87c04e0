"""Crash-safe file writes: temp file, fsync, rename, then fsync of the directory.

A reader sees either the old file or the complete new one, never a partial write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either nothing new or all of it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, value: Any) -> None:
    """:func:`atomic_write_bytes` of ``value`` as indented JSON."""
    atomic_write_bytes(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any:
    """Parse a JSON file, with an error that names the file when it is unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
