"""transformers ``TrainerCallback``s: add one to ``Trainer``/``SFTTrainer`` and the run records.

    trainer = Trainer(..., callbacks=[GradientCaptureCallback(store_dir="run/grads")])

No trainer subclass, no patched optimizer, no extra dataset column: the callback hooks the
model at ``on_train_begin``, commits each optimizer step's per-example gradients at
``on_pre_optimizer_step`` (after every micro-batch's backward), saves what a resumed run
needs at ``on_save``, and finishes at ``on_train_end``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from tda_plugins.integrations.transformers.normalization import CausalLMNormalization
from tda_plugins.session import CaptureSession, CaptureSettings


class UnsupportedTrainingSetup(ValueError):
    """The trainer is configured in a way that per-example capture cannot follow."""


def check_trainer_setup(args: TrainingArguments, model: nn.Module | None) -> nn.Module:
    """Refuse, before any step runs, what would make per-example gradients wrong."""
    if model is None:
        raise UnsupportedTrainingSetup("the trainer passed no model to the callback")
    if getattr(args, "packing", False):
        raise UnsupportedTrainingSetup(
            "packing=True concatenates several examples into one sequence, so gradients can no "
            "longer be split per example; set packing=False in SFTConfig"
        )
    if getattr(args, "padding_free", False):
        raise UnsupportedTrainingSetup(
            "padding_free=True flattens the batch into one sequence; set padding_free=False"
        )
    if getattr(args, "deepspeed", None):
        raise UnsupportedTrainingSetup(
            "DeepSpeed partitions parameters outside module hooks; train without deepspeed"
        )
    if type(model).__name__ == "OptimizedModule":
        raise UnsupportedTrainingSetup(
            "the model is torch.compile'd, which bypasses module hooks; pass the uncompiled model"
        )
    return model


def _process_index(args: TrainingArguments) -> int:
    return int(getattr(args, "process_index", 0))


def checkpoint_dir(args: TrainingArguments, state: TrainerState) -> Path:
    """The folder ``Trainer`` saves the checkpoint of ``state.global_step`` to."""
    return Path(str(args.output_dir)) / f"checkpoint-{state.global_step}"


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _settings(settings: CaptureSettings | None, options: dict[str, Any]) -> CaptureSettings:
    if settings is not None and options:
        raise TypeError("pass either a CaptureSettings or keyword options, not both")
    if settings is not None:
        return settings
    known = {f.name for f in dataclasses.fields(CaptureSettings)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown capture options {unknown}; known: {sorted(known)}")
    return CaptureSettings(**options)


class GradientCaptureCallback(TrainerCallback):
    """Writes every step's exact per-example gradients (and K-FAC statistics) to a store.

    Configure with a :class:`~tda_plugins.session.CaptureSettings` or its fields as
    keywords (``store_dir`` is required). Stored gradients follow the store convention:
    each example's own summed token loss, whatever normalization the trainer uses
    (``num_items_in_batch``, accumulation, world size). Works unchanged with TRL's
    ``SFTTrainer`` and with PEFT LoRA models (default layers: the LoRA adapters).
    Resuming with ``resume_from_checkpoint`` continues the store at the checkpoint's step.
    """

    def __init__(self, settings: CaptureSettings | None = None, **options: Any):
        self.settings = _settings(settings, options)
        self.session: CaptureSession | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        model = check_trainer_setup(args, model)
        resume = checkpoint_dir(args, state) if state.global_step > 0 else None
        self.session = CaptureSession(
            self.settings,
            model,
            CausalLMNormalization(),
            rank=_process_index(args),
            start_step=state.global_step,
            resume_from=resume,
        )

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:
            self.session.step()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:
            self.session.save_checkpoint(checkpoint_dir(args, state))

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.session is not None:
            self.session.end(unwrap_optimizer(optimizer))
            self.session = None
