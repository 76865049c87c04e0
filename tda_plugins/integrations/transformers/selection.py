"""``DataSelectionCallback``: online data selection for ``Trainer``/``SFTTrainer``.

The callback translates the trainer's events into a
:class:`~tda_plugins.data_selection.session.SelectionSession`: ``on_train_begin`` opens it,
``on_step_begin`` refreshes the target, ``on_pre_optimizer_step`` selects (after the last
micro-batch's backward, before the optimizer) and clips, ``on_log`` adds its metrics,
``on_train_end`` closes it. Under DDP each rank selects over the whole global batch (the
same drops as one process, see :mod:`~tda_plugins.data_selection.outcome`); on a
``fully_shard``-ed model (FSDP2) each rank edits its shard of ``.grad``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import TrainerControl, TrainerState, TrainingArguments

from tda_plugins.capture import MicroBatchRecord
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.layers import has_lora
from tda_plugins.data_selection import SelectionSession, SelectionSettings, StepSelection
from tda_plugins.data_selection.resume import (
    ScheduleStateError,
    read_state,
    warn_not_restored,
    write_state,
)
from tda_plugins.data_selection.session import DEFAULT_FIX
from tda_plugins.integrations.transformers.data import ExamplePool, Examples, LossTokens
from tda_plugins.integrations.transformers.meeting import (
    post_selection,
    withdraw,
    withdraw_selection,
)
from tda_plugins.integrations.transformers.normalization import (
    CausalLMNormalization,
    loss_tokens,
)
from tda_plugins.integrations.transformers.setup import (
    MetricsCallback,
    TrainStart,
    adapt_settings,
    checkpoint_folder,
    process_index,
    resumed_checkpoint,
)
from tda_plugins.session.batch import (
    causal_lm_example_losses,
    causal_lm_losses,
    next_token_example_losses,
)
from tda_plugins.session.settings import LayerOptions, LayerSettings

#: The way out when a step's loss is not the token mean over its global batch.
TOKEN_MEAN_FIX = (
    "a compute_loss override must pass num_items_in_batch on to super().compute_loss() "
    "(or to the model call) and return its loss unweighted; a model the Trainer passes no "
    "num_items_in_batch (accepts_loss_kwargs=False, or a custom forward without **kwargs) "
    "averages each micro-batch; several processes need average_tokens_across_devices=True "
    "(the default). A loss divided by each micro-batch's own tokens is exact only at "
    "gradient_accumulation_steps=1 in one process"
)

#: The way out when each rank divides its loss by its own tokens.
PER_RANK_FIX = (
    "average_tokens_across_devices=False makes each rank divide its loss by its own "
    "tokens: set it to True (the default)"
)


def token_mean_fix(args: TrainingArguments) -> str:
    """The way out of the selection's token-mean check
    (:mod:`~tda_plugins.data_selection.token_mean`) for this trainer's arguments."""
    per_rank = args.world_size > 1 and not getattr(args, "average_tokens_across_devices", True)
    return PER_RANK_FIX if per_rank else TOKEN_MEAN_FIX


#: The ``LayerOptions`` fields that select layers (the keyword options this callback takes).
LAYER_OPTIONS = ("layers", "include", "exclude", "last_n_blocks")


def causal_lm_token_counts(record: MicroBatchRecord) -> Tensor:
    """``(B,)`` tokens each example's causal-LM loss sums over (:func:`loss_tokens`)."""
    if record.labels is None and record.shift_labels is None:
        raise ValueError("data selection needs labels in the model call to count loss tokens")
    return loss_tokens(record.labels, record.shift_labels)


def causal_lm_output_losses(output: Any, kwargs: Mapping[str, Any]) -> Tensor:
    """``(B,)`` each example's summed next-token loss from a causal LM's output
    (``score="loss"``): TRL's fused LM head returns each label's log-probability (zero where
    ignored), a plain forward its logits, scored against the ``shift_labels`` or else the
    labels it was called with (as transformers' loss reads them)."""
    log_probs = getattr(output, "log_probs", None)
    if isinstance(log_probs, Tensor):
        return -log_probs.sum(dim=-1)
    shift_labels = kwargs.get("shift_labels")
    if isinstance(shift_labels, Tensor):
        return next_token_example_losses(output.logits, shift_labels)
    return causal_lm_example_losses(output.logits, kwargs["labels"])


