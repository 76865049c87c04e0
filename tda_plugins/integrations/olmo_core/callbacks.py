"""An OLMo-core ``Callback``: add it to the trainer and the run records.

    config = trainer_config.with_callback(
        "tda", GradientCaptureCallback(CaptureSettings(StoreSettings("run/grads")))
    )

No train-module subclass and no patched optimizer: the callback hooks the model at the
first ``pre_step`` (after OLMo-core's dry-run batch, whose random tokens must not be
recorded), commits each optimizer step's per-example gradients at ``pre_optim_step``
(after every micro-batch's backward), keeps in the store what a resumed run needs when a
checkpoint is taken, and finishes at ``post_train``.

Example ids are OLMo-core's instance indices: the batch's ``index`` (each instance's
position in the global dataset) travels through ``TransformerTrainModule``'s micro-batch
split into the model call as a keyword, where a forward pre-hook hands each micro-batch's
slice to the engine. Reading it off the call itself, rather than re-splitting the batch
the way the train module does, cannot go out of step with the train module. Store step
``k`` is OLMo-core step ``k + 1`` (OLMo-core counts steps from 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from olmo_core.nn.lm_head import LMLossImplementation
from olmo_core.nn.transformer import Transformer
from olmo_core.train.callbacks import Callback
from olmo_core.train.train_module import TrainModule, TransformerTrainModule
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from tda_plugins.capture import CaptureEngine, LayerSelection
from tda_plugins.capture.names import named_modules
from tda_plugins.integrations.olmo_core.normalization import OLMoCoreLossNormalization
from tda_plugins.parallel.gather import process_rank
from tda_plugins.session.capture import CaptureSession, UnsupportedTrainingSetup
from tda_plugins.session.settings import CaptureSettings


def check_train_module(train_module: TrainModule, layers: LayerSelection) -> Transformer:
    """The model to hook ``layers`` of; refuses, before any step runs, what would make
    gradients wrong."""
    if not isinstance(train_module, TransformerTrainModule):
        raise UnsupportedTrainingSetup(
            f"{type(train_module).__name__} is not a TransformerTrainModule, whose micro-batch "
            "loop the capture follows (pipeline parallelism and OLMoDDPTrainModule are not "
            "supported); build the train module with TransformerTrainModuleConfig"
        )
    if train_module.tp_enabled or train_module.cp_enabled:
        raise UnsupportedTrainingSetup(
            "tensor/context parallelism splits each sequence across ranks, so no rank sees an "
            "example's whole gradient; train without tp_config and cp_config"
        )
    model = train_module.model
    if model.is_moe:
        raise UnsupportedTrainingSetup(
            f"{type(model).__name__} is a mixture of experts: its routers add load-balancing "
            "and z-losses over the whole batch (and a capacity factor drops tokens by the "
            "batch's load), so no example's gradient is its own, and the experts' grouped "
            "weights are not modules the capture hooks; MoE models are not supported, "
            "train a dense TransformerConfig"
        )
    if model.compile_enabled:
        raise UnsupportedTrainingSetup(
            "the model is torch.compile'd, which bypasses module hooks; set compile_model=False"
        )
    if model.fp8_enabled:
        raise UnsupportedTrainingSetup(
            "float8 linear layers compute their weight gradients in float8, which the captured "
            "per-example gradients would not match; set float8_config=None"
        )
    fused = LMLossImplementation.fused_linear
    if model.lm_head is not None and model.lm_head.loss_implementation == fused:
        name = next(n for n, m in named_modules(model) if m is model.lm_head.w_out)
        if name in layers.resolve(model):
            raise UnsupportedTrainingSetup(
                f"the fused linear cross-entropy computes {name}'s output without calling it, "
                "so its gradient is never seen; use LMLossImplementation.default or exclude "
                f"{name!r} from the layers"
            )
    return model


def before_each_forward(
    model: nn.Module, hook: Callable[[nn.Module, dict[str, Any]], None]
) -> RemovableHandle:
    """Run ``hook(module, kwargs)`` before each call of ``model``, first among its
    pre-hooks: where the callbacks read a micro-batch's ``index`` slice (and loss tokens)
    from the keyword arguments ``TransformerTrainModule`` calls the model with."""
    return model.register_forward_pre_hook(
        lambda module, args, kwargs: hook(module, kwargs), prepend=True, with_kwargs=True
    )


def checkpoint_folder(trainer: Any, step: int) -> Path | None:
    """Where OLMo-core saves its checkpoint of ``step`` steps (``<save_folder>/step<n>``),
    when the save folder is on this machine's filesystem (``None`` for a remote URL)."""
    folder = str(getattr(trainer, "save_folder", "") or "")
    if not folder or "://" in folder:
        return None
    return Path(folder) / f"step{step}"


def give_example_ids(
    engine: CaptureEngine, module: nn.Module, kwargs: dict[str, Any], batch_has_index: bool
) -> None:
    """Forward pre-hook body: hand a micro-batch's ``index`` slice (OLMo-core instance
    indices, passed to the model call by ``TransformerTrainModule``) to the engine."""
    if not engine.capturing:  # a pool or query pass that another engine holds exclusively
        return
    index = kwargs.get("index")
    if isinstance(index, Tensor):
        engine.set_example_ids(index)
    elif batch_has_index:
        raise UnsupportedTrainingSetup(
            f"the batch has instance indices ('index'), but {type(module).__name__} was "
            "called without them, so micro-batches cannot be matched to dataset instances; "
            "pass the batch's remaining keys to the model as TransformerTrainModule does"
        )


