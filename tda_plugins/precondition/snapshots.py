"""K-FAC statistics on disk: per-rank files, written streamed, read as a consistent set.

```
STORE/rank-<r>/curvature.safetensors                       at the end of capture
STORE/rank-<r>/curvature-before-step<n>.safetensors        at a trainer checkpoint
STORE/rank-<r>/curvature-commit-before-step<n>.safetensors every curvature_save_steps
```

Each file holds, for the layers rank ``r`` owns, the fp64 sums over token rows of the
steps before ``n`` (the end: every step): ``<layer>::A``, ``<layer>::S`` and
``<layer>::tokens`` ``(1,)``, with metadata ``format``, ``next_step``, ``rank``,
``world_size``, ``owners`` (layer -> rank, JSON), ``excluded`` (layer -> why it has no
statistics, JSON) and ``units`` (the groups of layers that share a tied weight, JSON). A
factor is ``(n, n)`` when kept dense, ``(n,)`` when diagonal and ``(0,)`` when the layer has
none (:mod:`~tda_plugins.precondition.forms`), so the shapes say each layer's forms. A file
is written streamed, layer by layer (never all of a rank's fp64 sums in memory at once),
into a temporary file that is fsynced and renamed.

A *set* is the files of one kind and step across ranks; it is complete when every rank
that wrote gradients (``index.json``) and every rank of the writers' world has its file.
Readers sum each layer over the files of a set: a layer is in one file (its owner's), or,
in stores written before ownership (files without ``format``), in every rank's file as
that rank's partial sums. They read the final set when it is complete, else the latest
complete snapshot (a run that crashed), so a store is attributable up to its last commit.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from tda_plugins.precondition.forms import FactorSpec
from tda_plugins.store.io import atomic_write, write_renamed
from tda_plugins.store.layout import (
    CURVATURE_FILE,
    END_FILE,
    INDEX_FILE,
    STORE_FILE,
    StoreError,
)
from tda_plugins.store.shardfile import write_streamed
from tda_plugins.utils.progress import end_of_run_bar

logger = logging.getLogger(__name__)

FORMAT = "tda-curvature/2"
_SNAPSHOT = re.compile(r"^curvature-(commit-)?before-step(\d+)\.safetensors$")
Kind = str  # "final", "checkpoint" or "commit"


@dataclass
class KroneckerFactors:
    """Uncentred second moments of one layer's factors.

    Attributes:
        a_sum: ``(N_i', N_i')`` sum of ``[a;1][a;1]^T`` over token rows (fp64 once read
            from a store; the accumulator's running part is fp32 for fp32/bf16 models);
            an embedding's ``(V,)`` token counts (the diagonal of its one-hot inputs'
            sum); ``(0,)`` for a layer with one factor (norm scales).
        g_sum: ``(N_o, N_o)`` sum of ``g g^T`` over token rows; a tied head's ``(V,)``
            diagonal of it; for norm scales, the sum over examples of ``dw dw^T``.
        tokens: number of token rows summed (fp64 scalar tensor).
    """

    a_sum: Tensor
    g_sum: Tensor
    tokens: Tensor

    @property
    def a_cov(self) -> Tensor:
        """``A = E[a a^T]`` over token rows, in fp64 (what the factorizations take)."""
        return self.a_sum.double() / self.tokens

    @property
    def g_cov(self) -> Tensor:
        """``S = E[g g^T]`` over token rows, in fp64."""
        return self.g_sum.double() / self.tokens

    def __add__(self, other: KroneckerFactors) -> KroneckerFactors:
        return KroneckerFactors(
            self.a_sum + other.a_sum, self.g_sum + other.g_sum, self.tokens + other.tokens
        )


def snapshot_path(rank_folder: Path, kind: Kind, next_step: int) -> Path:
    """Where rank ``rank_folder``'s statistics of ``kind`` covering steps ``< next_step`` go."""
    if kind == "final":
        return rank_folder / CURVATURE_FILE
    prefix = "commit-" if kind == "commit" else ""
    return rank_folder / f"curvature-{prefix}before-step{next_step}.safetensors"


def snapshot_step(path: Path) -> tuple[Kind, int] | None:
    """``(kind, next_step)`` of a snapshot file name, ``None`` for other files."""
    match = _SNAPSHOT.match(path.name)
    if match is None:
        return None
    return ("commit" if match.group(1) else "checkpoint"), int(match.group(2))