def target_token_counts(batch: Mapping[str, Tensor]) -> Tensor:
    """``(P,)`` loss tokens of each target row (shifted labels != -100)."""
    return (batch["labels"][..., 1:] != -100).sum(dim=-1)


class ClippingTakeover(CaptureConsumer):
    """The one place where the callback changes the trainer's arguments.

    The trainer clips ``.grad`` right after the last micro-batch's backward, before
    ``on_pre_optimizer_step``, where selection runs; the clipping must follow selection.
    So ``args.max_grad_norm`` reads 0 only from the end of each training micro-batch's
    backward (when the engine hands the micro-batch over) until this callback's
    ``on_substep_end`` (a micro-batch that is not the window's last), the next training
    forward, or its ``on_pre_optimizer_step``, which clips the selected gradient with the
    user's value. No model, data, loss or selection code runs while it reads 0, so an
    exception from any of them finds ``max_grad_norm`` as the user set it; only the
    trainer's own bookkeeping and the callbacks listed before this one run in that window
    (``add_to`` puts it first).
    """

    def __init__(self, args: TrainingArguments):
        self.args = args
        self.max_grad_norm = float(args.max_grad_norm or 0.0)

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        self.args.max_grad_norm = 0.0

    def restore(self, *_: Any) -> None:
        self.args.max_grad_norm = self.max_grad_norm


def restore_schedule(
    session: SelectionSession, checkpoint: Path, step: int, args: TrainingArguments
) -> None:
    """Restore the schedule saved in ``checkpoint`` (a run resumed at ``step``); if it
    cannot be, warn that the selection will differ from an uninterrupted run's."""
    if session.sharded:
        warn_not_restored("the target of a fully_shard-ed model is not saved", step)
        return
    try:
        device = next(session.model.parameters()).device
        state = read_state(checkpoint, process_index(args), device)
        session.restore_schedule(state, step=step)
    except ScheduleStateError as error:
        fix = (
            "if the run resumed from a checkpoint outside output_dir, set "
            "TrainingArguments.resume_from_checkpoint to its path"
        )
        warn_not_restored(f"{error}; {fix}", step)


