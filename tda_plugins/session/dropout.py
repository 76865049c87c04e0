"""Dropout in a training run: its stored and scored gradients are those of each step's
dropped-out forward, while queries and selection targets are taken in eval mode, without
it. Warned once per callback at the start of training, with the way out."""

from __future__ import annotations

import logging

from torch import nn
from torch.nn.modules.dropout import _DropoutNd

logger = logging.getLogger("tda_plugins")


def active_dropout(model: nn.Module) -> list[str]:
    """What drops out in ``model``'s training forward: its dropout modules of ``p > 0``
    (PEFT's ``lora_dropout`` among them), and the config's ``attention_dropout`` where
    positive (transformers' Llama family applies it functionally)."""
    found = [
        f"{name} (p={module.p:g})"
        for name, module in model.named_modules()
        if isinstance(module, _DropoutNd) and module.p > 0
    ]
    attention = getattr(getattr(model, "config", None), "attention_dropout", 0.0)
    if isinstance(attention, (int, float)) and attention > 0:
        found.append(f"config.attention_dropout={attention:g}")
    return found


def warn_dropout(model: nn.Module, what: str) -> None:
    """Warn that ``what`` (the store and its scores, the logged scores) use gradients of
    the dropped-out forward when ``model`` trains with dropout."""
    found = active_dropout(model)
    if not found:
        return
    shown = ", ".join(found[:3]) + (f", ... ({len(found)} in all)" if len(found) > 3 else "")
    logger.warning(
        "tda-plugins: the model trains with dropout (%s): %s use the gradients of each "
        "step's dropped-out forward, while queries and selection targets are taken without "
        "dropout; for scores that compare like with like, train with dropout 0 (PEFT "
        "lora_dropout=0, the model config's dropout fields)",
        shown,
        what,
    )
