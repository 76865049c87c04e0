"""The three transformers callbacks in one ``Trainer``: each sees only the training passes.

The selection target and the influence queries are backward passes of their own between
training steps; the capture callback's engine must not record them (it would fail on the
target's label-free call, or store the pool as training examples)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainerCallback

from tda_plugins.integrations.transformers import (
    DataSelectionCallback,
    GradientCaptureCallback,
    InfluenceLoggingCallback,
)
from tda_plugins.store import StoreReader
from tests.models import tiny_causal_lm
from tests.selection_helpers import PINNED
from tests.trainers import (
    RecordingCollator,
    WeightSnapshots,
    assert_steps_hold_their_micro_batches,
    assert_store_matches_oracle,
    pad_rows,
    token_rows,
    training_args,
)

STEPS = 3


def test_capture_selection_and_influence_share_a_trainer(tmp_path: Path) -> None:
    """The store holds exactly each step's training examples (every one, dropped or kept),
    each with its oracle gradient; selection and influence ran at every step."""
    collator, snapshots = RecordingCollator(), WeightSnapshots()
    selection = DataSelectionCallback(
        target=[{"input_ids": r} for r in token_rows(2, seed=7)],
        fraction=0.5,
        layers="all",
        **PINNED,
    )
    influence = InfluenceLoggingCallback(
        queries=[{"input_ids": r} for r in token_rows(2, seed=9)], layers="all"
    )
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(tmp_path / "out", max_steps=STEPS, per_device_train_batch_size=4),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(16)]),
        data_collator=collator,
        callbacks=[
            snapshots,
            influence,
            selection,
            GradientCaptureCallback(store_dir=str(tmp_path / "store"), layers="all"),
        ],
    )
    trainer.train()

    store = StoreReader(tmp_path / "store")
    assert_steps_hold_their_micro_batches(store, collator, accumulation=1, steps=STEPS)
    assert_store_matches_oracle(
        tmp_path / "store",
        snapshots,
        collator.examples(),
        lambda: tiny_causal_lm("llama", torch.float64),
    )
    assert [h.step for h in selection.history] == list(range(STEPS))
    assert all(int(h.dropped.sum()) == 2 for h in selection.history)
    assert len(influence.influence_log.history) == STEPS


@pytest.mark.parametrize(
    "influence_first", [True, False], ids=["influence-first", "selection-first"]
)
def test_influence_leaves_out_the_examples_the_selection_dropped(
    tmp_path: Path, influence_first: bool
) -> None:
    """An example the selection dropped did not train at that step: whichever callback
    comes first, the step's influence (its rows, mean and max) covers exactly the kept
    examples, and the cumulative scores only examples kept at some step. Every example
    occurs in one step (one epoch), so the dropped ones are absent from the report."""
    selection = DataSelectionCallback(
        target=[{"input_ids": r} for r in token_rows(2, seed=7)],
        fraction=0.5,
        layers="all",
        **PINNED,
    )
    influence = InfluenceLoggingCallback(
        queries=[{"input_ids": r} for r in token_rows(2, seed=9)],
        method="graddot",
        layers="all",
        report_dir=str(tmp_path / "report"),
    )
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(tmp_path / "out", max_steps=STEPS, per_device_train_batch_size=4),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(4 * STEPS)]),
        data_collator=pad_rows,
        callbacks=[influence, selection] if influence_first else [selection, influence],
    )
    trainer.train()

    kept = {h.step: set(h.example_ids[~h.dropped].tolist()) for h in selection.history}
    dropped = {i for h in selection.history for i in h.summary()["dropped_ids"]}
    assert len(dropped) == 2 * STEPS
    history = influence.influence_log.history
    assert {h.step: set(h.example_ids.tolist()) for h in history} == kept
    for h in history:
        torch.testing.assert_close(h.mean, h.scores.mean(0))
        torch.testing.assert_close(h.max, h.scores.amax(0))
    report = json.loads((tmp_path / "report" / "influence.json").read_text())
    assert {e["id"] for e in report["cumulative"]} == set().union(*kept.values())


def in_order(rows: list[dict[str, list[int]]], tmp_path: Path, *callbacks: TrainerCallback) -> None:
    """Train :data:`STEPS` steps of 4 rows on ``rows`` in their order (no shuffle)."""
    Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(
            tmp_path / "out",
            max_steps=STEPS,
            per_device_train_batch_size=4,
            train_sampling_strategy="sequential",
        ),
        train_dataset=Dataset.from_list(rows),
        data_collator=pad_rows,
        callbacks=list(callbacks),
    ).train()


def test_influence_credits_the_copy_of_a_duplicated_row_that_trained(tmp_path: Path) -> None:
    """Two copies of one row in a step share its content-hash id; when the selection drops
    one copy (a tie broken by order) and keeps the other, the kept copy trained: the step's
    influence covers exactly the kept rows, copies included, not the kept ids less every
    id dropped once."""
    rows = [row for row in token_rows(2 * STEPS) for _ in range(2)]  # [a, a, b, b, ...]
    selection = DataSelectionCallback(
        target=[{"input_ids": r} for r in token_rows(2, seed=7)],
        rule="bottom_fraction",
        score="dot",
        fraction=0.25,
        layers="all",
        refresh_every=1,
    )
    influence = InfluenceLoggingCallback(
        queries=[{"input_ids": r} for r in token_rows(2, seed=9)],
        method="graddot",
        layers="all",
    )
    in_order([{"input_ids": r} for r in rows], tmp_path, selection, influence)

    kept = {h.step: sorted(h.example_ids[~h.dropped].tolist()) for h in selection.history}
    split = [
        h.step
        for h in selection.history
        if set(h.example_ids[h.dropped].tolist()) & set(h.example_ids[~h.dropped].tolist())
    ]
    assert split, "vacuous: no step dropped one copy of a row and kept the other"
    credited = {h.step: sorted(h.example_ids.tolist()) for h in influence.influence_log.history}
    assert credited == kept


def test_gradcos_influence_numbers_copies_as_the_selection_does(tmp_path: Path) -> None:
    """Two rows of one content hash in a step, the first with no loss token (every label
    -100: no gradient, no cosine) and the second trained. Under gradcos the scoreless copy
    used to leave the step's rows before they were matched to the selection's, which
    numbers every row: dropping the trained copy left it credited, and dropping the
    scoreless one took the trained copy's credit away. The step's influence covers
    exactly the kept rows that have a gradient."""
    rows = []
    for row in token_rows(4 * STEPS, seed=3)[: 2 * STEPS]:
        rows.append({"input_ids": row, "labels": [-100] * len(row)})  # no loss token
        rows.append({"input_ids": row, "labels": list(row)})
    for row in token_rows(2 * STEPS, seed=5):
        rows.append({"input_ids": row, "labels": list(row)})
    order = [
        rows[2 * s : 2 * s + 2] + rows[4 * STEPS + 2 * s : 4 * STEPS + 2 * s + 2]
        for s in range(STEPS)
    ]
    selection = DataSelectionCallback(
        target=[{"input_ids": r} for r in token_rows(2, seed=7)],
        score="loss",
        rule="random",
        fraction=0.5,
        seed=1,
        layers="all",
    )
    influence = InfluenceLoggingCallback(
        queries=[{"input_ids": r} for r in token_rows(2, seed=9)],
        method="gradcos",
        layers="all",
    )
    in_order([row for step in order for row in step], tmp_path, selection, influence)

    trained = [[row["labels"][1] != -100 for row in step] for step in order]
    expected = {
        h.step: sorted(
            i
            for i, dropped, has_loss in zip(
                h.example_ids.tolist(), h.dropped.tolist(), trained[h.step], strict=True
            )
            if not dropped and has_loss
        )
        for h in selection.history
    }
    split = [h.step for h in selection.history if int(h.dropped[:2].sum()) == 1]
    assert split, "vacuous: no step dropped one copy and kept the other"
    credited = {h.step: sorted(h.example_ids.tolist()) for h in influence.influence_log.history}
    assert credited == {step: ids for step, ids in expected.items() if ids}
