"""One-call convenience: the exact per-example gradients of a batch, through the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tda_plugins.capture.consumer import RecordCollector
from tda_plugins.capture.engine import CaptureEngine
from tda_plugins.capture.layers import LayerSelection
from tda_plugins.capture.names import canonical_name
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.capture.targets import next_token_targets
from tda_plugins.grads.projection import ProjectionConfig

LossFn = Callable[[nn.Module, Mapping[str, Any]], Tensor]


def causal_lm_example_losses(logits: Tensor, labels: Tensor) -> Tensor:
    """``(B, T, V)`` logits, ``(B, T)`` labels -> ``(B,)`` summed next-token losses.

    Labels are shifted inside (as transformers' causal LMs do); ``-100`` is ignored.
    Each example's loss is the *sum* over its predicted tokens, not the mean.
    """
    return next_token_example_losses(logits, next_token_targets(labels))


def next_token_example_losses(logits: Tensor, targets: Tensor) -> Tensor:
    """``(B, T, V)`` logits, ``(B, T)`` targets already shifted (position ``t`` predicts
    ``targets[:, t]``, transformers' ``shift_labels``) -> ``(B,)`` summed token losses;
    ``-100`` is ignored."""
    # Cross entropy over the flattened (B*T, V) logits: no transposed or shifted copy.
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> fp32, fp64 stays
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(dtype),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="none",
    )
    return per_token.view(targets.shape).sum(dim=1)


def causal_lm_losses(model: nn.Module, batch: Mapping[str, Any]) -> Tensor:
    """``(B,)`` summed next-token losses of a transformers causal LM on ``batch``."""
    if "labels" not in batch:
        raise ValueError(
            "loss_fn=None needs a causal LM batch with 'labels' (use input_ids with padding "
            "set to -100); pass loss_fn for other models"
        )
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    return causal_lm_example_losses(logits, batch["labels"])


@contextmanager
def grads_set_aside(model: nn.Module) -> Iterator[None]:
    """Inside the block every trainable parameter's ``.grad`` starts as ``None``; the
    caller's ``.grad`` tensors are put back afterwards. For a real backward between
    training micro-batches (reentrant checkpointing cannot run under ``autograd.grad``)
    that must not touch the training step's gradients."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in trainable]
    try:
        for p in trainable:
            p.grad = None
        yield
    finally:
        for p, g in zip(trainable, saved, strict=True):
            p.grad = g


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Inside the block the model is in eval mode (no dropout: a pool's or query's
    gradient at the current weights is deterministic); its mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def capture_batch(
    model: nn.Module,
    batch: Mapping[str, Any],
    loss_fn: LossFn | None = None,
    layers: LayerSelection | None = None,
    projection: ProjectionConfig | None = None,
) -> MicroBatchRecord:
    """Capture one batch through a temporary engine: each example's own loss gradient.

    Same arguments as :func:`per_example_gradients`, plus ``projection``; returns the
    engine's record (factorized or projected). The model's ``.grad`` is set aside during
    the backward and restored, and other engines attached to the model (a training run's)
    do not record this pass.
    """
    loss_fn = loss_fn or causal_lm_losses
    collector = RecordCollector()
    # the model's .grad is set aside anyway: autograd need not build its weight gradients
    engine = CaptureEngine(
        model, layers=layers, projection=projection, consumers=[collector], parameter_grads=False
    )
    with grads_set_aside(model), engine, engine.exclusive():
        with torch.enable_grad():
            losses = loss_fn(model, batch)
            if losses.dim() != 1:
                raise ValueError(
                    f"loss_fn must return (B,) per-example losses, got shape {tuple(losses.shape)}"
                )
            losses.sum().backward()
        engine.flush()
    if len(collector.records) != 1:
        raise RuntimeError(
            f"expected one captured micro-batch, got {len(collector.records)}: loss_fn must "
            "make exactly one forward call of the model"
        )
    return collector.records[0]


def per_example_gradients(
    model: nn.Module,
    batch: Mapping[str, Any],
    loss_fn: LossFn | None = None,
    layers: LayerSelection | None = None,
) -> dict[str, Tensor]:
    """Exact per-example gradients of ``batch`` for every captured parameter.

    Args:
        model: the model; its ``.grad`` is set aside during the backward and restored.
        batch: keyword inputs of ``model``; for ``loss_fn=None``, a transformers causal LM
            batch with ``input_ids``, optional ``attention_mask`` and ``labels``.
        loss_fn: ``loss_fn(model, batch) -> (B,)`` per-example losses. Default: each
            example's own *summed* next-token cross-entropy over labels that are not -100.
        layers: which layers to capture (default: LoRA adapters if present, else linear).

    Returns:
        parameter name (as in ``model.named_parameters()``) -> ``(B, *param.shape)``, in
        fp32 (fp64 for fp64 models): the gradient of each example's own loss. Parameters
        shared between captured modules (tied weights) get the sum of their contributions.
    """
    return canonical_grads(model, capture_batch(model, batch, loss_fn, layers))


def canonical_grads(model: nn.Module, record: MicroBatchRecord) -> dict[str, Tensor]:
    """A record's per-example gradients keyed like ``model.named_parameters()`` (each
    ``(B, *param.shape)``): the uses of a shared parameter (tied weights), recorded under
    each module's own name, summed into one. The record names layers by their canonical
    names (:mod:`~tda_plugins.capture.names`)."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    by_module = {canonical_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    out: dict[str, Tensor] = {}
    for qualified, grad in record.param_grads().items():
        name = canonical[id(by_module[qualified])]
        out[name] = out[name] + grad if name in out else grad
    return out
