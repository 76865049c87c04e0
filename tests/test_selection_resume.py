"""A run of ``DataSelectionCallback`` resumed from a checkpoint selects as an uninterrupted one.

The selection keeps a schedule across steps that the trainer's checkpoint does not hold:
the target computed at an earlier step's weights, when the next refresh is due (from the
last step's batch size, ``refresh_every=None``), the target pool's cursor
(``target_examples``) and the random rule's draws. Each case trains 6 steps with a
checkpoint every 3, then a fresh ``Trainer`` resumes from ``checkpoint-3`` in the same
output folder; the schedules are chosen so that a run that recomputed its target at the
resumed step, counted its interval or its pool from there or redrew its random drops would
select otherwise (the default: a 2-example pool, 4 examples a step, so a refresh every 4
steps: the uninterrupted run refreshes at steps 0 and 4, a fresh schedule at 3). The
reference is the uninterrupted run itself: its ``selection.jsonl`` lines of steps 3..5 and
its final weights, which the resumed run must equal bit for bit.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import Trainer

from tda_plugins.data_selection.resume import STATE_FILE
from tda_plugins.integrations.olmo_core import DataSelectionCallback as OlmoSelection
from tda_plugins.integrations.transformers import DataSelectionCallback
from tests.models import tiny_causal_lm
from tests.test_olmo_core import fit, gloo_world_of_one  # noqa: F401 (a fixture)
from tests.trainers import pad_rows, token_rows, training_args

STEPS, SAVE_EVERY = 6, 3
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "refresh_every_2_pool_in_turn": {"refresh_every": 2, "target_examples": 1},
    "random_rule": {"rule": "random", "refresh_every": 2, "fraction": 0.5},
}


def run(output: Path, log: Path, options: dict[str, Any], resume: Path | None = None) -> Trainer:
    """``STEPS`` steps of 4 examples (a checkpoint every ``SAVE_EVERY``) with selection."""
    callback = DataSelectionCallback(
        target=[{"input_ids": r} for r in token_rows(2, seed=1)],
        layers="all",
        log_path=str(log),
        **options,
    )
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(
            output,
            per_device_train_batch_size=4,
            max_steps=STEPS,
            save_strategy="steps",
            save_steps=SAVE_EVERY,
        ),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(32)]),
        data_collator=pad_rows,
        callbacks=[callback],
    )
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer


def lines(log: Path) -> dict[int, dict[str, Any]]:
    """Step -> its logged selection."""
    return {row["step"]: row for row in map(json.loads, log.read_text().splitlines())}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resumed_run_selects_as_the_uninterrupted_run(tmp_path: Path, case: str) -> None:
    options = CASES[case]
    output = tmp_path / "out"
    reference = run(output, tmp_path / "reference.jsonl", options)
    checkpoint = output / f"checkpoint-{SAVE_EVERY}"
    assert (checkpoint / STATE_FILE.format(rank=0)).is_file()

    resumed = run(output, tmp_path / "resumed.jsonl", options, resume=checkpoint)
    want, got = lines(tmp_path / "reference.jsonl"), lines(tmp_path / "resumed.jsonl")
    assert len(want) == STEPS and sorted(got) == sorted(want)[SAVE_EVERY:]
    assert got == {step: want[step] for step in got}
    for (name, a), b in zip(
        resumed.model.named_parameters(), reference.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_resumed_run_continues_the_log_with_each_step_once(tmp_path: Path) -> None:
    """The log a crashed run left holds the steps it got to past its checkpoint: resumed
    from ``checkpoint-3`` into that log, the run rewrites those steps, so the log holds
    steps 1..6 once each, the uninterrupted run's lines. A fresh run into an old log
    starts it over."""
    output, log = tmp_path / "out", tmp_path / "selection.jsonl"
    run(output, log, {})  # the uninterrupted run, its log as a crash at step 6 leaves it
    reference = log.read_text()
    run(output, log, {}, resume=output / f"checkpoint-{SAVE_EVERY}")
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    assert log.read_text() == reference
    run(tmp_path / "again", log, {})
    assert log.read_text() == reference  # the same run again, from an empty log


@pytest.mark.parametrize("fault", ["missing", "another_step"])
def test_resume_without_a_usable_schedule_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    """A checkpoint without the schedule (written before it was saved, or the process
    killed between the trainer's save and the callback's), or with the schedule of another
    step: the resumed run says that its selection will differ from an uninterrupted run's,
    naming the cause."""
    output = tmp_path / "out"
    run(output, tmp_path / "reference.jsonl", {})
    name = STATE_FILE.format(rank=0)
    checkpoint = output / f"checkpoint-{SAVE_EVERY}"
    if fault == "missing":
        (checkpoint / name).unlink()
        cause = name
    else:
        (output / f"checkpoint-{STEPS}" / name).replace(checkpoint / name)
        cause = f"saved at step {STEPS}, not {SAVE_EVERY}"
    with caplog.at_level(logging.WARNING, logger="tda_plugins"):
        run(output, tmp_path / "resumed.jsonl", {}, resume=checkpoint)
    warnings = [r.getMessage() for r in caplog.records if "selection schedule" in r.getMessage()]
    assert len(warnings) == 1
    assert cause in warnings[0]
    assert "differ from an uninterrupted run" in warnings[0]


@pytest.mark.usefixtures("gloo_world_of_one")
def test_olmo_core_resumed_run_selects_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """OLMo-core: the schedule travels in the callback's ``state_dict`` (a 2-row pool, 4
    instances a step: the default refreshes at steps 0 and 4, a fresh schedule would at
    2). Resumed from ``step2`` of a 4-step run, steps 2 and 3 select as the uninterrupted
    run's and the final weights are equal."""
    pool = token_rows(2, seed=1)

    def selection(log: str) -> OlmoSelection:
        return OlmoSelection(target=pool, log_path=str(tmp_path / log))

    reference = fit(
        tmp_path, {"selection": selection("a.jsonl")}, 4, tmp_path / "first", checkpoints=True
    )
    resumed = fit(
        tmp_path,
        {"selection": selection("b.jsonl")},
        4,
        tmp_path / "second",
        load_path=tmp_path / "first" / "step2",
        checkpoints=True,
    )
    want, got = lines(tmp_path / "a.jsonl"), lines(tmp_path / "b.jsonl")
    assert len(want) == 4 and sorted(got) == sorted(want)[2:]
    assert got == {step: want[step] for step in got}
    for (name, a), b in zip(
        resumed.train_module.model.named_parameters(),
        reference.train_module.model.parameters(),
        strict=True,
    ):
        assert torch.equal(a, b), name
