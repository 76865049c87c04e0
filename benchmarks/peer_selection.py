"""Peer workload (5): online data selection step time, ours against dattri-llm's callback.

The same HF ``Trainer`` loop, model and batches as ``benchmarks/selection_overhead.py``
(Llama-architecture, batch 8 x 128 tokens, AdamW, ``max_grad_norm=1.0``), in three ways:

* ``plain``: the ``Trainer`` alone;
* ``ours``: ``DataSelectionCallback(pool, rule="bottom_fraction", fraction=0.25,
  score="dot", target_examples=1)``;
* ``dattri-llm``: its ``HookManager`` around ``trainer.train()`` with its
  ``DataSelectionCallback(target="val_loader")``, one pool example per step as the target
  (its paper's protocol), ``threshold_mode="bottom_fraction"`` 0.25, ghost scores,
  ``renormalize=True`` (the closest to our token renormalization).

Both drop the bottom quarter of each step's 8 examples by their gradient's dot with one
target example's gradient (one of a 16-sequence pool in turn), and remove the dropped
contributions from ``.grad`` before the optimizer step: LoRA (selection over the
adapters) and full fine-tuning (every trainable parameter). Short ``train()`` runs of the
three alternate (order rotated each round) on identical model copies; each step is timed
``on_step_begin`` -> ``on_step_end`` by a callback placed first, the first step of a run
discarded. Ratio = median step / median plain step of the same mode; the issue's target
is our selection overhead (ratio - 1) below dattri-llm's.

Run it in the peers' venv (``make bench`` installs it); where dattri-llm is not installed
its rows say so and ours still run (``--quick`` is the CI smoke).
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import torch
from peers import training, workload
from torch import Tensor, nn
from transformers import TrainerCallback

from tda_plugins.integrations.transformers import DataSelectionCallback

SECTION = "## Peer comparison: online data selection (benchmarks/peer_selection.py)"
SCRIPT = "benchmarks/peer_selection.py"
FRACTION = 0.25


@dataclass(frozen=True)
class Settings:
    """Resolved command-line settings: the shared run options, the modes and the pool."""

    run: training.RunOptions
    modes: tuple[str, ...]
    pool: int


@dataclass(frozen=True)
class Data:
    """The training rows of one run and the target pool (token ids)."""

    rows: Tensor
    pool: list[list[int]]
    steps: int


class Plain(training.TrainingWay):
    name = training.PLAIN
    note = "the Trainer alone"

    def __init__(self, mode: workload.Mode, data: Data):
        self.data = data

    def train(self, model: nn.Module, args: Any, timer: common.StepTimer) -> None:
        common.make_trainer(model, self.data.rows, args, [timer]).train()


class Ours(training.TrainingWay):
    name = training.OURS
    ours = True
    note = (
        f'`DataSelectionCallback(pool, rule="bottom_fraction", fraction={FRACTION}, '
        'score="dot", target_examples=1)`'
        ' (full fine-tuning: `layers="all"`)'
    )

    def __init__(self, mode: workload.Mode, data: Data):
        self.mode, self.data = mode, data

    def train(self, model: nn.Module, args: Any, timer: common.StepTimer) -> None:
        selection = DataSelectionCallback(
            [{"input_ids": ids} for ids in self.data.pool],
            rule="bottom_fraction",  # pinned: the library's defaults are step_cosine, adam
            fraction=FRACTION,
            score="dot",
            target_examples=1,
            **self.mode.layers,
        )
        common.make_trainer(model, self.data.rows, args, [timer, selection]).train()
        _check_steps(self.name, len(selection.history), self.data.steps)


class DattriLLM(training.TrainingWay):
    name = "dattri-llm"
    note = (
        '`HookManager` + `DataSelectionCallback(target="val_loader")`, one pool example '
        f'per step, `threshold_mode="bottom_fraction"` {FRACTION}, ghost scores, '
        "`renormalize=True`; LoRA: `linear_io` on the adapters; full fine-tuning: its "
        "default (`linear_io` on every linear layer, `param_grad` for the rest)"
    )

    def __init__(self, mode: workload.Mode, data: Data):
        try:
            from dattri_llm import HookManagerConfig
            from dattri_llm.gradient.callbacks.data_selection_callback import (
                DataSelectionCallback as DattriSelection,
            )
            from dattri_llm.gradient.hooks import HookManager
        except ImportError as e:
            raise training.not_installed("dattri-llm", e) from e
        self.manager, self.selection, self.data = HookManager, DattriSelection, data
        adapters = [r"lora_[AB]\.default$"] if mode.lora_rank is not None else None
        self.config = HookManagerConfig(linear_io=adapters)

    def train(self, model: nn.Module, args: Any, timer: common.StepTimer) -> None:
        pool = self.data.pool
        batches = [{"input_ids": torch.tensor([i]), "labels": torch.tensor([i])} for i in pool]
        selection = self.selection(
            model,
            target="val_loader",
            val_loader=itertools.cycle(batches),
            val_loss_fn=lambda m, batch: m(**batch).loss,
            renormalize=True,
            selection_kwargs={"threshold": FRACTION, "threshold_mode": "bottom_fraction"},
        )
        counter = _DropCounter(selection)
        manager = self.manager(model, config=self.config, callbacks=[selection])
        with manager.collect(deregister_on_exit=True):
            common.make_trainer(model, self.data.rows, args, [timer, counter]).train()
        _check_steps(self.name, counter.selected, self.data.steps)


#: The ways compared, in table order; each is built as ``way(mode, data)``.
WAYS = (Plain, Ours, DattriLLM)


class _DropCounter(TrainerCallback):
    """Counts the optimizer steps after which dattri-llm's callback had dropped examples."""

    def __init__(self, selection: Any):
        self.selection, self.selected = selection, 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        dropped = getattr(self.selection, "last_dropped", None)
        self.selected += int(dropped is not None and len(dropped) > 0)
        self.selection.last_dropped = None


