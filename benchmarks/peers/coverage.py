"""The cell index: one table per training-set size, a row per (model, query count,
method) and a column per library, each cell either the latest measured figure (time over
the floor of its own process) or the reason it is missing, so that no cell of the
comparison goes silently unfilled.

A measured cell comes from the harness's JSON dumps; a cell that could not run carries
the reason its run recorded (``unsupported``, ``error``, ``not run``). A cell that no run
reached is explained by a :class:`Gap` from a hand-kept JSON list
(``benchmarks/peers/gaps.json``); one that nothing explains is shown as such, so that a
gap in the index is visible rather than dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

#: A cell's coordinates within one training-set size: (model, library, method, queries).
CellKey = tuple[str, str, str, int]
UNEXPLAINED = "not measured, and no reason recorded in the gaps file"


@dataclass(frozen=True)
class Found:
    """What the latest run of a cell reported: ``ratio`` (time over the floor) when it
    ran, else its ``status`` and ``reason``; ``where`` names the dump it came from."""

    status: str
    where: str
    ratio: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class Gap:
    """Why cells no run measured are missing. ``None`` fields match any value, so one
    gap can cover a library's every cell, or one method at one size."""

    library: str
    reason: str
    method: str | None = None
    model: str | None = None
    queries: int | None = None
    train: int | None = None

    def covers(self, train: int, key: CellKey) -> bool:
        """Whether this gap explains the cell ``key`` at ``train`` training rows."""
        model, library, method, queries = key
        wanted = dict(library=library, method=method, model=model, queries=queries, train=train)
        return all(getattr(self, k) in (None, v) for k, v in wanted.items())


def load_gaps(path: Path) -> list[Gap]:
    """The gaps listed in ``path``: a JSON list of objects with :class:`Gap`'s fields,
    where ``library`` may also be a list (one gap per library, the same reason)."""
    names = {f.name for f in fields(Gap)}
    gaps = []
    for i, entry in enumerate(json.loads(path.read_text())):
        unknown = set(entry) - names
        if unknown:
            raise ValueError(
                f"{path}: entry {i} has unknown field(s) {sorted(unknown)}; "
                f"the fields are {sorted(names)}"
            )
        libraries = entry["library"]
        for library in [libraries] if isinstance(libraries, str) else libraries:
            gaps.append(Gap(**{**entry, "library": library}))
    return gaps


def _explained(train: int, key: CellKey, gaps: Sequence[Gap]) -> str:
    """The first gap's reason for a cell no run measured."""
    return next((g.reason for g in gaps if g.covers(train, key)), UNEXPLAINED)


def coverage_table(
    train: int,
    found: Mapping[CellKey, Found],
    axes: tuple[Sequence[str], Sequence[int], Sequence[str], Sequence[str]],
    standing: Mapping[tuple[str, str], Found],
    gaps: Sequence[Gap],
) -> str:
    """The index of one training-set size as markdown: the table, then its numbered
    reasons (each distinct reason once) and the dumps its figures come from.

    Args:
        train: the training rows of these cells.
        found: the latest result of every cell that some run reached.
        axes: (models, query counts, methods, libraries), in table order.
        standing: per (library, method), an ``unsupported`` result from any run: a
            library that lacks a method lacks it at every size, model and query count.
        gaps: the reasons for cells that no run reached.
    """
    models, query_counts, methods, libraries = axes
    reasons: dict[str, int] = {}
    sources: dict[str, None] = {}
    lines = [
        "| model | queries | method | " + " | ".join(libraries) + " |",
        "|---|---:|---|" + "---:|" * len(libraries),
    ]
    for model in models:
        for queries in query_counts:
            for method in methods:
                cells = []
                for library in libraries:
                    key = (model, library, method, queries)
                    hit = found.get(key) or standing.get((library, method))
                    if hit is not None and hit.ratio is not None:
                        sources[hit.where] = None
                        cells.append(f"{hit.ratio:.2f}x")
                        continue
                    if hit is None:
                        label, why = "not measured", _explained(train, key, gaps)
                    else:
                        label, why = hit.status, hit.reason
                    number = reasons.setdefault(why, len(reasons) + 1)
                    cells.append(f"{label} [{number}]")
                lines.append(f"| {model} | {queries} | {method} | " + " | ".join(cells) + " |")
    notes = [f"{n}. {why}" for why, n in reasons.items()]
    dumps = ", ".join(f"`{name}`" for name in sources) or "none"
    return "\n".join([*lines, "", *notes, "", f"Figures from: {dumps}."])
