"""transformers ``TrainerCallback``s: add one to ``Trainer``/``SFTTrainer`` and the run records.

    trainer = Trainer(..., callbacks=[GradientCaptureCallback(store_dir="run/grads")])

No trainer subclass, no patched optimizer, no extra dataset column: the callback hooks the
model at ``on_train_begin``, commits each optimizer step's per-example gradients at
``on_pre_optimizer_step`` (after every micro-batch's backward), saves what a resumed run
needs at ``on_save``, and finishes at ``on_train_end``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from tda_plugins.api import capture_batch, causal_lm_losses
from tda_plugins.capture import CaptureEngine, MicroBatchRecord, content_hash
from tda_plugins.capture.selection import has_lora, uncovered_trainable
from tda_plugins.grads.projection import ProjectionConfig
from tda_plugins.influence import InfluenceLogger
from tda_plugins.integrations.transformers.normalization import CausalLMNormalization
from tda_plugins.selection import DataSelector, StepSelection, rule_by_name
from tda_plugins.selection.selector import Granularity, ScoreMode
from tda_plugins.selection.target import Target, TargetPool, target_gradient
from tda_plugins.session import CaptureSession, CaptureSettings, UnsupportedTrainingSetup


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


def uses_fused_head(args: TrainingArguments) -> bool:
    """TRL's ``SFTTrainer`` computes logits from ``lm_head.weight`` directly (its fused LM
    head, the default without label smoothing), so no module hook sees the head."""
    return type(args).__name__ == "SFTConfig" and not getattr(args, "label_smoothing_factor", 0)


def adapt_settings(
    settings: CaptureSettings, args: TrainingArguments, model: nn.Module
) -> CaptureSettings:
    """Leave out the output head where the trainer bypasses its module call (logged)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or not uses_fused_head(args):
        return settings
    name = next(n for n, m in model.named_modules() if m is head)
    logger.warning(
        "tda-plugins: TRL's fused LM head bypasses %s's forward, so its per-example gradient "
        "cannot be captured; it is left out of the captured layers",
        name,
    )
    pattern = rf"^{re.escape(name)}$"
    exclude = pattern if settings.exclude is None else rf"(?:{settings.exclude})|{pattern}"
    return dataclasses.replace(settings, exclude=exclude)


def _process_index(args: TrainingArguments) -> int:
    return int(getattr(args, "process_index", 0))


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


logger = logging.getLogger(__name__)


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
        self.session = CaptureSession(
            adapt_settings(self.settings, args, model),
            model,
            CausalLMNormalization(),
            rank=_process_index(args),
            start_step=state.global_step,
        )

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:
            self.session.step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:
            self.session.finish_step()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:
            self.session.save_checkpoint(state.global_step)

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


