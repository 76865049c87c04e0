"""A stand-in for the demo's training run (``recipes/lora_data_selection.py:run_task``), so
that a test can run the demo's process pool (``recipes/demo_schedule.py``) without torch.

Each "run" returns at once: ``ours`` drops ``seed + 1`` examples at its one step, a matched
arm replays the drops of the ``ours`` run it was given, and ``seen`` records the process
that ran it and the tag its worker was started with."""

from __future__ import annotations

import os

from demo_arms import ARMS, RunResult
from demo_schedule import Task

_STARTED: dict[str, int] = {}


def start(tag: int) -> None:
    """The pool's initializer: remember ``tag`` in this worker."""
    _STARTED["tag"] = tag


def run(task: Task, ours: RunResult | None) -> RunResult:
    matched = ARMS[task.arm].matched
    if matched and ours is None:
        raise AssertionError(f"{task} started before the ours run it replays")
    drops = ours.drop_counts if matched and ours else [task.seed + 1 if task.arm == "ours" else 0]
    seen = {"pid": os.getpid(), "tag": _STARTED.get("tag", -1)}
    return RunResult(curves={}, step_seconds=[0.0], seen=seen, drop_counts=list(drops))