def write_statistics(
    path: Path,
    shapes: Mapping[str, FactorSpec | tuple[int, int]],
    totals: Callable[[str], KroneckerFactors],
    metadata: Mapping[str, str],
    *,
    durable: bool = True,
) -> None:
    """Write ``totals(layer)`` of every layer of ``shapes`` (a :class:`FactorSpec`, or
    ``(n_a, n_s)`` for dense factors) as fp64 safetensors, one layer in memory at a time
    (the header is known from the shapes, so each layer's bytes follow as it is
    computed); atomically, fsynced unless not ``durable``."""
    layer_shapes = {name: (*FactorSpec.of(spec).shapes(), (1,)) for name, spec in shapes.items()}
    entries = [
        (f"{name}::{side}", torch.float64, shape)
        for name, layer_shape in layer_shapes.items()
        for side, shape in zip(("A", "S", "tokens"), layer_shape, strict=True)
    ]

    def tensors() -> Iterator[Tensor]:
        for name in layer_shapes:
            stats = totals(name)
            for tensor in (stats.a_sum, stats.g_sum, stats.tokens.reshape(1)):
                yield tensor.detach().to("cpu", torch.float64)
            del stats

    def write(tmp: Path) -> None:
        total = sum(8 * prod(shape) for _, _, shape in entries)
        with end_of_run_bar(total, f"writing K-FAC statistics ({path.name})") as bar:
            write_streamed(tmp, entries, tensors(), {"format": FORMAT, **metadata}, bar.update)

    (atomic_write if durable else write_renamed)(path, write)


def link_statistics(source: Path, path: Path, *, durable: bool = True) -> None:
    """Publish the statistics file ``source`` again as ``path``, as :func:`write_statistics`
    publishes (atomically, fsynced if ``durable``): a hard link, the same bytes at no cost
    in time or disk (a copy where the filesystem has no hard links). For a set that holds
    exactly what ``source`` does (the end of a run whose last step a checkpoint saved)."""

    def write(tmp: Path) -> None:
        try:
            os.link(source, tmp)
        except OSError:  # no hard links here (some network and FUSE filesystems)
            shutil.copyfile(source, tmp)

    (atomic_write if durable else write_renamed)(path, write)


@dataclass(frozen=True)
class StatisticsSet:
    """The files of one consistent set of statistics (see the module docstring).

    Attributes:
        files: rank -> its file.
        next_step: the set covers steps ``< next_step`` (``None``: unknown, an old store).
        final: whether it is the end-of-capture set.
    """

    files: dict[int, Path]
    next_step: int | None
    final: bool

    def metadata(self) -> list[dict[str, str]]:
        out = []
        for path in self.files.values():
            with safe_open(path, framework="pt") as f:
                out.append(f.metadata() or {})
        return out

    @property
    def excluded(self) -> dict[str, str]:
        """Layer -> why the capture accumulated no statistics for it."""
        out: dict[str, str] = {}
        for meta in self.metadata():
            out.update(json.loads(meta.get("excluded", "{}")))
        return out

    @property
    def units(self) -> list[tuple[str, ...]]:
        """The groups of layers that share one tied weight (model order)."""
        found: dict[tuple[str, ...], None] = {}
        for meta in self.metadata():
            found.update(dict.fromkeys(tuple(u) for u in json.loads(meta.get("units", "[]"))))
        return list(found)

    def layer_names(self) -> list[str]:
        names: dict[str, None] = {}
        for path in self.files.values():
            with safe_open(path, framework="pt") as f:
                names.update(dict.fromkeys(_layers_in(f)))
        return list(names)

    def factor_sizes(self) -> dict[str, list[int]]:
        """Layer -> the orders ``n`` of its dense ``(n, n)`` factors, read from the file
        headers alone (a diagonal or absent factor has none: it costs no factorization)."""
        out: dict[str, list[int]] = {}
        for path in self.files.values():
            with safe_open(path, framework="pt") as f:
                for name in _layers_in(f):
                    shapes = (f.get_slice(f"{name}::{side}").get_shape() for side in "AS")
                    out[name] = [shape[0] for shape in shapes if len(shape) == 2]
        return out

    def load(self, layers: Iterable[str] | None = None) -> dict[str, KroneckerFactors]:
        """Each layer's statistics summed over the files that hold it (fp64)."""
        return sum_files(list(self.files.values()), layers)


def sum_files(
    paths: list[Path], layers: Iterable[str] | None = None
) -> dict[str, KroneckerFactors]:
    """Layer -> its statistics summed over ``paths`` (of ``layers`` only, when given)."""
    wanted = None if layers is None else set(layers)
    total: dict[str, KroneckerFactors] = {}
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in _layers_in(f):
                if wanted is not None and name not in wanted:
                    continue
                stats = KroneckerFactors(
                    f.get_tensor(f"{name}::A"),
                    f.get_tensor(f"{name}::S"),
                    f.get_tensor(f"{name}::tokens")[0],
                )
                total[name] = total[name] + stats if name in total else stats
    return total


def _layers_in(f: Any) -> list[str]:
    """Layer names of an open statistics file, in file order."""
    keys: list[str] = f.keys()  # safe_open has keys(), no iteration
    return list(dict.fromkeys(k.rsplit("::", 1)[0] for k in keys))


def _metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error type for a bad header
        raise StoreError(
            f"cannot read K-FAC statistics {path}: {exc}; recapture the store"
        ) from exc


def _rank_of(folder: Path) -> int | None:
    match = re.fullmatch(r"rank-(\d+)", folder.name)
    return None if match is None else int(match.group(1))


