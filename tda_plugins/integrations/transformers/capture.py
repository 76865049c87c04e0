"""``GradientCaptureCallback``: add it to ``Trainer``/``SFTTrainer`` and the run records.

    trainer = Trainer(..., callbacks=[GradientCaptureCallback(store_dir="run/grads")])

No trainer subclass, no patched optimizer, no extra dataset column: the callback hooks the
model at ``on_train_begin``, commits each optimizer step's per-example gradients at
``on_pre_optimizer_step`` (after every micro-batch's backward), records the step's
trajectory at ``on_optimizer_step`` with ``record_trajectory`` (before the scheduler moves
the learning rate on), saves what a resumed run
needs as soon as the trainer decides to checkpoint (``control.should_save`` at
``on_step_end``/``on_epoch_end``, before it writes the checkpoint; again at ``on_save``,
where that finds it done), and finishes at ``on_train_end`` (where a run whose trainer
restored its best checkpoint, ``load_best_model_at_end``, ends the store at that
checkpoint: :mod:`~tda_plugins.integrations.transformers.best_model`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import TrainerControl, TrainerState, TrainingArguments

from tda_plugins.integrations.transformers.best_model import (
    end_at_checkpoint,
    restored_checkpoint,
)
from tda_plugins.integrations.transformers.data import LossTokens
from tda_plugins.integrations.transformers.meeting import withdraw
from tda_plugins.integrations.transformers.normalization import CausalLMNormalization
from tda_plugins.integrations.transformers.setup import (
    CheckedCallback,
    TrainStart,
    adapt_settings,
    checkpoint_folder,
    process_index,
    unwrap_optimizer,
)
from tda_plugins.precondition.adam import AdamMoments
from tda_plugins.session.capture import CaptureSession
from tda_plugins.session.settings import CaptureSettings, settings_from
from tda_plugins.store.layout import LOSS_TOKENS


class GradientCaptureCallback(CheckedCallback):
    """Writes every step's exact per-example gradients (and K-FAC statistics) to a store.

    Configure with a :class:`~tda_plugins.session.settings.CaptureSettings` or flat
    options as keywords (``store_dir`` is required). Stored gradients follow the store convention:
    each example's own summed token loss, whatever normalization the trainer uses
    (``num_items_in_batch``, accumulation, world size). Works unchanged with TRL's
    ``SFTTrainer`` and with PEFT LoRA models (default layers: the LoRA adapters).
    Resuming with ``resume_from_checkpoint`` continues the store at the checkpoint's step.
    Under DDP and FSDP2 (``fully_shard``, HSDP) each rank writes its own examples to
    ``rank-<r>/`` of the store; at the end every rank takes part in gathering the sharded
    Adam moments, which rank 0 writes.
    """

    def __init__(self, settings: CaptureSettings | None = None, **options: Any):
        self.settings = settings_from(settings, options)
        self.session: CaptureSession | None = None

    def begin(self, start: TrainStart) -> None:
        self.session = CaptureSession(
            dataclasses.replace(
                self.settings, layers=adapt_settings(self.settings.layers, start.args, start.model)
            ),
            model=start.model,
            normalization=CausalLMNormalization(),
            rank=process_index(start.args),
            start_step=start.state.global_step,
            tokenizer=start.tokenizer,
            optimizer=start.optimizer,
            max_grad_norm=start.args.max_grad_norm,
            # which tokens carry each row's loss, for queries captured like this store
            metadata={LOSS_TOKENS: LossTokens.of_trainer(start.args).as_json()},
        )

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:
            self.session.step()

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:  # before the scheduler moves the learning rate on
            self.session.after_optimizer_step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:
            self.session.finish_step()
            if control.should_save:  # before the trainer writes the checkpoint of this step
                self.session.save_checkpoint(state.global_step)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None and control.should_save:
            self.session.save_checkpoint(state.global_step)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:
            self.session.save_checkpoint(
                state.global_step, checkpoint_folder(args, state.global_step)
            )
            self.session.drop_deleted_checkpoints()  # the trainer has rotated its checkpoints

    def abort(self) -> bool:
        session, self.session = self.session, None
        if session is not None:
            session.engine.detach()  # the store keeps its committed steps
        return session is not None

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        withdraw(kwargs.get("model"), self.abort)
        if self.session is not None:
            optimizer = unwrap_optimizer(kwargs.get("optimizer"))
            moments: AdamMoments | None = optimizer
            restored = restored_checkpoint(args, state)
            if restored is not None:  # load_best_model_at_end put earlier weights back
                moments = end_at_checkpoint(self.session, restored, optimizer, state.global_step)
            self.session.end(moments)
            self.session = None