class PoolCallback(TrainerCallback):
    """Base of the callbacks that score each step against a pool of examples (queries or a
    target set) whose gradients are captured at the current weights before the step.

    Subclasses give the consumer that scores the step and what to do with the pool's
    gradients (:meth:`use_pool`); this class owns the engine, the pool capture (training
    engines ignoring it, model in eval mode), the step signal and the log plumbing.
    """

    def __init__(self, pool: list[dict[str, Any]], every_n_steps: int, options: dict[str, Any]):
        if not pool:
            raise ValueError(f"{type(self).__name__} needs at least one example in its pool")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.settings = _settings(None, {"store_dir": "", **options})
        self.pool = pad_examples(pool)
        self.every_n_steps = every_n_steps
        self.engine: CaptureEngine | None = None

    def add_to(self, trainer: Any) -> PoolCallback:
        """Put this callback first in ``trainer``'s list, so ``report_to`` sees its metrics."""
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def attach(
        self,
        args: TrainingArguments,
        model: nn.Module,
        state: TrainerState,
        parameter_grads: bool = True,
    ) -> CaptureEngine:
        """Hook ``model`` with this callback's layers and normalization (no consumer yet);
        ``parameter_grads`` as :class:`~tda_plugins.capture.engine.CaptureEngine` takes it."""
        self.settings = adapt_settings(self.settings, args, model)
        engine = CaptureEngine(
            model,
            self.settings.selection(),
            self.settings.projection_config(),
            (),
            CausalLMNormalization(),
            parameter_grads,
        ).attach()
        engine.resume_at_step(state.global_step)
        self.engine = engine
        return engine

    def pool_gradients(self, model: nn.Module, args: TrainingArguments) -> Any:
        """The pool's gradients at the current weights, in the form :meth:`use_pool`
        takes (default: per-example, through a temporary exclusive engine)."""
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in self.pool.items()}
        return capture_batch(
            model, batch, None, self.settings.selection(), self.settings.projection_config()
        )

    def use_pool(self, pooled: Any, lr_scheduler: Any) -> None:
        """The pool's gradients at the coming step's weights (``None``: not due)."""
        raise NotImplementedError

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.engine is None or model is None:
            return
        if state.global_step % self.every_n_steps:
            self.use_pool(None, lr_scheduler)
            return
        was_training = model.training
        model.eval()
        try:
            pooled = self.pool_gradients(model, args)
        finally:
            model.train(was_training)
        self.use_pool(pooled, lr_scheduler)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.engine is not None:
            self.engine.optimizer_step()

    def step_metrics(self) -> dict[str, float]:
        """Metrics of the latest step for the trainer's logs."""
        return {}

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        metrics = self.step_metrics()
        if logs is None or not metrics or "loss" not in logs:
            return
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def detach(self) -> None:
        """Finish pending micro-batches and unhook."""
        if self.engine is not None:
            self.engine.end()
            self.engine.detach()
            self.engine = None


class InfluenceLoggingCallback(PoolCallback):
    """Logs, during SFT, how each step's examples influence a fixed set of query examples.

    Every ``every_n_steps`` optimizer steps it computes the queries' gradients at the
    current weights (no training engine records that pass), scores the step's
    examples against them from the training backward itself, and adds
    ``influence/q<j>_mean`` and ``influence/q<j>_max`` to the trainer's logs (console,
    ``state.log_history``; for ``report_to`` integrations, add it with
    :meth:`add_to` so it runs before them). At the end it writes ``influence.json``,
    ``influence.html`` (running top-k helpful/harmful examples with their texts) and
    ``influence.png`` to ``report_dir`` (default ``<output_dir>/influence``).

    Args:
        queries: rows with ``input_ids`` (and optional ``labels``, -100 = no loss).
        method: ``"gradcos"`` or ``"graddot"``.
        every_n_steps: score every n-th optimizer step.
        top_k: examples per query in the report.
        report_dir: where the report goes.
        **options: layer/projection fields of :class:`CaptureSettings` (``layers``,
            ``include``, ``projection``, ``k_a``, ...); ``store_dir`` is not used.
    """

    def __init__(
        self,
        queries: list[dict[str, Any]],
        method: Literal["graddot", "gradcos"] = "gradcos",
        every_n_steps: int = 1,
        top_k: int = 5,
        report_dir: str | None = None,
        **options: Any,
    ):
        super().__init__(queries, every_n_steps, options)
        self.logger = InfluenceLogger(method)
        self.top_k = top_k
        self.report_dir = report_dir
        self.report: dict[str, Path] = {}

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        self.attach(args, check_trainer_setup(args, model), state).add_consumer(self.logger)

    def use_pool(self, pooled: MicroBatchRecord | None, lr_scheduler: Any) -> None:
        rate = float(lr_scheduler.get_last_lr()[0]) if lr_scheduler is not None else 1.0
        self.logger.set_queries(pooled, rate)

    def step_metrics(self) -> dict[str, float]:
        return self.logger.metrics()

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.engine is None:
            return
        self.detach()
        query_ids = content_hash(self.pool["input_ids"], self.pool["attention_mask"])
        decode = getattr(processing_class, "decode", None)

        def text(tokens: list[int] | None) -> str | None:
            if tokens is None:
                return None
            return decode(tokens) if decode is not None else " ".join(map(str, tokens))

        seen = self.logger.cumulative_scores(query_ids).train_ids.tolist()
        train_texts = {i: t for i in seen if (t := text(self.logger.tokens_of(i))) is not None}
        query_texts = {
            int(q): str(text(ids[m.bool()].tolist()))
            for q, ids, m in zip(
                query_ids, self.pool["input_ids"], self.pool["attention_mask"], strict=True
            )
        }
        directory = self.report_dir or str(Path(str(args.output_dir)) / "influence")
        self.report = self.logger.write_report(
            directory, query_ids, train_texts, query_texts, self.top_k
        )


