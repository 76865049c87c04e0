"""Real ``Trainer`` runs that go wrong: poisoned examples and targets under data selection,
a crafted store index and a crash around a checkpoint under capture.

A poisoned example is one whose forward pass produces NaN (a hook on the embedding
writes NaN into the rows of sequences holding :data:`POISON`), so its per-example
gradient is NaN while every other example's stays finite, as with a numerically broken
example in real data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from torch import Tensor, nn
from transformers import Trainer, TrainerCallback

from tda_plugins import LayerSelection
from tda_plugins.capture.identity import content_hash
from tda_plugins.data_selection import SelectionError
from tda_plugins.integrations.transformers import DataSelectionCallback, GradientCaptureCallback
from tda_plugins.methods import method_by_name
from tda_plugins.store import StoreError, StoreReader
from tda_plugins.store.layout import rank_dir
from tests.models import VOCAB, tiny_causal_lm
from tests.selection_helpers import PINNED
from tests.stores import capture_store
from tests.trainers import WeightSnapshots, pad_rows, token_rows, training_args

POISON = VOCAB - 1


def poisoned_llama() -> nn.Module:
    """The tiny fp32 Llama whose forward is NaN for any sequence holding ``POISON``."""
    model = tiny_causal_lm("llama", torch.float32)

    def poison(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        bad = (args[0] == POISON).any(dim=1)
        return output.masked_fill(bad[:, None, None], float("nan"))

    model.get_input_embeddings().register_forward_hook(poison)
    return model


def clean_rows(count: int, seed: int = 0) -> list[list[int]]:
    return [[t for t in row if t != POISON] for row in token_rows(count, seed)]


def selection(**options: Any) -> DataSelectionCallback:
    target = [{"input_ids": r} for r in clean_rows(2, seed=7)]
    return DataSelectionCallback(
        target=target, layers="all", **{**PINNED, "fraction": 0.25, **options}
    )


def train(
    tmp: Path, rows: list[list[int]], callbacks: list[TrainerCallback], **args: Any
) -> Trainer:
    """Train without shuffling (steps see the rows in order) with ``callbacks``."""
    options = {"max_steps": len(rows) // 2, "per_device_train_batch_size": 2, **args}
    trainer = Trainer(
        model=poisoned_llama(),
        args=training_args(tmp / "out", **options),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in rows]),
        data_collator=pad_rows,
        callbacks=callbacks,
    )
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(
        trainer.train_dataset
    )
    return trainer


def weights_finite(model: nn.Module) -> bool:
    return all(bool(p.isfinite().all()) for p in model.parameters())


def strict_json_lines(path: Path) -> list[dict[str, Any]]:
    def refuse(token: str) -> None:
        raise ValueError(f"{path} holds {token}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_a_poisoned_example_is_dropped_and_the_weights_stay_finite(tmp_path: Path) -> None:
    """The NaN example is dropped at its step (whatever the rule says of a NaN), the step's
    ``.grad`` is rebuilt from the other examples, and the log names it."""
    rows = clean_rows(8)
    rows[3] = [*rows[3][:-1], POISON]  # the second example of step 1
    selector = selection(rule="threshold", threshold=-1e30)  # drops no finite example
    trainer = train(tmp_path, rows, [selector])
    trainer.train()
    assert weights_finite(trainer.model)
    poisoned = int(content_hash(torch.tensor([rows[3]]))[0])
    step = selector.history[1]
    assert step.nonfinite.tolist() == [False, True] and step.dropped.tolist() == [False, True]
    assert not step.skipped
    assert all(not bool(h.dropped.any()) for i, h in enumerate(selector.history) if i != 1)
    logged = strict_json_lines(tmp_path / "out" / "selection.jsonl")
    assert logged[1]["nonfinite_ids"] == [poisoned] and logged[1]["dropped_ids"] == [poisoned]


def test_a_step_of_only_poisoned_examples_is_skipped(tmp_path: Path) -> None:
    """No finite example left: the step is skipped (no ``.grad``), the weights are those
    before it, and training goes on."""
    rows = clean_rows(6)
    rows[0], rows[1] = [*rows[0][:-1], POISON], [*rows[1][:-1], POISON]
    selector, snapshots = selection(), WeightSnapshots()
    trainer = train(tmp_path, rows, [snapshots, selector])
    trainer.train()
    assert selector.history[0].skipped and not selector.history[1].skipped
    before, after = snapshots.weights[0], snapshots.weights[1]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not all(torch.equal(after[k], snapshots.weights[2][k]) for k in after)
    assert weights_finite(trainer.model)


BAD_TARGETS = {
    "no loss token": (
        [{"input_ids": [3, 4, 5], "labels": [-100] * 3}, {"input_ids": [7]}],
        ValueError,
        r"target:1: has no loss token",
    ),
    "non-finite gradient": (
        [{"input_ids": [*clean_rows(1, seed=7)[0], POISON]}],
        SelectionError,
        r"examples \[0\].*non-finite gradient",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TARGETS))
def test_a_bad_target_is_an_error_at_its_refresh_before_any_update(
    case: str, tmp_path: Path
) -> None:
    """A target without a loss token, or with a NaN gradient, would score every example 0
    or NaN and drop by position: refused at the first refresh, naming the pool's row (its
    line, as the pool reads it) or positions, before any weight changes."""
    target, error, message = BAD_TARGETS[case]
    trainer = train(
        tmp_path, clean_rows(4), [DataSelectionCallback(target=target, layers="all", **PINNED)]
    )
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(error, match=message):
        trainer.train()
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in initial.items())


# -- capture ------------------------------------------------------------------------------------


class CrashOnSave(TrainerCallback):
    """Stands for a crash after the trainer wrote a checkpoint and before the capture
    callback's ``on_save`` ran (placed before it)."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        raise RuntimeError("crash after the checkpoint was written")


