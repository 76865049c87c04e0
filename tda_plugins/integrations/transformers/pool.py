"""The base of the callbacks that score each step against a pool of examples (influence
queries, or a selection target) whose gradients are taken at the weights of the step."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import TrainerControl, TrainerState, TrainingArguments

from tda_plugins.capture import CaptureEngine
from tda_plugins.capture.layers import warn_uncaptured
from tda_plugins.integrations.transformers.data import ExamplePool, Examples, LossTokens
from tda_plugins.integrations.transformers.normalization import CausalLMNormalization
from tda_plugins.integrations.transformers.setup import (
    MetricsCallback,
    TrainStart,
    adapt_settings,
)
from tda_plugins.session.batch import capture_batch, evaluating
from tda_plugins.session.dropout import warn_dropout
from tda_plugins.session.settings import layer_settings


class PoolCallback(MetricsCallback):
    """Base of the callbacks that score each step against a pool of examples (queries or a
    target set) whose gradients are captured at the current weights before the step.

    Subclasses give the consumer that scores the step and what to do with the pool's
    gradients (:meth:`use_pool`); this class owns the engine, the pool capture (training
    engines ignoring it, model in eval mode), the step signal and the log plumbing.
    """

    def __init__(self, pool: Examples, every_n_steps: int, options: dict[str, Any]):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.settings = layer_settings(**options)
        self.examples = ExamplePool(pool, type(self).__name__)
        #: The pool as one padded batch, tokenized at ``on_train_begin`` if given as texts.
        self.pool = self.examples.batch() if self.examples.tokenized else {}
        self.every_n_steps = every_n_steps
        self.engine: CaptureEngine | None = None

    def attach(self, start: TrainStart) -> CaptureEngine:
        """Hook the model with this callback's layers and normalization (no consumer yet).
        A pool given as texts is tokenized with the trainer's tokenizer here."""
        if not self.pool:
            self.pool = self.examples.batch(start.tokenizer, LossTokens.of_trainer(start.args))
        self.settings = adapt_settings(self.settings, start.args, start.model)
        engine = CaptureEngine(
            start.model,
            layers=self.settings.selection,
            projection=self.settings.projection,
            normalization=CausalLMNormalization(),
        ).attach()
        warn_uncaptured(
            start.model,
            engine.captured_layers,
            "the logged influence scores",
            self.settings.uncaptured_fix,
        )
        warn_dropout(start.model, "the logged influence scores")
        engine.resume_at_step(start.state.global_step)
        self.engine = engine
        return engine

    def pool_gradients(self, model: nn.Module, args: TrainingArguments) -> Any:
        """The pool's gradients at the current weights, in the form :meth:`use_pool`
        takes (default: per-example, through a temporary exclusive engine)."""
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in self.pool.items()}
        return capture_batch(model, batch, None, self.settings.selection, self.settings.projection)

    def use_pool(self, pooled: Any, lr_scheduler: Any) -> None:
        """The pool's gradients at the coming step's weights (``None``: not due)."""
        raise NotImplementedError

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        lr_scheduler = kwargs.get("lr_scheduler")
        if self.engine is None or model is None:
            return
        if state.global_step % self.every_n_steps:
            self.use_pool(None, lr_scheduler)
            return
        with evaluating(model):
            pooled = self.pool_gradients(model, args)
        self.use_pool(pooled, lr_scheduler)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.engine is not None:
            self.engine.optimizer_step()

    def abort(self) -> bool:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.detach()
        return engine is not None

    def detach(self) -> None:
        """Finish pending micro-batches and unhook."""
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.end()
            finally:
                engine.detach()
