"""What the transformers callbacks share: the refusals checked before step 0, the capture
settings adapted to the trainer, and small helpers (the torch optimizer inside accelerate's
wrapper, a padded causal-LM batch from rows)."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any, Self

import torch
from torch import Tensor, nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tda_plugins.capture.names import named_modules
from tda_plugins.integrations.transformers.meeting import enrol, release_stale
from tda_plugins.integrations.transformers.refusals import TRAINER_CHECKS, flattening_collator
from tda_plugins.integrations.transformers.sft import is_sft_config
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tda_plugins.session.settings import LayerSettings

logger = logging.getLogger(__name__)


def check_trainer_setup(
    args: TrainingArguments, model: nn.Module | None, collator: Any = None
) -> nn.Module:
    """Refuse, before any step runs, what would make per-example gradients wrong: every
    check of :data:`~tda_plugins.integrations.transformers.refusals.TRAINER_CHECKS`
    (mixed-example batches, DeepSpeed, FSDP1, tensor/context/expert and pipeline
    parallelism, compiled models), and a training ``collator`` that packs each batch
    into one sequence, each with its reason and way out in one line."""
    if model is None:
        raise UnsupportedTrainingSetup("the trainer passed no model to the callback")
    refusals = [check.refuse(args, model) for check in TRAINER_CHECKS]
    for refusal in [*refusals, flattening_collator(collator)]:
        if refusal is not None:
            raise UnsupportedTrainingSetup(refusal)
    return model


#: The fused loss heads :func:`fused_head` tells apart.
TRL_FUSION = "TRL's fused LM head"
LIGER_FUSION = "Liger's fused linear cross-entropy (use_liger_kernel)"

#: The way out of each fused head, for a layer it hides that the user wants captured.
_UNFUSED = {
    TRL_FUSION: "train with transformers' Trainer, which calls the head (TRL's SFTTrainer "
    "fuses it whenever the loss is its own)",
    LIGER_FUSION: "set liger_kernel_config={'fused_linear_cross_entropy': False}",
}


def fused_head(args: TrainingArguments) -> str | None:
    """What computes the loss from the LM head's weight directly, so that no module hook
    sees the head (``None``: nothing): TRL's ``SFTTrainer`` (its fused LM head, the default
    without label smoothing), or Liger's fused linear cross-entropy (``use_liger_kernel``
    in the ``Trainer``, on unless ``liger_kernel_config`` turns it off; TRL turns it off)."""
    if is_sft_config(args):
        return None if getattr(args, "label_smoothing_factor", 0) else TRL_FUSION
    config = getattr(args, "liger_kernel_config", None) or {}
    if getattr(args, "use_liger_kernel", False) and config.get("fused_linear_cross_entropy", True):
        return LIGER_FUSION
    return None


def fusion_fix(fusion: str) -> str:
    """How to get the head that ``fusion`` (a :func:`fused_head`) bypasses, and a weight
    tied to it, into the captured layers, or out of the trained ones."""
    return (
        f"{fusion} computes the loss from the head's weight without calling the head: "
        f"{_UNFUSED[fusion]}, or freeze the head and any embedding tied to it"
    )


def adapt_settings(
    settings: LayerSettings, args: TrainingArguments, model: nn.Module
) -> LayerSettings:
    """Leave out the output head where the trainer bypasses its module call and the
    selection holds it, or a layer inside it (a PEFT ``modules_to_save`` copy of the head,
    a LoRA adapter on it): logged; a LoRA run whose head has no adapter is left as it is,
    without a word."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    fusion = fused_head(args)
    if head is None or fusion is None:
        return settings
    name = next(n for n, m in named_modules(model) if m is head)
    inside = [n for n in settings.selection.resolve(model) if n == name or n.startswith(f"{name}.")]
    if not inside:
        return settings
    logger.warning(
        "tda-plugins: %s bypasses %s's forward, so its per-example gradient cannot be "
        "captured; %s left out of the captured layers (and so is a weight tied to it)",
        fusion,
        name,
        " and ".join(inside) + (" is" if len(inside) == 1 else " are"),
    )
    pattern = rf"^{re.escape(name)}(?:\..*)?$"
    given = settings.selection.exclude
    exclude = pattern if given is None else rf"(?:{given})|{pattern}"
    return dataclasses.replace(
        settings,
        selection=dataclasses.replace(settings.selection, exclude=exclude),
        uncaptured_fix=fusion_fix(fusion),
    )


