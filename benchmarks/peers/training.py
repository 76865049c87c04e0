"""The peer workloads that run inside training: (4) capture overhead and (5) online data
selection. Each library is a :class:`TrainingWay` of running the same ``Trainer`` loop
(plain, or with its callback or hooks); short runs of every way alternate on identical
model copies (order rotated each round), a :class:`~common.StepTimer` placed first times
each step, and the table gives each way's step time over the plain one's.

A way that cannot run here (its library is not installed, or does not do this work)
raises :class:`Unavailable` on construction; its row keeps the reason.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from common import (
    Comparison,
    ModelConfig,
    Sample,
    StepTimer,
    alternate,
    require_positive,
    require_repeats,
    runs_needed,
    tidy,
    verdict,
)
from torch import nn

from peers.workload import MODES, QUICK_LLAMA, Mode

PLAIN = "plain"
OURS = "ours"
R = TypeVar("R")


@dataclass(frozen=True)
class RunOptions:
    """The command-line settings of every in-training workload (``quick``, ``seq`` and
    ``batch`` are also what the model and row builders they share read).

    Attributes:
        seq: tokens per sequence.
        batch: examples per step.
        repeats: timed steps per way (at least ``MIN_REPEATS`` unless ``quick``).
        steps_per_run: steps of one ``train()`` run; its first is a discarded warm-up.
        quick: the tiny smoke configuration.
        write: update the results file.
        results: the results file.
        model: the Llama's config keyword arguments (the tiny one with ``quick``).
    """

    seq: int
    batch: int
    repeats: int
    steps_per_run: int
    quick: bool
    write: bool
    results: Path
    model: ModelConfig

    @property
    def vocab(self) -> int:
        """The model's vocabulary size."""
        return int(self.model["vocab_size"])

    @property
    def runs(self) -> int:
        """Alternating runs per way."""
        return runs_needed(self.repeats, self.steps_per_run, 1)

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser, seq: int) -> None:
        """The flags of these settings (``--quick``/``--write``/``--results`` come with
        :func:`common.base_parser`); ``seq`` is the default sequence length."""
        p.add_argument("--seq", type=int, help=f"sequence length (default {seq}; quick 16)")
        p.add_argument("--batch", type=int, default=8, help="examples per step")
        p.add_argument("--repeats", type=int, help="timed steps per library (default 12)")
        p.add_argument("--steps-per-run", type=int, default=4, help="steps of one train() run")

    @classmethod
    def parsed(
        cls, p: argparse.ArgumentParser, a: argparse.Namespace, *, seq: int, model: ModelConfig
    ) -> RunOptions:
        """The settings from parsed arguments ``a`` for the Llama of config ``model``,
        refused (``p.error``) where they cannot give a valid measurement."""
        options = cls(
            seq=a.seq or (16 if a.quick else seq),
            batch=a.batch,
            repeats=a.repeats or (2 if a.quick else 12),
            steps_per_run=a.steps_per_run,
            quick=a.quick,
            write=a.write if a.write is not None else not a.quick,
            results=a.results,
            model=QUICK_LLAMA if a.quick else model,
        )
        require_positive(p, options, ("seq", "batch", "repeats"))
        if options.steps_per_run < 2:
            p.error("--steps-per-run must be >= 2 (the first step of each run is discarded)")
        require_repeats(p, options.repeats, quick=options.quick)
        return options

    def protocol(self, steps: int) -> str:
        """How the runs alternate and what a ratio is; ``steps``: timed steps per way."""
        return (
            f"Runs of {self.steps_per_run} steps alternate (order rotated, {self.runs} per "
            "library, identical model copies), the first step of each discarded: median of "
            f"{steps} steps per library. Ratio = median step / median plain step of the same "
            "mode (CPU time: one torch thread, steadier than wall time on this shared "
            "machine); paired = step / plain step of the same slot."
        )


class Unavailable(Exception):
    """A library cannot run this workload here; the message says why (kept in its row)."""


def not_installed(library: str, error: ImportError) -> Unavailable:
    """The reason of a library whose import failed here (the peers' venv has it)."""
    return Unavailable(f"{library} is not installed here ({error}); run `make bench`")


class TrainingWay(ABC):
    """One way of training a run: plain, or with one library's callback or hooks.

    Class attributes:
        name: the row's name (``plain``, ``ours``, a peer's name).
        note: what it runs, for the list under the table.
        ours: one of our own ways (compared with the peers, not held against ``ours``).
    """

    name: ClassVar[str]
    note: ClassVar[str]
    ours: ClassVar[bool] = False

    @abstractmethod
    def train(self, model: nn.Module, args: Any, timer: StepTimer) -> None:
        """One ``trainer.train()`` of ``model`` with ``timer`` as the first callback; raises
        when the library did not do its work at every step."""


@dataclass
class Lane:
    """One available way in one mode: the way, its own model copy and its step timer."""

    way: TrainingWay
    model: nn.Module
    timer: StepTimer = field(default_factory=StepTimer)