def candidate_sets(root: Path) -> dict[tuple[bool, int], dict[int, Path]]:
    """``(final, next_step)`` -> rank -> file, for every file of every rank folder (the
    final set keyed by ``(True, -1)``; snapshots of both kinds at one step form one set,
    the checkpoint file preferred)."""
    sets: dict[tuple[bool, int], dict[int, Path]] = {}
    for folder in sorted(root.glob("rank-*")):
        rank = _rank_of(folder)
        if rank is None:
            continue
        final = folder / CURVATURE_FILE
        if final.exists():
            sets.setdefault((True, -1), {})[rank] = final
        for path in sorted(folder.glob("curvature-*before-step*.safetensors")):
            parsed = snapshot_step(path)
            if parsed is not None:
                files = sets.setdefault((False, parsed[1]), {})
                if parsed[0] == "checkpoint" or rank not in files:
                    files[rank] = path
    return sets


def _complete(root: Path, files: dict[int, Path]) -> tuple[bool, int | None]:
    """Whether ``files`` covers every rank it must, and the set's ``next_step``."""
    required = {
        rank
        for folder in root.glob("rank-*")
        if (rank := _rank_of(folder)) is not None and (folder / INDEX_FILE).exists()
    }
    steps = set()
    for path in files.values():
        meta = _metadata(path)
        if meta.get("format") == FORMAT:
            required |= set(range(int(meta["world_size"])))
            steps.add(int(meta["next_step"]))
    if len(steps) > 1:
        return False, None
    return required <= set(files), next(iter(steps), None)


def latest_set(root: Path, at_step: int | None = None) -> StatisticsSet | None:
    """The complete final set, else the latest complete snapshot set (``at_step``: the
    complete snapshot set covering exactly the steps before it); ``None`` if there is none."""
    sets = candidate_sets(Path(root))
    keys = sorted(sets, key=lambda k: (k[0], k[1]), reverse=True)
    for final, step in keys:
        if at_step is not None and (final or step != at_step):
            continue
        complete, next_step = _complete(Path(root), sets[(final, step)])
        if complete:
            return StatisticsSet(sets[(final, step)], next_step if final else step, final)
    return None


def _unfinished(root: Path) -> bool:
    """Whether ``root`` holds committed steps of a capture that knew its model (which
    writes ``end.json`` per rank at its end) but no rank's end marker: a killed capture."""
    header = root / STORE_FILE
    if not header.is_file() or not any(root.glob(f"rank-*/{INDEX_FILE}")):
        return False
    try:
        knew_model = json.loads(header.read_text()).get("fingerprint") is not None
    except (OSError, ValueError, AttributeError):
        return False  # the reader refuses a damaged header itself
    return knew_model and not any(root.glob(f"rank-*/{END_FILE}"))


def read_set(root: str | Path) -> StatisticsSet:
    """The statistics a reader uses (see :func:`latest_set`), warning when they cover
    fewer steps than the store holds (a capture that did not finish)."""
    found = latest_set(Path(root))
    if found is None:
        if any(candidate_sets(Path(root)).values()):
            raise StoreError(
                f"the K-FAC statistics of {root} are incomplete (some rank never saved its "
                "part of any commit); recapture, or resume the run from a trainer checkpoint"
            )
        if _unfinished(Path(root)):
            raise StoreError(
                f"{root} has no K-FAC statistics: its capture did not finish (no rank wrote "
                f"its {END_FILE}), and a one-pass capture saves them at its end; recapture it "
                "(a trainer run: resume it from a checkpoint)"
            )
        raise StoreError(
            f"{root} has no K-FAC statistics ({CURVATURE_FILE}); capture with curvature "
            "enabled (CurvatureAccumulator, `tda capture --curvature`) to use K-FAC/EK-FAC/LoGra"
        )
    if not found.final:
        logger.warning(
            "%s: capture did not finish; using the K-FAC statistics committed before step %s",
            root,
            found.next_step,
        )
    return found


def discard_after(rank_folder: Path, step: int) -> None:
    """Remove this rank's final statistics and its snapshots of steps ``> step``: a run
    resumed at ``step`` (or started afresh, ``step = 0``) redoes them."""
    (rank_folder / CURVATURE_FILE).unlink(missing_ok=True)
    for path in rank_folder.glob("curvature-*before-step*.safetensors"):
        parsed = snapshot_step(path)
        if parsed is not None and parsed[1] > step:
            path.unlink()


def drop_checkpoints(rank_folder: Path, steps: Iterable[int]) -> None:
    """Remove this rank's checkpoint snapshots of ``steps``: the trainer has deleted those
    checkpoints (``save_total_limit``), so no run resumes there, and each snapshot is the
    whole of the statistics."""
    for step in steps:
        snapshot_path(rank_folder, "checkpoint", step).unlink(missing_ok=True)


def prune_commits(rank_folder: Path, keep: Path) -> None:
    """Remove this rank's periodic snapshots older than the one before ``keep`` (two are
    kept, so that a rank one commit behind another still has a set in common with it)."""
    commits = sorted(
        (parsed[1], path)
        for path in rank_folder.glob("curvature-commit-before-step*.safetensors")
        if (parsed := snapshot_step(path)) is not None and path != keep
    )
    for _, path in commits[:-1]:
        path.unlink(missing_ok=True)
