"""``DataSelectionCallback``: online data selection for ``Trainer``/``SFTTrainer``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import TrainerControl, TrainerState, TrainingArguments

from tda_plugins.api import causal_lm_losses
from tda_plugins.capture import MicroBatchRecord
from tda_plugins.capture.layers import has_lora, uncovered_trainable
from tda_plugins.data_selection import DataSelector, StepSelection, rule_by_name
from tda_plugins.data_selection.selector import Granularity, ScoreMode
from tda_plugins.data_selection.target import Target, TargetPool, target_gradient
from tda_plugins.grads.projection import ProjectionConfig
from tda_plugins.integrations.transformers.pool import PoolCallback
from tda_plugins.integrations.transformers.setup import (
    check_trainer_setup,
    unwrap_optimizer,
    uses_fused_head,
)
from tda_plugins.session import UnsupportedTrainingSetup


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
        lossless = ((self.pool["labels"][:, 1:] != -100).sum(dim=1) == 0).nonzero().flatten()
        if lossless.numel():
            raise ValueError(
                f"target examples {lossless.tolist()} have no token with a loss (all labels "
                "-100, or a single token): their gradient is zero and every score would be 0; "
                "give each target example at least one predicted label"
            )
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
        if model is None or self.selector is None or self.selector.grad_norm is None:
            return
        # The trainer's own grad_norm is taken before this event, so before selection:
        # the corrected gradient's norm (before clipping; every trainable parameter is a
        # captured one) is logged as selection/grad_norm. A skipped step has no .grad.
        norm = self.selector.grad_norm
        if self._max_grad_norm > 0 and bool(torch.isfinite(norm)):
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), self._max_grad_norm, norm)
        self._grad_norm = norm.detach()

    def step_metrics(self) -> dict[str, float]:
        if not self.history:
            return {}
        last = self.history[-1].summary()
        metrics = {
            "selection/kept": float(last["kept"]),
            "selection/dropped": float(last["dropped"]),
            "selection/non_finite": float(len(last["non_finite_ids"])),
            "selection/skipped": float(last["skipped"]),
        }
        if last["mean_score"] is not None:
            metrics["selection/mean_score"] = last["mean_score"]
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