class DataSelectionCallback(MetricsCallback):
    """Online data selection for ``Trainer``/``SFTTrainer`` (LoRA or full fine-tuning).

    At every optimizer step, scores the step's examples (all micro-batches of the
    accumulation window, on every rank) against the summed gradient of ``target``
    examples, drops the ones the rule picks over the whole global batch, and removes their
    exact contributions from ``.grad`` before clipping and ``optimizer.step()``: the result
    equals a fresh backward over the kept examples with the trainer's normalization (token
    mean over the kept examples' label tokens, as ``num_items_in_batch`` does, across ranks
    with ``average_tokens_across_devices``). Gradient clipping is taken over
    (:class:`ClippingTakeover`). The trainer's logs get ``selection/kept``,
    ``selection/dropped``, ``selection/mean_score``, ``selection/nonfinite`` and
    ``selection/grad_norm``: the corrected gradient's norm before clipping (the trainer's
    own ``grad_norm`` is taken before the selection, so it is not that). In full
    fine-tuning in one process, autograd skips the captured layers' weight gradients and
    the selection builds their ``.grad`` from the kept examples' gradients; under DDP, and
    for LoRA adapters, autograd computes them and the selection corrects them.

    Every step checks that the trainer's loss is the token mean over the step's global
    batch (a ``compute_loss`` override that drops ``num_items_in_batch`` divides each
    micro-batch by its own tokens) and raises ``UnsupportedTrainingSetup`` before the
    optimizer steps otherwise; a collator's ``shift_labels`` are the tokens counted.

    An example with a non-finite gradient is dropped and named in the log; a step with no
    finite example is skipped (every ``.grad`` dropped, so the optimizer changes neither
    the weights nor its state, as a skipped mixed-precision step). A target whose
    examples have no loss token or a non-finite gradient raises ``SelectionError``.

    Resuming: at each checkpoint (``on_save``) the selection's schedule (the current target,
    the step it was computed at, the refresh interval's batch size, the target pool's
    cursor, the random rule's draws) is saved in ``checkpoint-<step>/`` beside the
    trainer's own files, so a run resumed with ``resume_from_checkpoint`` selects exactly as
    an uninterrupted one. A resumed run that finds no usable state (a checkpoint written
    before this was saved, killed between the trainer's save and ``on_save``, a
    ``fully_shard``-ed model) logs a warning naming the cause and starts a fresh schedule,
    which differs from an uninterrupted run's.

    Args:
        target: the target pool: a JSONL path, a ``datasets.Dataset`` or a list of dicts,
            each with ``input_ids`` (optional ``labels``), or ``text``, ``prompt`` +
            ``completion`` or ``messages`` (tokenized with the trainer's tokenizer and
            loss switches when training starts); ``None`` for ``score="loss"`` (the loss
            baselines, and ``rule="random"`` with them), which needs none.
        rule, fraction, threshold, score, granularity, refresh_every, target_examples,
            score_projection, seed, margin, drop_counts: the fields of
            :class:`~tda_plugins.data_selection.SelectionSettings`, with its defaults.
        log_path: JSONL of every step's global outcome, written by rank 0 (default
            ``<output_dir>/selection.jsonl``).
        **options: the fields of :class:`~tda_plugins.session.settings.LayerOptions`
            (``layers``, ``include``, ``exclude``, ``last_n_blocks``; default layers: LoRA
            adapters on PEFT models; full fine-tuning needs ``layers="all"`` so that every
            trainable parameter is covered, else ``on_train_begin`` refuses).
    """

    def __init__(
        self,
        target: Examples | None,
        *,
        rule: str = SelectionSettings.rule,
        fraction: float = SelectionSettings.fraction,
        threshold: float = SelectionSettings.threshold,
        score: str = SelectionSettings.score,
        granularity: str = SelectionSettings.granularity,
        refresh_every: int | None = SelectionSettings.refresh_every,
        target_examples: int | None = SelectionSettings.target_examples,
        score_projection: int | None = SelectionSettings.score_projection,
        log_path: str | None = None,
        seed: int = SelectionSettings.seed,
        margin: float = SelectionSettings.margin,
        drop_counts: Sequence[int] | None = None,
        **options: Any,
    ):
        if options.pop("projection", "none") != "none":
            raise ValueError("data selection removes exact contributions: use projection='none'")
        unknown = sorted(set(options) - set(LAYER_OPTIONS))
        if unknown:
            raise TypeError(f"unknown options {unknown}; the layer options are {LAYER_OPTIONS}")
        self.settings = SelectionSettings(
            rule=rule,
            fraction=fraction,
            threshold=threshold,
            score=score,  # type: ignore[arg-type]
            granularity=granularity,  # type: ignore[arg-type]
            refresh_every=refresh_every,
            target_examples=target_examples,
            score_projection=score_projection,
            log_path=log_path,
            seed=seed,
            margin=margin,
            drop_counts=None if drop_counts is None else tuple(drop_counts),
            layers=LayerOptions(**options).layer_selection(),
        )
        if target is None and self.settings.needs_target:
            raise ValueError(f"score={score!r} needs a target pool; give target=...")
        self.target = (
            ExamplePool(target, "DataSelectionCallback's target") if target is not None else None
        )
        self.session: SelectionSession | None = None
        self._clipping: ClippingTakeover | None = None
        self._hooks: list[Any] = []
        #: Norm of the last step's corrected gradient, before clipping (0-dim tensor).
        self._grad_norm: Tensor | None = None
        #: Whether the session's hooks are on the model (from begin to the end or abort).
        self._hooked = False

    @property
    def history(self) -> list[StepSelection]:
        """One :class:`StepSelection` per optimizer step so far (the global outcome)."""
        return [] if self.session is None else self.session.history

    def begin(self, start: TrainStart) -> None:
        args, model = start.args, start.model
        capture = adapt_settings(LayerSettings(self.settings.layers), args, model)
        # Full fine-tuning in one process: the captured layers' .grad is built from the kept
        # examples at the optimizer step (autograd skips those weight gradients). DDP's
        # all-reduce needs autograd's own gradients; a LoRA adapter's is a cheap rank-r
        # product, cheaper than building it again: there it is computed and corrected.
        built = args.world_size == 1 and not has_lora(model)
        fix = capture.uncaptured_fix or DEFAULT_FIX
        log_path = self.settings.log_path or str(Path(str(args.output_dir)) / "selection.jsonl")
        self.session = SelectionSession(
            self.settings,
            model,
            target=(
                self.target.batch(start.tokenizer, LossTokens.of_trainer(args))
                if self.target is not None
                else None
            ),
            losses=causal_lm_losses,
            target_tokens=target_token_counts,
            normalization=CausalLMNormalization(),
            token_counts=causal_lm_token_counts,
            optimizer=start.optimizer,
            log_path=log_path,
            layers=capture.selection,
            parameter_grads=not built,
            chunk_size=args.per_device_train_batch_size,
            start_step=start.state.global_step,
            fix=fix,
            output_losses=causal_lm_output_losses,
            token_mean_fix=token_mean_fix(args),
        )
        self._clipping = ClippingTakeover(args)
        self.session.engine.add_consumer(self._clipping)
        self._hooks.append(model.register_forward_pre_hook(self._clipping.restore))
        post_selection(model, self.session.history)
        self._hooked = True
        checkpoint = resumed_checkpoint(args, start.state)
        if checkpoint is not None:
            restore_schedule(self.session, checkpoint, start.state.global_step, args)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The trainer has just saved ``checkpoint-<global_step>``: save the selection's
        schedule in it, one file per rank (:mod:`~tda_plugins.data_selection.resume`)."""
        if self.session is None:
            return
        schedule = self.session.schedule_state(state.global_step)
        if schedule is not None:
            folder = checkpoint_folder(args, state.global_step)
            write_state(schedule, folder, process_index(args))

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._clipping is None:
            return
        self._clipping.restore()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is None:
            return
        self.session.refresh_target(state.global_step)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if self.session is None or self._clipping is None:
            return
        self._clipping.restore()
        outcome = self.session.step()
        if model is None or (outcome is not None and outcome.skipped):
            self._grad_norm = None
            return
        # The trainer's own grad_norm is taken before this event, so before selection:
        # the corrected gradient's norm (before clipping) is logged as selection/grad_norm.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(norm, "full_tensor"):  # the partial norms of a sharded .grad
            norm = norm.full_tensor()
        if self._clipping.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(
                model.parameters(), self._clipping.max_grad_norm, norm
            )
        self._grad_norm = norm.detach()

    def step_metrics(self, step: int) -> dict[str, float]:
        """Metrics of optimizer step ``step`` (0-based) for the trainer's logs."""
        if not self.history or self.history[-1].step != step:
            return {}
        last = self.history[-1].summary()
        metrics = {
            "selection/kept": float(last["kept"]),
            "selection/dropped": float(last["dropped"]),
            "selection/nonfinite": float(len(last["nonfinite_ids"])),
        }
        if last["mean_score"] is not None:
            metrics["selection/mean_score"] = last["mean_score"]
        if self._grad_norm is not None:
            metrics["selection/grad_norm"] = float(self._grad_norm)
        return metrics

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        withdraw(kwargs.get("model"), self.abort)
        self._unhook(finish=True)

    def abort(self) -> bool:
        return self._unhook(finish=False)

    def _unhook(self, finish: bool) -> bool:
        """Give clipping back to the trainer, remove the hooks and end the session
        (``finish``: deliver its pending micro-batches first; the session stays, for its
        history); True if it was hooked."""
        if self._clipping is not None:
            self._clipping.restore()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        session, self._hooked = self.session if self._hooked else None, False
        if session is None:
            return False
        withdraw_selection(session.model, session.history)
        if finish:
            session.end()
        else:
            session.close()
        return True
