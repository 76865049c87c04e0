"""Runs the demo's trainings, one per (seed, arm), in parallel worker processes: an arm
that replays ours' drops per step starts once ours of its seed has finished.

Two processes of one torch thread each train two arms at once on a 2-core machine, where
one process of two threads spends part of every small operation waiting for the other
thread (and, on a shared machine, for a core).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from demo_arms import ARMS, RunResult, SeedResult


@dataclass(frozen=True)
class Task:
    """One training run: ``arm`` on ``seed``'s data."""

    seed: int
    arm: str

    @property
    def ours(self) -> Task:
        """The run this one replays the drops of (when its arm is matched)."""
        return Task(self.seed, "ours")


def tasks(seeds: Sequence[int], arms: Sequence[str]) -> list[Task]:
    """Every (seed, arm), seed by seed, ours first (the matched arms wait for it)."""
    first = sorted(arms, key=lambda a: (a != "ours", ARMS[a].matched))
    return [Task(seed, arm) for seed in seeds for arm in first]


#: ``run(task, ours)``: trains ``task`` (``ours``: the run of ``task.ours`` when the arm
#: replays it, else ``None``); a module-level function, so that a worker can call it.
Runner = Callable[[Task, RunResult | None], RunResult]


def run_all(
    todo: Sequence[Task],
    run: Runner,
    *,
    workers: int,
    done: dict[Task, RunResult],
    on_done: Callable[[Task, RunResult], None],
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
) -> dict[Task, RunResult]:
    """Every task of ``todo`` run by ``run`` on ``workers`` processes (1: in this one),
    each as soon as its inputs are in ``done`` (updated in place, also returned; it may
    start with earlier runs). ``on_done`` is called in this process after each run."""
    pending = list(todo)

    def ready(task: Task) -> bool:
        return not ARMS[task.arm].matched or task.ours in done

    def finish(task: Task, result: RunResult) -> None:
        done[task] = result
        on_done(task, result)

    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        for task in pending:  # in order: ours precedes the arms that replay it
            finish(task, run(task, done.get(task.ours)))
        return done
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, context, initializer, initargs) as pool:
        running: dict[Future[RunResult], Task] = {}
        while pending or running:
            for task in [t for t in pending if ready(t)][: workers - len(running)]:
                pending.remove(task)
                running[pool.submit(run, task, done.get(task.ours))] = task
            if not running:
                raise RuntimeError(f"{pending} wait for an ours run that is not scheduled")
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                finish(running.pop(future), future.result())
    return done


def seed_results(
    done: dict[Task, RunResult], seeds: Sequence[int], arms: Sequence[str]
) -> list[SeedResult]:
    """The runs so far, by seed, in ``arms``' order. Only the no-selection run evaluates
    step 0 (LoRA starts at B = 0: every arm's start is the base model); each other run's
    curves get that point once it is there."""
    results = []
    for seed in seeds:
        runs = {a: done[Task(seed, a)] for a in arms if Task(seed, a) in done}
        start = runs.get("none")
        for run in runs.values():
            for task, curve in run.curves.items():
                if start is not None and curve and curve[0][0] != 0:
                    curve.insert(0, start.curves[task][0])
        if runs:
            results.append(SeedResult(seed, runs))
    return results