def _check_steps(name: str, selected: int, steps: int) -> None:
    if selected != steps:
        raise RuntimeError(f"{name} selected at {selected} of {steps} steps")


def measure(
    mode: workload.Mode, settings: Settings, base: nn.Module, work: Path
) -> tuple[training.ModeResult, list[float]]:
    """Alternating runs of every available library on identical copies of ``base``."""
    run = settings.run
    vocab = run.vocab
    steps = run.steps_per_run
    data = Data(
        workload.step_rows(vocab, steps=steps, batch=run.batch, seq=run.seq),
        common.token_rows(settings.pool, run.seq, vocab, seed=3).tolist(),
        steps,
    )
    ways: dict[str, type[training.TrainingWay]] = {way.name: way for way in WAYS}

    def args_for(name: str, round_: int) -> Any:
        return common.training_args(work / f"{mode.name}-{name}-{round_}", steps, run.batch)

    return training.run_mode(
        mode.label,
        ways,
        lambda way: way(mode, data),
        lambda: mode.copy(base),
        args_for,
        run.runs,
        warmup=1,
    )


def report(
    results: list[training.ModeResult], loads: list[float], settings: Settings, argv: Sequence[str]
) -> str:
    """The markdown section for the results file."""
    setup = (
        f"; a target pool of {settings.pool} sequences, each step's "
        f"target one of them in turn; the bottom {FRACTION:.0%} of each step's examples "
        "dropped and removed from `.grad`."
    )
    head = common.heading(SECTION, SCRIPT, argv, loads)
    return training.section(head, setup, settings.run, WAYS, results, "target (5): ours below")


# -- command line ----------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> Settings:
    """Parse and validate the command line into :class:`Settings`."""
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=[*workload.MODES, "both"], default="both")
    p.add_argument("--pool", type=int, default=16, help="target pool size")
    training.RunOptions.add_arguments(p, seq=128)
    a = p.parse_args(argv)
    if a.pool < 1:
        p.error("--pool must be >= 1")
    modes = tuple(workload.MODES) if a.mode == "both" else (a.mode,)
    return Settings(
        training.RunOptions.parsed(p, a, seq=128, model=workload.SELECTION_LLAMA), modes, a.pool
    )


def main(argv: Sequence[str]) -> list[training.ModeResult]:
    """Run the comparison, print the table and the command, update the results file."""
    settings = parse_args(argv)
    common.quiet_transformers()
    base = workload.trainer_llama(settings.run.model, seq=settings.run.seq)
    with tempfile.TemporaryDirectory(prefix="tda-peer-select-") as work:
        results, loads = training.each_mode(
            settings.modes, lambda mode: measure(mode, settings, base, Path(work))
        )
    run = settings.run
    common.publish(report(results, loads, settings, argv), SECTION, run.results, run.write)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
