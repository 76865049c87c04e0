"""Peer workload (4): capture overhead during training, ours against the peers' hooks.

The same HF ``Trainer`` loop and model as ``benchmarks/training_overhead.py``
(Llama-architecture, PEFT LoRA r=8 on every linear layer but the head, batch 8, AdamW),
each library capturing factor-projected per-example gradients of every LoRA adapter
(k = 16 per side, or the nearest it offers) to local disk during the training backward:

* ``plain``: the ``Trainer`` alone;
* ``ours``: ``GradientCaptureCallback(layers="lora", projection="factor", k_a=k_g=16)``,
  a crash-safe store committed at every step;
* ``ours + K-FAC``: the same with ``curvature=True`` (inline K-FAC statistics of the
  projected factors), the attribution-ready configuration of training_overhead.py;
* ``bergson``: its ``GradientCollectorCallback`` (``projection_dim=16``: a 16 x 16 random
  projection per module, fp16 memmap), ``use_optimizer_state=False``;
* ``dattri-llm``: its ``HookManager`` (``linear_io`` on the adapters, "logra" factor
  projection ``proj_dim=16``) around ``trainer.train()``, with an ``OffloadCallback``
  writing per-sample records to disk at every step;
* ``logix``: recorded with the reason (its Trainer integration is no capture inside a
  training run).

Short ``train()`` runs of every way alternate (order rotated each round) on identical
model copies; each step is timed ``on_step_begin`` -> ``on_step_end`` by a callback placed
first (the library's per-step writes included), the first step of each run discarded.
Ratio = median step / median plain step; the issue's target is our capture overhead
(ratio - 1) below every peer's.

Run it in the peers' venv (``make bench`` installs it); where a peer is not installed its
row says so and ours still run (``--quick`` is the CI smoke).
"""

from __future__ import annotations

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
from transformers import PrinterCallback, Trainer

from tda_plugins.integrations.transformers import GradientCaptureCallback
from tda_plugins.store import StoreReader

SECTION = "## Peer comparison: capture overhead in training (benchmarks/peer_capture.py)"
SCRIPT = "benchmarks/peer_capture.py"
LABEL = "LoRA r=8, projected per-example gradients to disk"


@dataclass(frozen=True)
class Run:
    """What every way's runs share: the rows of one run and ``k``."""

    rows: Tensor
    k: int

    def folder(self, name: str, args: Any) -> Path:
        """A new output folder of this way for the run whose ``TrainingArguments`` are
        ``args`` (each run writes afresh)."""
        return Path(args.output_dir) / name.replace(" ", "_")


class Plain(training.TrainingWay):
    name = training.PLAIN
    note = "the Trainer alone"

    def __init__(self, run: Run):
        self.run = run

    def train(self, model: nn.Module, args: Any, timer: common.StepTimer) -> None:
        common.make_trainer(model, self.run.rows, args, [timer]).train()


class Ours(training.TrainingWay):
    name = training.OURS
    note = (
        '`GradientCaptureCallback(layers="lora", projection="factor", k_a=16, k_g=16)`: '
        "a crash-safe store (fp32 safetensors shards) committed at every step"
    )
    ours = True
    curvature = False

    def __init__(self, run: Run):
        self.run = run

    def train(self, model: nn.Module, args: Any, timer: common.StepTimer) -> None:
        store = self.run.folder(self.name, args)
        capture = GradientCaptureCallback(
            store_dir=str(store),
            layers="lora",
            projection="factor",
            k_a=self.run.k,
            k_g=self.run.k,
            curvature=self.curvature,
        )
        common.make_trainer(model, self.run.rows, args, [timer, capture]).train()
        steps = args.max_steps
        if StoreReader(store).steps != list(range(steps)):
            raise RuntimeError(f"{self.name} did not commit all {steps} steps to {store}")


class OursCurvature(Ours):
    name = "ours + K-FAC"
    note = "the same with `curvature=True` (inline K-FAC statistics of the projected factors)"
    curvature = True


class Bergson(training.TrainingWay):
    name = "bergson"
    note = (
        "`GradientCollectorCallback(projection_dim=16, use_optimizer_state=False)` after "
        "`prepare_for_gradient_collection(trainer)`: a 16 x 16 random projection per "
        "module, an fp16 memmap written at every step; its train set must be a "
        "`datasets.Dataset`"
    )

    def __init__(self, run: Run):
        try:
            import datasets
            from bergson.huggingface import (
                GradientCollectorCallback,
                prepare_for_gradient_collection,
            )
        except ImportError as e:
            raise training.not_installed("bergson", e) from e
        self.run = run
        self.callback, self.prepare = GradientCollectorCallback, prepare_for_gradient_collection
        datasets.disable_progress_bars()
        self.dataset = datasets.Dataset.from_dict({"input_ids": run.rows.tolist()})

    def train(self, model: nn.Module, args: Any, timer: common.StepTimer) -> None:
        out = self.run.folder(self.name, args)
        callback = self.callback(out, projection_dim=self.run.k, use_optimizer_state=False)
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=self.dataset,
            data_collator=_collate_lists,
            callbacks=[timer, callback],
        )
        trainer.remove_callback(PrinterCallback)
        self.prepare(trainer).train()
        if not (out / "train" / "epoch_0" / "gradients.bin").exists():
            raise RuntimeError(f"bergson wrote no gradients under {out}")