@dataclass(frozen=True)
class ModeResult:
    """One mode's timed steps per available way, and why the others could not run.

    Attributes:
        label: the mode, as the table shows it.
        ways: every way's name, in table order.
        samples: timed steps (after each run's warm-up steps) per available way.
        reasons: why each unavailable way is missing.
        peers: the ways held against ``ours`` (not plain, not our own).
    """

    label: str
    ways: list[str]
    samples: dict[str, list[Sample]]
    reasons: dict[str, str]
    peers: list[str]

    def comparison(self, name: str) -> Comparison:
        """``name`` against plain."""
        return Comparison.of(self.samples[name], self.samples[PLAIN])


def run_mode(
    label: str,
    ways: dict[str, type[TrainingWay]],
    build: Callable[[type[TrainingWay]], TrainingWay],
    model_copy: Callable[[], nn.Module],
    args_for: Callable[[str, int], Any],
    rounds: int,
    warmup: int,
) -> tuple[ModeResult, list[float]]:
    """Build every way (``ways``: name -> class, ``build(cls)`` constructs it), give each
    available one a fresh ``model_copy()``, and run ``rounds`` rounds of one ``train()``
    per way, order rotated; ``args_for(name, round)`` gives that run's
    ``TrainingArguments``. Returns the result and the load average after each round."""
    lanes: dict[str, Lane] = {}
    reasons: dict[str, str] = {}
    for name, cls in ways.items():
        try:
            lanes[name] = Lane(build(cls), model_copy())
        except Unavailable as e:
            reasons[name] = str(e)
    if PLAIN not in lanes:
        raise RuntimeError(f"the plain way must run: {reasons.get(PLAIN)}")

    def run(name: str, round_: int) -> None:
        lane = lanes[name]
        lane.way.train(lane.model, args_for(name, round_), lane.timer)

    loads = alternate(list(lanes), rounds, run, f"{label}: ")
    samples = {name: lane.timer.timed(warmup) for name, lane in lanes.items()}
    peers = [name for name, cls in ways.items() if name != PLAIN and not cls.ours]
    return ModeResult(label, list(ways), samples, reasons, peers), loads


def each_mode(
    names: Sequence[str], measure: Callable[[Mode], tuple[R, list[float]]]
) -> tuple[list[R], list[float]]:
    """``measure(mode)`` for each fine-tuning mode of ``names`` (keys of
    :data:`~workload.MODES`), in order: the results and every load average sampled."""
    results, loads = [], []
    for name in names:
        result, mode_loads = measure(MODES[name])
        results.append(result)
        loads += mode_loads
    return results, loads


def ratio_table(results: Sequence[ModeResult], target: str) -> str:
    """Step times and ratios to plain per mode and way; for each peer, its overhead
    (ratio - 1) over ours and whether ours is below it (the ``target`` column)."""
    lines = [
        "| mode | library | step s, CPU median [IQR] | **CPU ratio** | paired CPU ratio [IQR] "
        f"| wall ratio | peer overhead / ours (ratio - 1) | {target} |",
        "|---|---|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in results:
        ours = r.comparison(OURS).cpu_ratio - 1 if OURS in r.samples else None
        for name in r.ways:
            if name not in r.samples:
                lines.append(f"| {r.label} | {name} | {r.reasons[name]} | — | — | — | — | — |")
                continue
            c = r.comparison(name)
            versus, met = "—", ""
            if name in r.peers and ours is not None:
                theirs = c.cpu_ratio - 1
                versus = f"{theirs / ours:.2f}x" if ours > 0 else "ours <= 0"
                met = verdict(ours, theirs) if theirs > 0 else "**no**"
            lines.append(
                f"| {r.label} | {name} | {c.cpu.text()} | **{c.cpu_ratio:.2f}x** "
                f"| {c.cpu_paired.text('.2f', 'x')} | {c.wall_ratio:.2f}x | {versus} | {met} |"
            )
    return "\n".join(lines)


def notes_list(ways: Sequence[type[TrainingWay]]) -> str:
    """What each way runs, one bullet each."""
    return "\n".join(f"- `{way.name}`: {way.note}." for way in ways)


def section(
    head: str,
    setup: str,
    options: RunOptions,
    ways: Sequence[type[TrainingWay]],
    results: Sequence[ModeResult],
    target: str,
) -> str:
    """A workload's results section: ``head`` (:func:`common.heading`), the ``Trainer``
    setup and the model, then the workload's own ``setup`` sentences, the protocol, what
    each way runs and the ratio table (``target``: the heading of its verdict column)."""
    steps = min(len(v) for r in results for v in r.samples.values())
    shape = ", ".join(f"{k}={v}" for k, v in options.model.items())
    return tidy(f"""{head}

HF `Trainer` (CPU, fp32, AdamW, `max_grad_norm=1.0`), batch {options.batch} x sequence \
{options.seq}, no padding, `LlamaConfig({shape})`{setup} {options.protocol(steps)}

{notes_list(ways)}

{ratio_table(results, target)}
""")
