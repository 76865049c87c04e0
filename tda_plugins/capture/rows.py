"""Which example each leading row of a layer call belongs to.

A captured call is per-example when its leading dimension lines up with the micro-batch's
``B`` examples of ``T`` tokens in one of three layouts:

* ``(B, ...)``: the ordinary case;
* ``(1, ...)``: a call shared by the whole batch (GPT-2's position embedding), broadcast to
  every example: its output is expanded to ``(B, ...)``, numerically the same broadcast,
  so that the gradient arriving there is per-example;
* ``(B*T, ...)``: the batch's tokens flattened row-major, example by example (OPT's MLP
  and its norm, an MoE's router and shared expert): input and output gradient are viewed
  as ``(B, T, ...)``. Row-major order is checked where the batch has padding: the
  gradient at a padded position of a causal LM is exactly zero (attention masks it out of
  every other position and its label is ignored), so a flattened layer whose gradient is
  not zero at the rows row-major order puts the padding at holds the tokens in another
  order, and is refused. One host read per layer, at its first padded micro-batch.

Any other leading dimension (an MoE expert's routed subset of tokens, a sequence-first
layout) cannot be split per example and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


class UnsplittableRows(RuntimeError):
    """A layer call whose rows cannot be assigned to the micro-batch's examples."""


@dataclass(frozen=True)
class RowLayout:
    """How one call's ``rows`` leading entries map to ``examples`` examples.

    ``flattened``: the rows are the ``examples * tokens`` tokens, row-major.
    """

    examples: int
    tokens: int | None = None

    @property
    def flattened(self) -> bool:
        return self.tokens is not None

    def per_example(self, t: Tensor) -> Tensor:
        """``(B*T, ...) -> (B, T, ...)`` for a flattened call; else ``t`` unchanged."""
        return t.unflatten(0, (self.examples, self.tokens)) if self.tokens is not None else t


def row_layout(name: str, rows: int, examples: int, tokens: int | None) -> RowLayout | None:
    """The layout of a call of layer ``name`` with ``rows`` leading entries in a micro-batch
    of ``examples`` examples of ``tokens`` tokens (``None``: unknown); ``None`` for a call
    shared by the whole batch (one row, to expand). Raises :class:`UnsplittableRows`."""
    if rows == examples:
        return RowLayout(examples)
    if rows == 1:
        return None
    if tokens is not None and rows == examples * tokens:
        return RowLayout(examples, tokens)
    shape = f"{examples} examples" + ("" if tokens is None else f" of {tokens} tokens")
    raise UnsplittableRows(
        f"layer {name!r} was called on {rows} rows in a micro-batch of {shape} (neither one "
        "row per example nor one per token), so its gradient cannot be split per example "
        "(an MoE expert's routed tokens, a sequence-first layout); exclude it from the "
        "LayerSelection"
    )


def check_row_major(name: str, grad: Tensor, token_mask: Tensor) -> None:
    """Refuse a flattened call of layer ``name`` whose ``(B*T, ...)`` output gradient is not
    zero at the padded positions of ``token_mask`` (``(B, T)`` bool, true at real tokens)
    taken row-major: its rows are not the batch's tokens in that order."""
    padded = ~token_mask.reshape(-1).to(grad.device)
    if bool(grad[padded].any()):
        raise UnsplittableRows(
            f"layer {name!r} was called on one row per token of the micro-batch, but not in "
            "the batch's row-major (example by example) order: its gradient is not zero at "
            "the padded positions that order puts its rows at, so its gradient cannot be "
            "split per example; exclude it from the LayerSelection"
        )


def token_length(*candidates: Tensor | None) -> int | None:
    """``T``: the second dimension of the first ``(B, T, ...)`` tensor among ``candidates``
    (the forward's ``input_ids`` or embeddings, attention mask, labels)."""
    return next((t.shape[1] for t in candidates if isinstance(t, Tensor) and t.dim() >= 2), None)