class CrashAtStep(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def capture_run(
    tmp: Path, before: list[TrainerCallback], resume: str | None = None, **capture: Any
) -> Trainer:
    rows = clean_rows(8)
    callback = GradientCaptureCallback(store_dir=str(tmp / "store"), **{"layers": "all", **capture})
    trainer = train(tmp, rows, [*before, callback], save_strategy="steps", save_steps=2)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_a_crash_between_checkpoint_and_on_save_leaves_the_checkpoint_resumable(
    tmp_path: Path,
) -> None:
    with pytest.raises(RuntimeError, match="crash after the checkpoint"):
        capture_run(tmp_path, [CrashOnSave()])
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert checkpoint.is_dir()
    capture_run(tmp_path, [], resume=str(checkpoint))
    assert StoreReader(tmp_path / "store").steps == [0, 1, 2, 3]


def test_a_crafted_index_is_refused_by_a_trainer_resume_and_nothing_outside_is_removed(
    tmp_path: Path,
) -> None:
    """The issue's case: a resumed run truncates later steps; an index entry naming
    ``../../victim.txt`` used to make it delete that file."""
    capture_run(tmp_path, [])
    victim = tmp_path / "victim.txt"
    victim.write_text("not the store's")
    index = rank_dir(tmp_path / "store", 0) / "index.json"
    shards = json.loads(index.read_text())
    shards["shards"][-1]["file"] = "../../victim.txt"
    index.write_text(json.dumps(shards))
    with pytest.raises(StoreError, match=r"victim\.txt"):
        capture_run(tmp_path, [], resume=str(tmp_path / "out" / "checkpoint-2"))
    assert victim.read_text() == "not the store's"


def test_a_crashed_unresumed_run_is_attributable_with_its_saved_curvature(
    tmp_path: Path,
) -> None:
    """Statistics committed every ``curvature_save_steps`` steps: a run that dies at step 3 has
    steps 0-2 in its store and K-FAC statistics to score them with."""
    with pytest.raises(RuntimeError, match="crash at step 3"):
        capture_run(
            tmp_path, [CrashAtStep(3)], layers="linear", curvature_save_steps=2, curvature_head=True
        )
    store = StoreReader(tmp_path / "store")
    assert store.steps == [0, 1, 2]
    queries = capture_store(
        tiny_causal_lm("llama", torch.float32),
        [pad_rows([{"input_ids": r} for r in clean_rows(2, seed=9)])],
        tmp_path / "queries",
        LayerSelection("linear"),
        curvature=False,
    )
    scores = method_by_name("kfac").score(store, queries, allow_mismatch=True)
    assert scores.values.shape == (6, 2) and bool(scores.values.isfinite().all())