def checkpoint_folder(args: TrainingArguments, step: int) -> Path:
    """The folder the trainer saves its checkpoint of ``step`` optimizer steps in.

    The one place that knows the trainer's checkpoint layout and how a callback learns
    which checkpoint a run resumed from, neither of which transformers hands callbacks:
    the trainer saves to ``<output_dir>/checkpoint-<global_step>`` (``PREFIX_CHECKPOINT_DIR``;
    a hyperparameter search's trial folders are not followed), and ``train(
    resume_from_checkpoint=True)`` resumes from the highest-numbered such folder, then sets
    ``state.global_step`` to the step saved there; a path given to ``train()`` is not
    passed on to callbacks. So a run resumed at ``global_step > 0`` resumed from
    ``args.resume_from_checkpoint`` when that field is a path, else from this folder.
    """
    return Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{step}"


def resumed_checkpoint(args: TrainingArguments, state: TrainerState) -> Path | None:
    """The checkpoint folder a run resumed from (``None``: a run from step 0); see
    :func:`checkpoint_folder`."""
    if state.global_step == 0:
        return None
    given = getattr(args, "resume_from_checkpoint", None)
    if isinstance(given, str) and given:
        return Path(given)
    return checkpoint_folder(args, state.global_step)


def process_index(args: TrainingArguments) -> int:
    return int(getattr(args, "process_index", 0))


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def pad_examples(examples: list[dict[str, Any]], pad_id: int = 0) -> dict[str, Tensor]:
    """Right-padded causal-LM batch from rows with ``input_ids`` (and optional ``labels``)."""
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[row, :n] = torch.as_tensor(e["input_ids"])
        labels[row, :n] = torch.as_tensor(e.get("labels", e["input_ids"]))
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def log_metrics(
    state: TrainerState, logs: dict[str, float] | None, metrics: dict[str, float]
) -> None:
    """Add a callback's ``metrics`` to a training-loss log entry at ``on_log``: to ``logs``
    (what ``report_to`` integrations and the console get) and to the copy the trainer
    already appended to ``state.log_history`` before the event."""
    if logs is None or not metrics or "loss" not in logs:
        return
    logs.update(metrics)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(metrics)


@dataclasses.dataclass(frozen=True)
class TrainStart:
    """What ``on_train_begin`` hands a callback of this package, the model checked.

    Attributes:
        args: the trainer's arguments.
        state: its state (``global_step`` is the resumed step).
        model: the model, past every refusal of :func:`check_trainer_setup`.
        tokenizer: the trainer's ``processing_class`` (``None`` if it has none).
        optimizer: the optimizer (accelerate's wrapper already unwrapped).
    """

    args: TrainingArguments
    state: TrainerState
    model: nn.Module
    tokenizer: Any
    optimizer: Any


class CheckedCallback(TrainerCallback):
    """Base of this package's callbacks: ``on_train_begin`` refuses an unsupported setup
    before step 0 (:func:`check_trainer_setup`) and hands the rest to :meth:`begin`."""

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        processing_class: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        loader = kwargs.get("train_dataloader")
        model = check_trainer_setup(args, model, getattr(loader, "collate_fn", None))
        release_stale(model, state)
        self.begin(TrainStart(args, state, model, processing_class, unwrap_optimizer(optimizer)))
        enrol(model, state, self.abort)

    def begin(self, start: TrainStart) -> None:
        """Set up for the run (hook the model); called once, at ``on_train_begin``."""
        raise NotImplementedError

    def abort(self) -> bool:
        """Unhook without finishing, after the run stopped with an error (found at the next
        run's start on the model: :func:`~.meeting.release_stale`); True if still hooked."""
        raise NotImplementedError


class MetricsCallback(CheckedCallback):
    """Base of the callbacks that add their metrics to the trainer's logs (influence,
    selection): :meth:`step_metrics` goes into every training-loss log entry at
    ``on_log``, and :meth:`add_to` puts the callback first in the trainer's list (the one
    place a callback edits it), so the ``report_to`` integrations after it see them."""

    def add_to(self, trainer: Any) -> Self:
        """Put this callback first in ``trainer``'s list, so ``report_to`` sees its metrics."""
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def step_metrics(self, step: int) -> dict[str, float]:
        """Metrics of optimizer step ``step`` (0-based) for the trainer's logs; none where
        the callback has none of that step's (a log never carries an earlier step's)."""
        return {}

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        log_metrics(state, logs, self.step_metrics(state.global_step - 1))