def causal_lm_token_counts(record: MicroBatchRecord) -> Tensor:
    """``(B,)`` tokens each example's causal-LM loss sums over: shifted labels != -100."""
    if record.labels is None:
        raise ValueError("data selection needs labels in the model call to count loss tokens")
    return (record.labels[..., 1:] != -100).sum(dim=-1)


class DataSelectionCallback(PoolCallback):
    """Online data selection for ``Trainer``/``SFTTrainer`` (LoRA or full fine-tuning).

    At every optimizer step, scores the step's examples (all micro-batches of the
    accumulation window) against the summed gradient of ``target`` examples, drops the
    ones the rule picks, and removes their exact contributions from ``.grad`` before
    clipping and ``optimizer.step()``: the result equals a fresh backward over the kept
    examples with the trainer's normalization (token mean over the kept examples'
    label tokens, as ``num_items_in_batch`` does). Gradient clipping is taken over while
    training (``max_grad_norm`` is applied after selection) and restored at the end. The
    trainer's logs get ``selection/kept``, ``selection/dropped``, ``selection/mean_score``
    and ``selection/grad_norm``: the corrected gradient's norm before clipping (the
    trainer's own ``grad_norm`` is taken before the selection, so it is not that). In
    full fine-tuning in one process, autograd skips the captured layers' weight gradients
    and the selection builds their ``.grad`` from the kept examples' gradients (cheaper than
    correcting autograd's); under DDP, and for LoRA adapters, autograd computes them and
    the selection corrects them.

    Args:
        target: rows with ``input_ids`` (optional ``labels``): the target pool.
        rule: ``"bottom_fraction"``, ``"threshold"`` or ``"negative_in_bottom"``.
        fraction: share of the step's examples the fraction rules consider.
        threshold: score below which ``"threshold"`` drops.
        score: ``"dot"``, ``"cosine"`` or ``"adam"`` (preconditioned by Adam's state).
        granularity: ``"global"`` or ``"per_layer"``.
        refresh_every: recompute the target gradient every n optimizer steps.
        target_examples: target examples per refresh: ``None`` (default) uses the whole
            pool each time; ``m`` uses the next ``m`` pool examples in turn (the
            dattri-llm protocol: one example of a 16-example pool per step), which
            costs a forward/backward over ``m`` examples instead of the pool.
        score_projection: ``k``: score each layer in a ``k x k`` factor-projected space
            (approximate scores at a fraction of the exact scores' cost, which for full
            fine-tuning is about one extra weight-gradient product per layer); the
            removal stays exact. ``None`` (default): exact scores.
        log_path: JSONL of dropped ids per step (default ``<output_dir>/selection.jsonl``).
        **options: layer fields of :class:`CaptureSettings` (default layers: LoRA
            adapters on PEFT models; full fine-tuning needs ``layers="all"`` so that
            every trainable parameter is covered, else ``on_train_begin`` refuses).
    """

    def __init__(
        self,
        target: list[dict[str, Any]],
        rule: str = "bottom_fraction",
        fraction: float = 0.25,
        threshold: float = 0.0,
        score: ScoreMode = "dot",
        granularity: Granularity = "global",
        refresh_every: int = 1,
        target_examples: int | None = None,
        score_projection: int | None = None,
        log_path: str | None = None,
        **options: Any,
    ):
        if options.get("projection", "none") != "none":
            raise ValueError("data selection removes exact contributions: use projection='none'")
        super().__init__(target, refresh_every, options)
        self.target_pool = TargetPool(self.pool, target_examples)
        self.score_projection = (
            None
            if score_projection is None
            else ProjectionConfig("factor", k_a=score_projection, k_g=score_projection)
        )
        self.rule = rule_by_name(rule, **_rule_options(rule, fraction, threshold))
        self.score = score
        self.granularity = granularity
        self.log_path = log_path
        self.selector: DataSelector | None = None
        self._max_grad_norm = 0.0
        #: Norm of the last step's corrected gradient, before clipping (0-dim tensor).
        self._grad_norm: Tensor | None = None

    @property
    def history(self) -> list[StepSelection]:
        """One :class:`StepSelection` per optimizer step so far."""
        return [] if self.selector is None else self.selector.history

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        model = check_trainer_setup(args, model)
        # Full fine-tuning in one process: the captured layers' .grad is built from the kept
        # examples at the optimizer step (autograd skips those weight gradients). DDP's
        # all-reduce needs autograd's own gradients; a LoRA adapter's is a cheap rank-r
        # product, cheaper than building it again: there it is computed and corrected.
        built = args.world_size == 1 and not has_lora(model)
        engine = self.attach(args, model, state, parameter_grads=not built)
        missing = uncovered_trainable(model, engine.captured_layers)
        if missing:
            self.detach()
            fix = (
                "TRL's fused LM head bypasses the head's forward: freeze the head or train with "
                "label smoothing"
                if uses_fused_head(args)
                else "use layers='all' for full fine-tuning, or freeze them"
            )
            raise UnsupportedTrainingSetup(
                f"{len(missing)} trainable parameters are not captured ({missing[:3]}), so "
                f"their .grad could not be corrected; {fix}"
            )
        log_path = self.log_path or str(Path(str(args.output_dir)) / "selection.jsonl")
        self.selector = DataSelector(
            engine.captured_layers,
            self.rule,
            causal_lm_token_counts,
            self.score,
            self.granularity,
            unwrap_optimizer(optimizer),
            log_path,
            self.score_projection,
        )
        engine.add_consumer(self.selector)
        self._max_grad_norm = float(args.max_grad_norm or 0.0)
        args.max_grad_norm = 0.0  # clipping happens after selection, in on_pre_optimizer_step

    def pool_gradients(self, model: nn.Module, args: TrainingArguments) -> Target:
        """The summed gradient of this refresh's target examples: one plain backward,
        chunked by the training batch size, that the training engine does not record."""
        assert self.engine is not None
        batch = self.target_pool.next_batch(next(model.parameters()).device)
        with self.engine.paused():
            return target_gradient(
                model,
                self.engine.captured_layers,
                batch,
                causal_lm_losses,
                args.per_device_train_batch_size,
            )

    def use_pool(self, pooled: Target | None, lr_scheduler: Any) -> None:
        if pooled is not None and self.selector is not None:
            self.selector.set_target(pooled)

    def on_pre_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().on_pre_optimizer_step(args, state, control)
        if model is None:
            return
        # The trainer's own grad_norm is taken before this event, so before selection:
        # the corrected gradient's norm (before clipping) is logged as selection/grad_norm.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if self._max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), self._max_grad_norm, norm)
        self._grad_norm = norm.detach()

    def step_metrics(self) -> dict[str, float]:
        if not self.history:
            return {}
        last = self.history[-1].summary()
        metrics = {
            "selection/kept": float(last["kept"]),
            "selection/dropped": float(last["dropped"]),
            "selection/mean_score": last["mean_score"],
        }
        if self._grad_norm is not None:
            metrics["selection/grad_norm"] = float(self._grad_norm)
        return metrics

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.detach()
        args.max_grad_norm = self._max_grad_norm


def _rule_options(rule: str, fraction: float, threshold: float) -> dict[str, float]:
    return {"threshold": {"value": threshold}}.get(rule, {"fraction": fraction})
