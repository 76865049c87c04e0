"""The arms the data selection demo compares, and what each run measured.

Every arm trains the same model from the same LoRA initialization, on the same data order
(the trainer's sampler and seed), for the same number of optimizer steps:

* ``none``: the mixture, no selection (the floor);
* ``clean``: the mixture without its planted corrupted examples, no selection (the
  ceiling);
* ``ours``: :class:`~tda_plugins.integrations.transformers.DataSelectionCallback` with the
  library's default settings against the target pool; ``ours_identity``: the same without
  Adam's metric (``score="dot"``); ``ours_margin0``: without its margin;
* the ranked scores, each dropping exactly as many examples per step as ``ours`` dropped
  (``drop_counts``): the lowest Adam-preconditioned dot, cosine or dot with the target, and
  per layer the lowest cosine;
* ``random``, ``high_loss``, ``low_loss``: the baselines, through the same callback with no
  target, as many per step as ``ours`` too: drop examples at random, the highest-loss or
  the lowest-loss ones, so that every selecting arm keeps the same number of examples at
  every step;
* ``oracle``: the batches without their planted corrupted examples (what a perfect rule
  would keep);
* other rules with ours' score, each deciding its own count: the lowest half of every
  step, every example with a negative score, and the previous demo's settings (the lowest
  62.5% by cosine, the target refreshed every 4 steps).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from demo_data import CORRUPTED_KINDS, KINDS, TASKS

#: Training examples of the target tasks, and every clean one (off-target text included).
TASK_KINDS = frozenset(TASKS)
GOOD_KINDS = frozenset(KINDS) - CORRUPTED_KINDS


@dataclass(frozen=True)
class Arm:
    """One configuration of the comparison.

    Attributes:
        name: short name (``--arms``, the JSON).
        label: what the table and the plot call it.
        clean_data: train on the mixture without its corrupted examples.
        selection: ``DataSelectionCallback`` options (``None``: no selection); ``ours``'s
            are the library defaults.
        target: scores against the target pool (else ``target=None``).
        matched: replays ``ours``'s number of drops per step (``drop_counts``).
        oracle: leave exactly the planted corrupted examples out of each batch (selection
            that knows the answer: the most any rule can do at this data order).
    """

    name: str
    label: str
    selection: dict[str, Any] | None = None
    clean_data: bool = False
    target: bool = False
    matched: bool = False
    oracle: bool = False


ARMS = {
    arm.name: arm
    for arm in (
        Arm("none", "no selection"),
        Arm("clean", "clean data (ceiling)", clean_data=True),
        Arm("ours", "ours (default settings)", selection={}, target=True),
        Arm("random", "random drop", {"rule": "random", "score": "loss"}, matched=True),
        Arm(
            "high_loss",
            "drop highest loss",
            {"rule": "bottom_fraction", "score": "loss"},
            matched=True,
        ),
        Arm(
            "low_loss", "drop lowest loss", {"rule": "top_fraction", "score": "loss"}, matched=True
        ),
        Arm("oracle", "oracle: drops exactly the corrupted", oracle=True),
        Arm("ours_identity", "ours, score=dot (no Adam metric)", {"score": "dot"}, target=True),
        Arm("ours_margin0", "ours, margin=0", {"margin": 0.0}, target=True),
        Arm(
            "lowest_adam",
            "as many, lowest Adam score",
            {"rule": "bottom_fraction", "score": "adam"},
            target=True,
            matched=True,
        ),
        Arm(
            "lowest_cosine",
            "as many, lowest cosine",
            {"rule": "bottom_fraction", "score": "cosine"},
            target=True,
            matched=True,
        ),
        Arm(
            "lowest_dot",
            "as many, lowest dot",
            {"rule": "bottom_fraction", "score": "dot"},
            target=True,
            matched=True,
        ),
        Arm(
            "lowest_cosine_per_layer",
            "as many per layer, lowest cosine",
            {"rule": "bottom_fraction", "score": "cosine", "granularity": "per_layer"},
            target=True,
            matched=True,
        ),
        Arm(
            "half_lowest_adam",
            "rule: lowest half by Adam score",
            {"rule": "bottom_fraction", "fraction": 0.5},
            target=True,
        ),
        Arm(
            "negative_adam",
            "rule: negative Adam score",
            {"rule": "threshold", "threshold": 0.0},
            target=True,
        ),
        Arm(
            "previous_default",
            "previous demo: lowest 62.5% by cosine",
            {"rule": "bottom_fraction", "fraction": 0.625, "score": "cosine", "refresh_every": 4},
            target=True,
        ),
    )
}
#: ``make demo``: the floor, the ceiling, ours and the three baselines.
STANDARD_ARMS = ("none", "clean", "ours", "random", "high_loss", "low_loss")
#: ``make demo-seeds``: also every variant of ours.
ALL_ARMS = tuple(ARMS)


def arm_names(spec: str) -> list[str]:
    """``"standard"``, ``"all"`` or comma-separated names -> arm names, ``none`` first
    (its step-0 evaluation serves every arm) and ``ours`` before the arms that replay it."""
    names = {"standard": STANDARD_ARMS, "all": ALL_ARMS}.get(spec) or spec.split(",")
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ValueError(f"unknown arms {unknown}; choose from {list(ARMS)}")
    chosen = set(names) | {"none"}
    if any(ARMS[n].matched for n in names):
        chosen.add("ours")
    return [n for n in ARMS if n in chosen]


@dataclass
class RunResult:
    """One training run: its evaluation curves, step times and what it dropped.

    Attributes:
        curves: task -> ``[(step, eval loss)]``.
        step_seconds: wall time of each optimizer step.
        step_cpu_seconds: this process's CPU time of each optimizer step (empty in runs
            recorded before it was measured).
        seen: kind -> examples of that kind that reached a batch.
        dropped: kind -> of those, the ones dropped.
        drop_counts: examples dropped at each step.
        scores: per step, ``[(kind, score, dropped)]`` of every example (selecting arms).
    """

    curves: dict[str, list[tuple[int, float]]]
    step_seconds: list[float]
    step_cpu_seconds: list[float] = field(default_factory=list)
    seen: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    drop_counts: list[int] = field(default_factory=list)
    scores: list[list[tuple[str, float, bool]]] = field(default_factory=list)

    def tally(self, history: Sequence[Any], kinds: dict[int, str]) -> None:
        """Count, over every step's selection, the examples seen and dropped per kind."""
        for step in history:
            ids, dropped = step.example_ids.tolist(), step.dropped.tolist()
            self.tally_step([kinds[int(i)] for i in ids], step.scores.tolist(), dropped)

    def tally_step(
        self, kinds: Sequence[str], scores: Sequence[float], dropped: Sequence[bool]
    ) -> None:
        """Count one step's examples (their kinds, scores and whether dropped)."""
        rows = []
        for kind, score, out in zip(kinds, scores, dropped, strict=True):
            self.seen[kind] = self.seen.get(kind, 0) + 1
            self.dropped[kind] = self.dropped.get(kind, 0) + int(out)
            rows.append((kind, float(score), bool(out)))
        self.scores.append(rows)
        self.drop_counts.append(sum(map(bool, dropped)))

    def curve(self) -> list[tuple[int, float]]:
        """The mean of the tasks' eval losses at each evaluated step."""
        steps = [s for s, _ in self.curves[TASKS[0]]]
        return [
            (step, statistics.mean(dict(self.curves[t])[step] for t in TASKS)) for step in steps
        ]

    @property
    def final_loss(self) -> float:
        return self.curve()[-1][1]

    def final_task_loss(self, task: str) -> float:
        return self.curves[task][-1][1]

    def share(self, kinds: frozenset[str]) -> float:
        """Share of the examples of ``kinds`` that reached a batch and were dropped."""
        seen = sum(self.seen.get(k, 0) for k in kinds)
        return sum(self.dropped.get(k, 0) for k in kinds) / max(seen, 1)

    @property
    def precision(self) -> float:
        """Share of the dropped examples that were planted corrupted ones."""
        total = sum(self.dropped.values())
        return sum(self.dropped.get(k, 0) for k in CORRUPTED_KINDS) / max(total, 1)

    @property
    def recall(self) -> float:
        """Share of the corrupted examples that reached a batch and were dropped."""
        return self.share(CORRUPTED_KINDS)

    @property
    def selects(self) -> bool:
        return bool(self.seen)


@dataclass
class SeedResult:
    """Every arm's run of one seed."""

    seed: int
    runs: dict[str, RunResult]

    def gap_closed(self, arm: str) -> float:
        """Share of the no-selection-to-clean gap in final eval loss that ``arm`` closes
        (NaN without the clean run)."""
        if "clean" not in self.runs:
            return math.nan
        none, clean = self.runs["none"].final_loss, self.runs["clean"].final_loss
        return (none - self.runs[arm].final_loss) / (none - clean)

    def time_ratio(self, arm: str) -> float:
        """Summed step CPU time of ``arm`` / no selection, target refreshes included (NaN
        for runs without CPU times). Each run trains in a process of one torch thread, so
        its CPU time is its own work: the wall time of runs made one after another, or
        side by side, on a shared machine also counts whatever else ran meanwhile.
        ``benchmarks/selection_overhead.py --setting demo`` is the interleaved measurement."""
        mine, plain = self.runs[arm].step_cpu_seconds, self.runs["none"].step_cpu_seconds
        if not mine or not plain:
            return math.nan
        return sum(mine) / sum(plain)
