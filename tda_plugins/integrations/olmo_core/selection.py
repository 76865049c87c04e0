"""Online data selection for OLMo-core: drop, at every step, the instances that hurt a target.

    config = trainer_config.with_callback(
        "selection", DataSelectionCallback(target=target_token_ids, fraction=0.25)
    )

The OLMo-core counterpart of the transformers ``DataSelectionCallback``: it translates
OLMo-core's events into a :class:`~tda_plugins.data_selection.SelectionSession` opened at
the first ``pre_step`` (after OLMo-core's dry-run batch; example ids from the batch's
``index``, as :class:`~tda_plugins.integrations.olmo_core.GradientCaptureCallback` reads
them; loss scale from
:class:`~tda_plugins.integrations.olmo_core.OLMoCoreLossNormalization`).

Per optimizer step: ``pre_step`` refreshes the target at the step's weights; the train
module runs its micro-batches; ``pre_optim_step`` selects over the global batch and edits
``.grad``. OLMo-core clips gradients (``max_grad_norm``) inside ``optim_step``, after every
``pre_optim_step``, so clipping and the optimizer step see the corrected gradient with
nothing taken over.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from olmo_core.train.callbacks import Callback
from olmo_core.train.train_module import TransformerTrainModule
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from tda_plugins.capture import MicroBatchRecord
from tda_plugins.capture.layers import SelectionKind
from tda_plugins.data_selection import (
    DataSelector,
    SelectionSession,
    SelectionSettings,
    StepSelection,
)
from tda_plugins.data_selection.resume import (
    ScheduleState,
    ScheduleStateError,
    warn_not_restored,
)
from tda_plugins.data_selection.session import check_coverage
from tda_plugins.data_selection.settings import Granularity, ScoreMode
from tda_plugins.integrations.olmo_core.callbacks import (
    GradientCaptureCallback,
    before_each_forward,
    check_train_module,
    give_example_ids,
)
from tda_plugins.integrations.olmo_core.normalization import OLMoCoreLossNormalization
from tda_plugins.integrations.olmo_core.pool import PoolTokens, pool_batch, summed_token_losses
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tda_plugins.session.settings import LayerOptions


def loss_token_counts(labels: Tensor, ignore_index: int, instance_mask: Any = None) -> Tensor:
    """``(B,)`` what each instance adds to OLMo-core's ``loss_div_factor``: its labels that
    are not ``ignore_index``, and for an instance that an instance filter masked
    (``instance_mask`` false) its whole length, as ``TransformerTrainModule`` counts it."""
    counts = (labels != ignore_index).sum(dim=-1)
    if isinstance(instance_mask, Tensor):
        counts = counts + (~instance_mask.bool()).long() * labels.shape[-1]
    return counts


#: The :class:`SelectionSettings` fields this callback takes as its own.
_SELECTION_FIELDS = (
    "rule",
    "fraction",
    "threshold",
    "score",
    "granularity",
    "refresh_every",
    "target_examples",
    "score_projection",
    "margin",
    "log_path",
)


@dataclass
class DataSelectionCallback(Callback, LayerOptions):
    """Online data selection for an OLMo-core ``Trainer`` (``TransformerTrainModule``).

    At every optimizer step, scores the step's instances (all micro-batches of every
    rank's batch) against the summed gradient of the ``target`` pool at the step's weights,
    drops the ones the rule picks over the whole global batch and removes their exact
    contributions from ``.grad`` before OLMo-core clips and steps: the result equals a
    fresh backward over the kept instances alone with OLMo-core's normalization (summed
    loss of the kept instances divided by their label tokens; under data parallelism, as
    OLMo-core itself, when every rank's batch has as many label tokens). Instances are
    OLMo-core instances; their ids are the batch's ``index`` values (dataset positions),
    a content hash of the tokens without one.

    Args:
        target: the target pool: a ``(P, T)`` tensor of token ids, or token-id lists (any
            lengths). Its loss is each sequence's summed next-token cross-entropy.
        rule, fraction, threshold, score, granularity, refresh_every, target_examples,
            score_projection, margin: the fields of
            :class:`~tda_plugins.data_selection.SelectionSettings`, with its defaults
            (``refresh_every`` counts from the run's first step, a resumed run going on
            with the schedule saved in the checkpoint; ``score="adam"`` reads the train
            module's Adam state; ``score="loss"`` is refused: this integration does not
            read the forward's per-instance losses).
        layers, include, exclude, last_n_blocks: keyword-only, the layer options of
            :class:`~tda_plugins.session.settings.LayerOptions`. The default layers,
            ``"all"``, cover a full OLMo-core model; every trainable parameter must be
            captured, else ``pre_train`` refuses (freeze the others).
        log_path: JSONL of every step's global outcome (dropped instance indices), written
            by rank 0 (default ``<trainer work_dir>/selection.jsonl``). Its ``step`` is
            OLMo-core's own (1 = the first step); :attr:`history` counts from 0.

    Each step also records the metrics ``selection/kept``, ``selection/dropped`` and
    ``selection/nonfinite`` (over the global batch) and ``selection/mean_score``. Data
    parallelism: DDP, FSDP and HSDP (``dp_config``), each rank editing its own rows of
    ``.grad``; an instance with a non-finite gradient is dropped, and a step without a
    finite instance is skipped (every ``.grad`` dropped, so ``optim_step`` changes
    nothing).
    """

    target: PoolTokens
    rule: str = SelectionSettings.rule
    fraction: float = SelectionSettings.fraction
    threshold: float = SelectionSettings.threshold
    score: ScoreMode = SelectionSettings.score
    granularity: Granularity = SelectionSettings.granularity
    refresh_every: int | None = SelectionSettings.refresh_every
    target_examples: int | None = SelectionSettings.target_examples
    score_projection: int | None = SelectionSettings.score_projection
    margin: float = SelectionSettings.margin
    log_path: str | None = None
    layers: SelectionKind = field(default="all", kw_only=True)

    def __post_init__(self) -> None:
        if self.score == "loss":
            raise UnsupportedTrainingSetup(
                "score='loss' reads each instance's loss from the forward's output, which the "
                "OLMo-core integration does not provide; use score 'dot', 'cosine' or 'adam'"
            )
        given = {name: getattr(self, name) for name in _SELECTION_FIELDS}
        self._settings = SelectionSettings(**given, layers=self.layer_selection())
        pool_batch(self.target)  # refuses a bad target now, before any training
        self._session: SelectionSession | None = None
        self._ids_hook: RemovableHandle | None = None
        self._batch_has_index = False
        self._ignore_index = -100
        # Loss tokens of this step's micro-batches, keyed by their labels tensor (kept alive).
        self._counts: dict[int, tuple[Tensor, Tensor]] = {}
        # The schedule a loaded checkpoint held, restored when the session opens.
        self._loaded: dict[str, Any] | None = None

    @property
    def settings(self) -> SelectionSettings:
        return self._settings

    @property
    def session(self) -> SelectionSession | None:
        """The running selection (``None`` before the first step; kept after training)."""
        return self._session

    @property
    def selector(self) -> DataSelector | None:
        """The selector (``None`` before the first step; kept after training)."""
        return None if self._session is None else self._session.selector

    @property
    def history(self) -> list[StepSelection]:
        """One :class:`StepSelection` per optimizer step so far (kept after training)."""
        return [] if self._session is None else self._session.history

    # -- OLMo-core events --------------------------------------------------------------

    def pre_train(self) -> None:
        model = self._check_setup()
        check_coverage(model, self._settings.layers.resolve(model), _FIX)
        recording = [
            name
            for name, callback in self.trainer.callbacks.items()
            if isinstance(callback, GradientCaptureCallback) and callback.settings.record_trajectory
        ]
        if recording:
            raise UnsupportedTrainingSetup(
                f"the capture callback {recording[0]!r} records the trajectory "
                "(record_trajectory=True): every instance of a step as trained, with the "
                "whole batch's clipping, while this callback drops instances from .grad, so "
                "the replayed run would not be the one trained (OLMo-core zeroes .grad "
                "before the recorder could notice); record the trajectory of a run without "
                "selection, or set record_trajectory=False"
            )

    def pre_step(self, batch: dict[str, Any]) -> None:
        if self._session is None:
            self._session = self._open_session()
        self._batch_has_index = "index" in batch
        self._counts.clear()
        # Selection step k is OLMo-core step k + 1, as in the capture callback's store.
        self._session.refresh_target(self.trainer.global_step - 1)

    def pre_optim_step(self) -> None:
        if self._session is None:
            return
        outcome = self._session.step()
        self._counts.clear()
        if outcome is not None:
            summary = outcome.summary()
            for key in ("kept", "dropped"):
                self.trainer.record_metric(f"selection/{key}", float(summary[key]), None)
            nonfinite = float(len(summary["nonfinite_ids"]))
            self.trainer.record_metric("selection/nonfinite", nonfinite, None)
            if summary["mean_score"] is not None:
                self.trainer.record_metric("selection/mean_score", summary["mean_score"], None)

    def state_dict(self) -> dict[str, Any]:
        """Called as OLMo-core takes a checkpoint (saved in its per-rank trainer state):
        the selection's schedule (:mod:`~tda_plugins.data_selection.resume`), so that a run
        resumed from it selects as an uninterrupted one; empty before the first step and
        for a ``fully_shard``-ed target, which is not saved."""
        if self._session is None:
            return {}
        # After global_step OLMo-core steps, the next selection step is global_step.
        schedule = self._session.schedule_state(self.trainer.global_step)
        if schedule is None:
            return {}
        tensors, meta = schedule.tensors()
        return {"selection_schedule": {"tensors": tensors, "meta": meta}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint was loaded: keep its schedule for the session (opened at the first
        step)."""
        self._loaded = state_dict.get("selection_schedule")

    def post_train(self) -> None:
        if self._session is not None:
            self._session.end()
        self._release()

    def close(self) -> None:
        """Always runs as ``fit`` exits: unhook (after an error, nothing more is selected)."""
        if self._session is not None:
            self._session.close()
        self._release()

    # -- helpers -----------------------------------------------------------------------

    def _check_setup(self) -> nn.Module:
        train_module = self.trainer.train_module
        model = check_train_module(train_module, self._settings.layers)
        assert isinstance(train_module, TransformerTrainModule)  # checked above
        self._ignore_index = int(train_module.label_ignore_index)
        return model

    def _open_session(self) -> SelectionSession:
        model = self._check_setup()
        train_module = self.trainer.train_module
        assert isinstance(train_module, TransformerTrainModule)
        ignore_index = self._ignore_index

        def target_tokens(batch: Mapping[str, Tensor]) -> Tensor:
            return (batch["labels"] != ignore_index).sum(dim=-1)

        log_path = self._settings.log_path or str(Path(self.trainer.work_dir) / "selection.jsonl")
        session = SelectionSession(
            self._settings,
            model,
            target=pool_batch(self.target, ignore_index),
            losses=partial(summed_token_losses, ignore_index=ignore_index),
            target_tokens=target_tokens,
            normalization=OLMoCoreLossNormalization(),
            token_counts=self._token_counts,
            optimizer=train_module.optim,
            log_path=log_path,
            start_step=self.trainer.global_step - 1,
            fix=_FIX,
            token_mean_fix=_TOKEN_MEAN_FIX,
        )
        self._ids_hook = before_each_forward(model, self._observe_call)
        if self.trainer.global_step > 1:  # resumed from a checkpoint
            self._restore(session, self.trainer.global_step - 1)
        return session

    def _restore(self, session: SelectionSession, step: int) -> None:
        """Go on from the loaded checkpoint's schedule, or warn that the selection will
        differ from an uninterrupted run's."""
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            cause = (
                "the target of a fully_shard-ed model is not saved"
                if session.sharded
                else "the loaded checkpoint holds no selection schedule"
            )
            warn_not_restored(cause, step)
            return
        try:
            device = next(session.model.parameters()).device
            state = ScheduleState.from_tensors(loaded["tensors"], loaded["meta"], device)
            session.restore_schedule(state, step=step)
        except ScheduleStateError as error:
            warn_not_restored(str(error), step)

    def _observe_call(self, module: nn.Module, kwargs: dict[str, Any]) -> None:
        """Before each training micro-batch's forward: its example ids (the batch's
        ``index`` slice, as the capture callback reads them) and its loss tokens."""
        session = self._session
        if session is None or not session.engine.capturing or not torch.is_grad_enabled():
            return
        labels = kwargs.get("labels")
        if isinstance(labels, Tensor):
            ignore_index = int(kwargs.get("ignore_index", self._ignore_index))
            counts = loss_token_counts(labels, ignore_index, kwargs.get("instance_mask"))
            self._counts[id(labels)] = (labels, counts)
        give_example_ids(session.engine, module, kwargs, self._batch_has_index)

    def _token_counts(self, record: MicroBatchRecord) -> Tensor:
        """``(B,)`` loss tokens of a training micro-batch's instances (``loss_div_factor``'s
        terms), counted from the labels the model was called with."""
        if record.labels is None:
            raise UnsupportedTrainingSetup(
                "data selection needs the model called with labels to count loss tokens"
            )
        entry = self._counts.get(id(record.labels))
        if entry is None or entry[0] is not record.labels:
            return loss_token_counts(record.labels, self._ignore_index)
        return entry[1]

    def _release(self) -> None:
        if self._ids_hook is not None:
            self._ids_hook.remove()
        self._ids_hook = None
        self._counts.clear()


_FIX = "use layers='all' (the default) without include/exclude/last_n_blocks, or freeze them"

#: The way out when a step's loss is not the token mean over its global batch: OLMo-core's
#: train module divides each rank's loss by that rank's own label tokens.
_TOKEN_MEAN_FIX = (
    "OLMo-core divides each rank's loss by that rank's own label tokens, so ranks with "
    "unequal label tokens weigh their instances unequally; select in one process, or give "
    "every rank as many label tokens (no label mask or instance filter)"
)
