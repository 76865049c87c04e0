"""Online data selection for OLMo-core: drop, at every step, the instances that hurt a target.

    config = trainer_config.with_callback(
        "selection", DataSelectionCallback(target=target_token_ids, fraction=0.25)
    )

The OLMo-core counterpart of the transformers ``DataSelectionCallback``: a
:class:`~tda_plugins.data_selection.DataSelector` on a capture engine hooked like
:class:`~tda_plugins.integrations.olmo_core.GradientCaptureCallback` (at the first
``pre_step``, after OLMo-core's dry-run batch; example ids from the batch's ``index``; loss
scale from :class:`~tda_plugins.integrations.olmo_core.OLMoCoreLossNormalization`).

Per optimizer step: ``pre_step`` computes the target pool's gradient at the step's
weights (the training capture paused, the model in eval mode); the train module runs its
micro-batches; ``pre_optim_step`` scores the step's instances against the target, drops
the ones the rule picks and removes their exact contributions from ``.grad``. OLMo-core
clips gradients (``max_grad_norm``) inside ``optim_step``, after every ``pre_optim_step``,
so clipping and the optimizer step see the corrected gradient with nothing taken over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from olmo_core.train.callbacks import Callback
from olmo_core.train.common import ReduceType
from olmo_core.train.train_module import TransformerTrainModule
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from tda_plugins.capture import CaptureEngine, MicroBatchRecord
from tda_plugins.capture.layers import SelectionKind, uncovered_trainable
from tda_plugins.data_selection import DataSelector, StepSelection, rule_by_name
from tda_plugins.data_selection.selector import Granularity, ScoreMode
from tda_plugins.data_selection.target import Target, TargetPool, target_gradient
from tda_plugins.grads.projection import ProjectionConfig
from tda_plugins.integrations.olmo_core.callbacks import check_train_module, give_example_ids
from tda_plugins.integrations.olmo_core.normalization import OLMoCoreLossNormalization
from tda_plugins.session import CaptureSettings, UnsupportedTrainingSetup

TargetTokens = Tensor | Sequence[Sequence[int]]


def target_batch(target: TargetTokens, ignore_index: int = -100) -> dict[str, Tensor]:
    """``input_ids`` and OLMo-core ``labels`` (inputs shifted left, ``ignore_index`` at the
    last position and at padding) of a target pool: a ``(P, T)`` tensor of token ids, or
    token-id lists of any lengths (right-padded with token 0, which carries no loss)."""
    if isinstance(target, Tensor):
        if target.dim() != 2 or target.is_floating_point():
            raise ValueError(f"target must be a (P, T) tensor of token ids, got {target.shape}")
        ids = target.detach().clone().long()
        real = torch.ones_like(ids, dtype=torch.bool)
    else:
        rows = [list(map(int, row)) for row in target]
        length = max((len(r) for r in rows), default=0)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        real = torch.zeros_like(ids, dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
            real[i, : len(row)] = True
    if ids.shape[0] == 0 or ids.shape[1] < 2:
        raise ValueError("the target pool needs at least one sequence of two or more tokens")
    labels = ids.masked_fill(~real, ignore_index)
    labels = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    if not bool((labels != ignore_index).any(dim=1).all()):
        raise ValueError("every target sequence needs at least two tokens (one predicted)")
    return {"input_ids": ids, "labels": labels}


def summed_token_losses(model: nn.Module, batch: dict[str, Tensor], ignore_index: int) -> Tensor:
    """``(B,)`` each sequence's summed next-token cross-entropy (OLMo-core labels, already
    shifted), from the logits of a plain ``model(input_ids)`` call, in fp32 or wider."""
    logits = model(batch["input_ids"])
    dtype = torch.promote_types(logits.dtype, torch.float32)
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(dtype),
        batch["labels"].reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
    )
    return per_token.view(batch["labels"].shape).sum(dim=1)


def loss_token_counts(labels: Tensor, ignore_index: int, instance_mask: Any = None) -> Tensor:
    """``(B,)`` what each instance adds to OLMo-core's ``loss_div_factor``: its labels that
    are not ``ignore_index``, and for an instance that an instance filter masked
    (``instance_mask`` false) its whole length, as ``TransformerTrainModule`` counts it."""
    counts = (labels != ignore_index).sum(dim=-1)
    if isinstance(instance_mask, Tensor):
        counts = counts + (~instance_mask.bool()).long() * labels.shape[-1]
    return counts


@dataclass
class DataSelectionCallback(Callback):
    """Online data selection for an OLMo-core ``Trainer`` (``TransformerTrainModule``).

    At every optimizer step, scores the step's instances (all micro-batches of the rank's
    batch) against the summed gradient of the ``target`` pool at the step's weights, drops
    the ones the rule picks and removes their exact contributions from ``.grad`` before
    OLMo-core clips and steps: the result equals a fresh backward over the kept instances
    alone with OLMo-core's normalization (summed loss of the kept instances divided by
    their label tokens). Instances are OLMo-core instances; their ids are the batch's
    ``index`` values (dataset positions), a content hash of the tokens without one.

    Args:
        target: the target pool: a ``(P, T)`` tensor of token ids, or token-id lists (any
            lengths). Its loss is each sequence's summed next-token cross-entropy.
        rule: ``"bottom_fraction"``, ``"threshold"`` or ``"negative_in_bottom"``.
        fraction: share of the step's instances the fraction rules consider.
        threshold: score below which ``"threshold"`` drops.
        score: ``"dot"``, ``"cosine"`` or ``"adam"`` (preconditioned by the train
            module's Adam state).
        granularity: ``"global"`` or ``"per_layer"``.
        refresh_every: recompute the target gradient every n optimizer steps (and at the
            first step of a run or a resumed run).
        target_examples: target sequences per refresh: ``None`` (default) the whole pool,
            ``m`` the next ``m`` of it in turn (cost: a forward/backward over ``m``).
        score_projection: ``k``: approximate scores in a ``k x k`` factor-projected
            space per layer (removal stays exact); ``None``: exact scores.
        log_path: JSONL of dropped instance indices per step and rank (default
            ``<trainer work_dir>/selection.jsonl``). Its ``step`` is OLMo-core's step - 1.
        layers, include, exclude, last_n_blocks: the layer fields of
            :class:`~tda_plugins.session.CaptureSettings`. The default, ``"all"``, covers a
            full OLMo-core model; every trainable parameter must be captured, else
            ``pre_train`` refuses (freeze the others).

    Each step also records the metrics ``selection/kept``, ``selection/dropped`` (summed
    over ranks) and ``selection/mean_score``. Under data parallelism (DDP) each rank drops
    its own instances and the corrections are all-reduced; sharded parameters (FSDP) are
    refused.
    """

    target: TargetTokens
    rule: str = "bottom_fraction"
    fraction: float = 0.25
    threshold: float = 0.0
    score: ScoreMode = "dot"
    granularity: Granularity = "global"
    refresh_every: int = 1
    target_examples: int | None = None
    score_projection: int | None = None
    log_path: str | None = None
    layers: SelectionKind = "all"
    include: str | None = None
    exclude: str | None = None
    last_n_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {self.refresh_every}")
        threshold = self.rule == "threshold"
        options = {"value": self.threshold} if threshold else {"fraction": self.fraction}
        self._rule = rule_by_name(self.rule, **options)
        if self.score not in ("dot", "cosine", "adam"):
            raise ValueError(f"score must be 'dot', 'cosine' or 'adam', got {self.score!r}")
        if self.granularity not in ("global", "per_layer"):
            raise ValueError(
                f"granularity must be 'global' or 'per_layer', got {self.granularity!r}"
            )
        self._pool = TargetPool(target_batch(self.target), self.target_examples)
        self._engine: CaptureEngine | None = None
        self._selector: DataSelector | None = None
        self._ids_hook: RemovableHandle | None = None
        self._batch_has_index = False
        self._in_pool = False
        self._target_step: int | None = None
        self._ignore_index = -100
        # Loss tokens of this step's micro-batches, keyed by their labels tensor (kept alive).
        self._counts: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def settings(self) -> CaptureSettings:
        """The layer fields as :class:`CaptureSettings` (nothing is stored)."""
        return CaptureSettings(
            store_dir="",
            layers=self.layers,
            include=self.include,
            exclude=self.exclude,
            last_n_blocks=self.last_n_blocks,
            curvature=False,
        )

    @property
    def selector(self) -> DataSelector | None:
        """The selector (``None`` before the first step; kept after training)."""
        return self._selector

    @property
    def history(self) -> list[StepSelection]:
        """One :class:`StepSelection` per optimizer step so far (kept after training)."""
        return [] if self._selector is None else self._selector.history

    # -- OLMo-core events --------------------------------------------------------------

    def pre_train(self) -> None:
        model = self._check_setup()
        selection = self.settings.selection()
        missing = uncovered_trainable(model, selection.resolve(model))
        if missing:
            raise UnsupportedTrainingSetup(
                f"{len(missing)} trainable parameters are not captured ({missing[:3]}), so "
                "their .grad could not be corrected; use layers='all' (the default) without "
                "include/exclude/last_n_blocks, or freeze them"
            )

    def pre_step(self, batch: dict[str, Any]) -> None:
        if self._engine is None:
            self._attach()
        assert self._engine is not None and self._selector is not None
        # Selection step k is OLMo-core step k + 1, as in the capture callback's store.
        step = self.trainer.global_step - 1
        self._engine.resume_at_step(step)
        self._batch_has_index = "index" in batch
        self._counts.clear()
        if self._target_step is None or (step - self._target_step) % self.refresh_every == 0:
            self._selector.set_target(self._capture_target())
            self._target_step = step

    def pre_optim_step(self) -> None:
        if self._engine is None or self._selector is None:
            return
        done = len(self._selector.history)
        self._engine.optimizer_step()
        self._counts.clear()
        if len(self._selector.history) > done:
            last = self._selector.history[-1]
            kept = (~last.dropped).sum().float()
            self.trainer.record_metric("selection/kept", kept, ReduceType.sum)
            self.trainer.record_metric(
                "selection/dropped", last.dropped.sum().float(), ReduceType.sum
            )
            finite = last.scores[~last.non_finite]
            self.trainer.record_metric(
                "selection/non_finite", last.non_finite.sum().float(), ReduceType.sum
            )
            if finite.numel():
                self.trainer.record_metric("selection/mean_score", finite.mean(), ReduceType.mean)

    def post_train(self) -> None:
        if self._engine is not None:
            self._engine.end()
        self._release()

    def close(self) -> None:
        """Always runs as ``fit`` exits: unhook (after an error, nothing more is selected)."""
        self._release()

    # -- helpers -----------------------------------------------------------------------

    def _check_setup(self) -> nn.Module:
        train_module = self.trainer.train_module
        model = check_train_module(train_module, self.settings)
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise UnsupportedTrainingSetup(
                "the model's parameters are sharded DTensors (FSDP/HSDP): each rank's .grad "
                "holds only its shard, which data selection cannot correct; train with DDP "
                "(dp_config name='ddp') or in one process"
            )
        assert isinstance(train_module, TransformerTrainModule)  # checked above
        self._ignore_index = int(train_module.label_ignore_index)
        return model

    def _attach(self) -> None:
        model = self._check_setup()
        train_module = self.trainer.train_module
        assert isinstance(train_module, TransformerTrainModule)
        engine = CaptureEngine(
            model, self.settings.selection(), None, (), OLMoCoreLossNormalization()
        ).attach()
        missing = uncovered_trainable(model, engine.captured_layers)
        if missing:
            engine.detach()
            raise UnsupportedTrainingSetup(
                f"{len(missing)} trainable parameters are not captured ({missing[:3]}), so "
                "their .grad could not be corrected; use layers='all' or freeze them"
            )
        log_path = self.log_path or str(Path(self.trainer.work_dir) / "selection.jsonl")
        self._selector = DataSelector(
            engine.captured_layers,
            self._rule,
            self._token_counts,
            self.score,
            self.granularity,
            train_module.optim,
            log_path,
            None
            if self.score_projection is None
            else ProjectionConfig("factor", k_a=self.score_projection, k_g=self.score_projection),
        )
        engine.add_consumer(self._selector)
        self._engine = engine
        self._ids_hook = model.register_forward_pre_hook(
            self._observe_call, prepend=True, with_kwargs=True
        )

    def _capture_target(self) -> Target:
        """The summed gradient of this refresh's target sequences at the current weights
        (one plain backward; the training capture paused)."""
        assert self._engine is not None
        model = self._engine.model
        pool = self._pool.next_batch(next(model.parameters()).device)
        ignore_index = self._ignore_index
        if ignore_index != -100:
            pool["labels"] = pool["labels"].masked_fill(pool["labels"] == -100, ignore_index)

        def losses(model: nn.Module, batch: Any) -> Tensor:
            return summed_token_losses(model, batch, ignore_index)

        no_sync = getattr(model, "no_sync", None)  # DDP: no gradient all-reduce for the pool
        was_training = model.training
        model.eval()
        self._in_pool = True
        try:
            with (
                no_sync() if callable(no_sync) else contextlib.nullcontext(),
                self._engine.paused(),
            ):
                return target_gradient(model, self._engine.captured_layers, pool, losses)
        finally:
            self._in_pool = False
            model.train(was_training)

    def _observe_call(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Before each training micro-batch's forward: its example ids (the batch's
        ``index`` slice, as the capture callback reads them) and its loss tokens."""
        if self._engine is None or self._in_pool or not torch.is_grad_enabled():
            return
        labels = kwargs.get("labels")
        if isinstance(labels, Tensor):
            ignore_index = int(kwargs.get("ignore_index", self._ignore_index))
            counts = loss_token_counts(labels, ignore_index, kwargs.get("instance_mask"))
            self._counts[id(labels)] = (labels, counts)
        give_example_ids(self._engine, module, kwargs, self._batch_has_index)

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
        if self._engine is not None:
            self._engine.detach()
        self._engine = None
        self._counts.clear()