@dataclass
class GradientCaptureCallback(Callback):
    """Writes every step's exact per-example gradients (and K-FAC statistics) to a store.

    Stored gradients follow the store convention: each example's own *summed* token loss
    (cross-entropy, plus the z-loss term when the train module uses one), whatever
    ``loss_div_factor``, micro-batch size or data-parallel size the run uses (see
    :mod:`~tda_plugins.integrations.olmo_core.normalization`). An example is an OLMo-core
    instance (with fixed-sequence-length datasets, a chunk of the token stream that may
    span several documents); its id is the instance's dataset index (a content hash of its
    tokens if the batch has no ``index``). Each rank writes its own part of the store
    (rank from ``torch.distributed``); with data parallelism (``dp_config`` DDP, FSDP or
    HSDP) the merged store holds what one process would have captured from the same global
    batches. Under FSDP and HSDP the Adam moments saved at the end are gathered by every
    rank (a collective) and written by rank 0.

    Resuming: a run that loads a checkpoint with trainer state continues the store at the
    checkpoint's step and restores the curvature statistics saved beside it, so no step is
    counted twice. Those statistics are staged in the trainer's ``work_dir`` when OLMo-core
    takes the checkpoint (its :meth:`state_dict` call, also for asynchronous saves) and moved
    into the checkpoint folder once it is saved, which needs a local ``save_folder``.

    Args:
        settings: what to record (its ``store`` names the store's folder).
        tokenizer: a tokenizer with ``decode`` (a transformers one): each instance's text
            is then stored beside its gradients for reports (``settings.store.store_texts``),
            and its vocabulary recorded in the store's fingerprint.
    """

    settings: CaptureSettings
    tokenizer: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.settings, CaptureSettings):
            raise TypeError(
                f"settings must be a CaptureSettings, got {type(self.settings).__name__}"
            )
        self._session: CaptureSession | None = None
        self._ids_hook: RemovableHandle | None = None
        self._batch_has_index = False

    @property
    def session(self) -> CaptureSession | None:
        """The running capture (``None`` before the first step and after training)."""
        return self._session

    # -- OLMo-core events --------------------------------------------------------------

    def pre_train(self) -> None:
        check_train_module(self.trainer.train_module, self.settings.layers.selection)

    def pre_step(self, batch: dict[str, Any]) -> None:
        if self._session is None:
            self._session = self._open_session()
        # A step in the trainer's steps_to_skip runs no optimizer step; numbering from the
        # trainer's step keeps store steps equal to OLMo-core's steps (minus one) anyway.
        self._session.engine.resume_at_step(self.trainer.global_step - 1)
        self._batch_has_index = "index" in batch

    def pre_optim_step(self) -> None:
        if self._session is not None:
            self._session.step()

    def post_step(self) -> None:
        if self._session is not None:
            # OLMo-core sets each step's learning rate before its optimizer step
            self._session.after_optimizer_step()
            self._session.finish_step()

    def state_dict(self) -> dict[str, Any]:
        """Called as OLMo-core starts saving the checkpoint of the current step (also an
        asynchronous one): keep the capture state that matches it, in the store."""
        if self._session is not None:
            # Store step k is OLMo-core step k + 1: after global_step steps, the next store
            # step is global_step.
            step = self.trainer.global_step
            self._session.save_checkpoint(step, checkpoint_folder(self.trainer, step))
            self._session.drop_deleted_checkpoints()  # ephemeral checkpoints removed since
        return {}

    def post_train(self) -> None:
        if self._session is not None:
            train_module = self.trainer.train_module
            optimizer = (
                train_module.optim if isinstance(train_module, TransformerTrainModule) else None
            )
            self._session.drop_deleted_checkpoints()
            self._session.end(optimizer)
            self._release()

    def close(self) -> None:
        """Always runs as ``fit`` exits: after an error, unhook without committing."""
        if self._session is not None:
            self._session.engine.detach()
            self._release()

    # -- helpers -----------------------------------------------------------------------

    def _open_session(self) -> CaptureSession:
        model = check_train_module(self.trainer.train_module, self.settings.layers.selection)
        start_step = self.trainer.global_step - 1
        train_module = self.trainer.train_module
        session = CaptureSession(
            self.settings,
            model=model,
            normalization=OLMoCoreLossNormalization(),
            rank=process_rank(),
            start_step=start_step,
            tokenizer=self.tokenizer,
            optimizer=getattr(train_module, "optim", None),
            max_grad_norm=getattr(train_module, "max_grad_norm", None),
        )
        self._ids_hook = before_each_forward(model, self._give_example_ids)
        return session

    def _give_example_ids(self, module: nn.Module, kwargs: dict[str, Any]) -> None:
        if self._session is not None and torch.is_grad_enabled():
            give_example_ids(self._session.engine, module, kwargs, self._batch_has_index)

    def _release(self) -> None:
        if self._ids_hook is not None:
            self._ids_hook.remove()
        self._ids_hook = None
        self._session = None
