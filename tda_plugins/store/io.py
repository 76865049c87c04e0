"""Crash-safe file writes: temp file, fsync, rename, then fsync of the directory.

A reader sees either the old file or the complete new one, never a partial write.
:func:`write_renamed` is the first half alone (temp file, rename, no fsync), for files
that only become part of something once a later, durable write lists them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: What to do about a failed write, said in every error :func:`writing` raises.
DISK_FIX = (
    "check the disk (free space, the file-size limit, permissions) and run again: a "
    "training run resumes from its last checkpoint, tda capture --append adds the "
    "examples not yet stored"
)


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Name ``path`` and :data:`DISK_FIX` in an ``OSError`` raised while writing it (a full
    disk, a file-size limit, a read-only or failing disk), keeping its type and errno so
    that callers which handle one (a cache left unwritten) still do."""
    try:
        yield
    except OSError as error:
        if getattr(error, "named_path", None) is not None:
            raise  # named by an inner write already
        cause = error.strerror or str(error)
        message = f"writing {path} failed ({cause}); {DISK_FIX}"
        named = type(error)(error.errno, message) if error.errno else OSError(message)
        named.named_path = path  # type: ignore[attr-defined]
        raise named from error


def fsync_path(path: Path) -> None:
    """Wait until ``path`` (a file, or a directory's entries) is on disk."""
    with writing(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _written(path: Path, write: Callable[[Path], object], durable: bool) -> None:
    """``write`` into a temp file beside ``path`` (fsynced if ``durable``), renamed over
    ``path``; a failed ``write`` leaves no temp file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(path):
        try:
            write(tmp)
            if durable:
                fsync_path(tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Create ``path`` through ``write(temp_path)`` so that a crash leaves either nothing
    new or all of it: ``write`` fills a temp file beside ``path``, which is fsynced and
    renamed over ``path`` (a failed ``write`` leaves no temp file)."""
    _written(path, write, durable=True)
    fsync_path(path.parent)


def write_renamed(path: Path, write: Callable[[Path], object]) -> None:
    """:func:`atomic_write` without its fsyncs: ``path`` appears complete or not at all
    while the system runs, but a crash may leave it partial. For files that a later
    durable write publishes only after :func:`fsync_path` of them and of their folder."""
    _written(path, write, durable=False)


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> None:
    """:func:`atomic_write` of ``data``; ``durable=False``: through :func:`write_renamed`,
    without the fsyncs."""
    if durable:
        atomic_write(path, lambda tmp: tmp.write_bytes(data))
    else:
        write_renamed(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_json(path: Path, value: Any, *, durable: bool = True) -> None:
    """:func:`atomic_write_bytes` of ``value`` as indented JSON (strict: NaN/inf are an
    error, not the non-JSON tokens ``json`` would write)."""
    data = (json.dumps(value, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()
    atomic_write_bytes(path, data, durable=durable)


def read_json(path: Path) -> Any:
    """Parse a JSON file, with an error that names the file when it is unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc


def refuse_existing(target: Path, force: bool, inputs: Iterable[str | Path] = ()) -> None:
    """Refuse to replace an existing non-empty ``target`` unless ``force``, and always one
    that is or holds one of the command's ``inputs`` (which replacing it would delete);
    check that its folder can be written. Run before any work, so a bad ``--out`` costs
    nothing."""
    out = target.resolve()
    for given in inputs:
        path = Path(given).resolve()
        if path == out or out in path.parents:
            raise FileExistsError(
                f"{target} holds {given}, an input of this command, which writing the output "
                "there would delete: choose another output"
            )
    if target.exists() and not force and (target.is_file() or any(target.iterdir())):
        raise FileExistsError(f"{target} exists; choose another output or pass --force")
    parent = target.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write into {parent} (for {target}): no such writable folder")


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """A fresh temporary folder beside ``target`` to fill; on success it replaces
    ``target`` (an existing one is removed first), on failure it is removed, so ``target``
    is never left half-written. The folder gets the permissions of any new folder (the
    process's umask), not ``mkdtemp``'s owner-only ones."""
    stage = target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    os.replace(stage, target)
    fsync_path(target.parent)
