"""Pools of examples given as token ids, scored against each step at its weights: the
selection target of :class:`~tda_plugins.integrations.olmo_core.DataSelectionCallback`
and the queries of :class:`~tda_plugins.integrations.olmo_core.InfluenceLoggingCallback`.

A pool is a ``(P, T)`` tensor of token ids or ``P`` token-id lists of any lengths. Its
examples' loss is each sequence's own *summed* next-token cross-entropy (no z-loss term),
from the logits of a plain ``model(input_ids)`` call: OLMo-core's ``labels`` convention
(inputs shifted left, the train module's ``label_ignore_index`` where nothing is
predicted), without its ``loss_div_factor``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PoolTokens = Tensor | Sequence[Sequence[int]]


def pool_rows(tokens: PoolTokens) -> list[list[int]]:
    """The pool's sequences as token-id lists (a tensor's rows whole, lists as given)."""
    if isinstance(tokens, Tensor):
        if tokens.dim() != 2 or tokens.is_floating_point():
            raise ValueError(f"a pool must be a (P, T) tensor of token ids, got {tokens.shape}")
        return [list(map(int, row)) for row in tokens.tolist()]
    return [list(map(int, row)) for row in tokens]


def pool_batch(tokens: PoolTokens, ignore_index: int = -100) -> dict[str, Tensor]:
    """``(P, T)`` ``input_ids`` and OLMo-core ``labels`` (inputs shifted left,
    ``ignore_index`` at the last position and at padding) of a pool: a ``(P, T)`` tensor
    of token ids, or token-id lists of any lengths (right-padded with token 0, which
    carries no loss)."""
    rows = pool_rows(tokens)
    length = max((len(r) for r in rows), default=0)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    real = torch.zeros_like(ids, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        real[i, : len(row)] = True
    if ids.shape[0] == 0 or ids.shape[1] < 2:
        raise ValueError("a pool needs at least one sequence of two or more tokens")
    labels = ids.masked_fill(~real, ignore_index)
    labels = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    if not bool((labels != ignore_index).any(dim=1).all()):
        raise ValueError("every pool sequence needs at least two tokens (one predicted)")
    return {"input_ids": ids, "labels": labels}


def summed_token_losses(model: nn.Module, batch: Mapping[str, Tensor], ignore_index: int) -> Tensor:
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