def _collate_lists(features: list[dict[str, Any]]) -> dict[str, Tensor]:
    """The causal-LM batch of ``common.collate_rows`` from ``datasets`` rows (lists)."""
    return common.collate_rows([{"input_ids": torch.as_tensor(f["input_ids"])} for f in features])


class DattriLLM(training.TrainingWay):
    name = "dattri-llm"
    note = (
        '`HookManager(linear_io=<the adapters>, projection "logra", proj_dim=16)` around '
        "`trainer.train()` with `OffloadCallback(offload_interval=1, recording_type="
        '"per_sample")` into a `GradientStorageManager` (memmap on disk)'
    )

    def __init__(self, run: Run):
        try:
            from dattri_llm import HookManagerConfig
            from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
            from dattri_llm.gradient.hooks import HookManager
            from dattri_llm.gradient.storage_manager import GradientStorageManager
        except ImportError as e:
            raise training.not_installed("dattri-llm", e) from e
        self.run = run
        self.manager, self.offload, self.storage = (
            HookManager,
            OffloadCallback,
            GradientStorageManager,
        )
        projection = {"style": "logra", "proj_dim": run.k, "proj_type": "rademacher"}
        projection |= {"proj_seed": 0, "proj_max_batch_size": 32}
        self.config = HookManagerConfig(
            linear_io=[r"lora_[AB]\.default$"],
            projection_kwargs={"__default__": projection},
        )

    def train(self, model: nn.Module, args: Any, timer: common.StepTimer) -> None:
        out = self.run.folder(self.name, args)
        offload = self.offload(
            offload_interval=1, file_manager=self.storage(str(out)), recording_type="per_sample"
        )
        manager = self.manager(model, config=self.config, callbacks=[offload])
        with manager.collect(deregister_on_exit=True):
            common.make_trainer(model, self.run.rows, args, [timer]).train()
        written = list(out.glob("*.bin"))
        if len(written) != args.max_steps:
            raise RuntimeError(f"dattri-llm wrote {len(written)} of {args.max_steps} steps")


class LogIX(training.TrainingWay):
    name = "logix"
    note = (
        "not run: logix-ai 0.1.1's Trainer integration (`logix.huggingface.patch_trainer`) "
        "turns `Trainer.train()` into its own extraction pass (epochs set by its scheduler, "
        "the optimizer step skipped), so there is no training run whose overhead it adds "
        "to; its LoGra projection goes through `add_lora`, which changes the model"
    )

    def __init__(self, run: Run):
        raise training.Unavailable(self.note.removeprefix("not run: "))

    def train(self, model: nn.Module, args: Any, timer: common.StepTimer) -> None:
        raise training.Unavailable(self.note)


#: The ways compared, in table order; each is built as ``way(run)``.
WAYS = (Plain, Ours, OursCurvature, Bergson, DattriLLM, LogIX)


def measure(
    options: training.RunOptions, k: int, work: Path
) -> tuple[training.ModeResult, list[float]]:
    """Alternating runs of every available library on identical LoRA copies."""
    vocab, steps = options.vocab, options.steps_per_run
    run = Run(workload.step_rows(vocab, steps=steps, batch=options.batch, seq=options.seq), k)
    ways: dict[str, type[training.TrainingWay]] = {way.name: way for way in WAYS}
    base = workload.trainer_llama(options.model, seq=options.seq)

    def args_for(name: str, round_: int) -> Any:
        out = work / f"{name}-{round_}".replace(" ", "_")
        return common.training_args(out, options.steps_per_run, options.batch)

    return training.run_mode(
        LABEL,
        ways,
        lambda way: way(run),
        lambda: workload.lora_copy(base),
        args_for,
        options.runs,
        1,
    )


def report(
    result: training.ModeResult,
    loads: list[float],
    options: training.RunOptions,
    k: int,
    argv: Sequence[str],
) -> str:
    """The markdown section for the results file."""
    setup = (
        " with PEFT LoRA r=8 on every linear layer but the head; each "
        f"library captures factor-projected (k = {k}) per-example gradients of every "
        "adapter to local disk inside the training backward."
    )
    head = common.heading(SECTION, SCRIPT, argv, loads)
    return training.section(head, setup, options, WAYS, [result], "target (4): ours below")


# -- command line ----------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> tuple[training.RunOptions, int]:
    """Parse and validate the command line: the run options and ``k``."""
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=16, help="factor projection k_a = k_g")
    training.RunOptions.add_arguments(p, seq=256)
    a = p.parse_args(argv)
    if a.k < 1:
        p.error("--k must be >= 1")
    return training.RunOptions.parsed(p, a, seq=256, model=workload.TRAINING_LLAMA), a.k


def main(argv: Sequence[str]) -> training.ModeResult:
    """Run the comparison, print the table and the command, update the results file."""
    options, k = parse_args(argv)
    common.quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="tda-peer-capture-") as work:
        result, loads = measure(options, k, Path(work))
    text = report(result, loads, options, k, argv)
    common.publish(text, SECTION, options.results, options.write)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
