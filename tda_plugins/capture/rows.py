"""Which example each leading row of a layer call belongs to.

A captured call is per-example when its output lines up with the micro-batch's ``B``
examples of ``T`` tokens in one of three layouts:

* ``(B, T, ...)``: the ordinary case;
* ``(1, T, ...)``: a call shared by the whole batch (GPT-2's position embedding), broadcast
  to every example: its output is expanded to ``(B, T, ...)``, numerically the same
  broadcast, so that the gradient arriving there is per-example;
* ``(B*T, N)``: the batch's tokens flattened row-major, example by example, for the
  layers inside a module known to call them so (:data:`ROW_MAJOR_OWNERS`: OPT's decoder
  layer, whose MLP and its norm run on ``hidden_states.reshape(-1, H)``; Qwen2-MoE's
  sparse block, whose shared expert and its gate do): input and output gradient are
  viewed as ``(B, T, ...)``. Shapes cannot tell row-major tokens from a sequence-first
  layout or an MoE expert given every token, so a ``(B*T, N)`` call elsewhere is refused.

A call of three or more dimensions may have another middle length than ``T`` (a second
input of its own length per example). A two-dimensional call is one row per token where
``T`` is known (``(B, N)`` rows then are not the examples); where ``T`` is not known from
the forward (no ids, mask or labels of two dimensions), ``B`` rows. In a forward that
carries images, video or audio (:func:`other_inputs`) only ``(B, T, ...)`` calls are
taken for the examples: a vision or audio tower's rows are images, patches or frames.

Any other call is refused, naming the layer: its rows are not the examples, though their
count may match by chance (an MoE expert's routed tokens, ``B`` of them or ``B*T``; a
vision tower's images or patches; a sequence-first layout). The one layout the shapes
cannot prove is the flattened one's order, so it is checked where the batch has padding
(:func:`check_row_major`): at the padded positions of an example none of whose padded
positions carries loss, a causal LM's gradient is exactly zero (attention masks them out
of every real position), so a flattened layer whose gradient is not zero at the rows
row-major order puts such a position at holds its tokens in another order. The check
reads the host, so it runs at a layer's first :data:`FIRST` padded micro-batches and at
every :data:`EVERY`-th after; without padding a flattened layer's order is not checked.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tda_plugins.capture.adapters.base import qualified_name
from tda_plugins.capture.names import named_modules
from tda_plugins.capture.targets import predicted_labels

#: The modules (by qualified class name) that call their layers on the batch's tokens
#: flattened row-major, ``(B*T, N)``; a model of one's own that does adds its class here.
ROW_MAJOR_OWNERS: set[str] = {
    "transformers.models.opt.modeling_opt.OPTDecoderLayer",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
}

#: Padded micro-batches whose flattened layers' row order is checked at the start ...
FIRST = 4
#: ... and, after those, every ``EVERY``-th micro-batch of the run.
EVERY = 16


class UnsplittableRows(RuntimeError):
    """A layer call whose rows cannot be assigned to the micro-batch's examples."""


@dataclass(frozen=True)
class RowLayout:
    """How one call's leading rows map to ``examples`` examples.

    ``tokens``: the rows are the ``examples * tokens`` tokens, flattened row-major
    (``None``: one row per example).
    """

    examples: int
    tokens: int | None = None

    @property
    def flattened(self) -> bool:
        return self.tokens is not None

    def per_example(self, t: Tensor) -> Tensor:
        """``(B*T, ...) -> (B, T, ...)`` for a flattened call; else ``t`` unchanged."""
        return t.unflatten(0, (self.examples, self.tokens)) if self.tokens is not None else t


def row_major_layers(model: nn.Module, names: Iterable[str]) -> set[str]:
    """The layers among ``names`` that sit inside a module of :data:`ROW_MAJOR_OWNERS`
    (a LoRA adapter of one of its layers too)."""
    owners = [
        prefix
        for prefix, module in named_modules(model)
        if qualified_name(type(module)) in ROW_MAJOR_OWNERS
    ]
    return {n for n in names if any(not o or n.startswith(f"{o}.") for o in owners)}


def row_layout(
    name: str,
    shape: torch.Size,
    examples: int,
    tokens: int | None,
    *,
    other_inputs: bool,
    row_major: bool,
) -> RowLayout | None:
    """The layout of a call of layer ``name`` whose output has ``shape``, in a micro-batch
    of ``examples`` examples of ``tokens`` tokens (``None``: unknown); ``None`` for a call
    shared by the whole batch (one row, to expand). ``other_inputs``: the forward carries
    inputs other than tokens (:func:`other_inputs`), whose layers' rows may match the
    batch's by count, so only a ``(B, T, ...)`` call is taken for the examples.
    ``row_major``: the layer sits in a module of :data:`ROW_MAJOR_OWNERS`, so a
    ``(B*T, N)`` call is the tokens flattened row-major. Raises :class:`UnsplittableRows`."""
    rows, sequence = shape[0], len(shape) >= 3
    if other_inputs:
        if sequence and rows == examples and shape[1] == tokens:
            return RowLayout(examples)
    elif tokens is not None and tokens > 1 and len(shape) == 2:
        if row_major and rows == examples * tokens:
            return RowLayout(examples, tokens)
    elif rows == examples:
        return RowLayout(examples)
    elif rows == 1 and sequence:
        return None
    batch = f"{examples} examples" + ("" if tokens is None else f" of {tokens} tokens")
    raise UnsplittableRows(
        f"layer {name!r} was called on an input of shape {tuple(shape[:-1])} in a "
        f"micro-batch of {batch}: neither one row per example (of every token) nor one per "
        "token, so its rows are not the examples, though their count may match (an MoE "
        "expert's routed tokens, a vision tower's images or patches, a sequence-first "
        "layout), and its gradient cannot be split per example; exclude it from the "
        "LayerSelection (LayerSelection(exclude=...); for LoRA, target_modules without it), "
        "or, if the module that calls it flattens the batch's tokens row-major, add that "
        "module's class to tda_plugins.capture.rows.ROW_MAJOR_OWNERS"
    )


def order_check_due(checked: int, micro_batch: int) -> bool:
    """Whether a flattened layer's order is checked at run micro-batch ``micro_batch``
    (0-based), ``checked`` padded micro-batches having been checked before."""
    return checked < FIRST or micro_batch % EVERY == 0


def checkable_positions(
    token_mask: Tensor, labels: Tensor | None, shift_labels: Tensor | None
) -> Tensor:
    """``(B, T)`` bool: the padded positions whose gradient a causal LM leaves at exactly
    zero: those of the examples none of whose padded positions carries loss. (A padded
    position that does, such as the last left pad predicting the first real token, has a
    gradient, and so may the pads before it: a padded query that the mask leaves nothing
    to attend to attends to every position, the other pads included.)

    ``token_mask`` is true at real tokens; a position's own next-token target is
    ``shift_labels`` at it, or ``labels`` one to its right, ignored at ``-100`` and past
    the end. Without labels, a padded position followed by a real token counts as
    carrying loss."""
    padded = ~token_mask.bool()
    targets = predicted_labels(labels, shift_labels)
    if targets is not None and targets.shape == padded.shape:
        ignored = (targets == -100).to(padded.device)
    else:
        ignored = torch.ones_like(padded)
        ignored[:, :-1] = padded[:, 1:]
    loss_at_padding = (padded & ~ignored).any(dim=1, keepdim=True)
    return padded & ~loss_at_padding


def check_row_major(name: str, grad: Tensor, positions: Tensor) -> bool:
    """Refuse a flattened call of layer ``name`` whose ``(B*T, ...)`` output gradient is not
    zero at ``positions`` (``(B, T)`` bool, from :func:`checkable_positions`) taken
    row-major: its rows are not the batch's tokens in that order. Returns whether the
    check could be made (some position, every value there finite)."""
    values = grad[positions.reshape(-1).to(grad.device)]
    if not values.numel() or not bool(values.isfinite().all()):
        return False
    if bool(values.any()):
        raise UnsplittableRows(
            f"layer {name!r} was called on one row per token of the micro-batch, but its "
            "gradient is not zero at the padded positions (of examples whose padding carries "
            "no loss) that the batch's row-major order puts its rows at: its rows hold the "
            "tokens in another order (an MoE expert given every token, by routing slot; a "
            "sequence-first layout), or the loss reaches padded positions; its gradient "
            "cannot be split per example: exclude it from the LayerSelection"
        )
    return True


def token_length(*candidates: Tensor | None) -> int | None:
    """``T``: the second dimension of the first of ``candidates`` (the forward's
    ``input_ids`` or embeddings, attention mask, labels) that is ``(B, T)`` ids, labels or
    mask, or ``(B, T, H)`` embeddings (a ``(B, H)`` float input has no tokens)."""
    return next(
        (
            t.shape[1]
            for t in candidates
            if isinstance(t, Tensor) and t.dim() >= (3 if t.is_floating_point() else 2)
        ),
        None,
    )


#: How the keywords of a transformers forward that carry images, video or audio begin.
OTHER_INPUTS = ("pixel_", "image_", "video_", "audio_", "input_features", "input_values")


def other_inputs(kwargs: dict[str, object]) -> bool:
    """Whether a forward's keywords carry a tensor of images, video or audio
    (:data:`OTHER_INPUTS`): a vision or audio tower's rows are images, patches or frames,
    whose count can match the batch's."""
    return any(k.startswith(OTHER_INPUTS) and isinstance(v, Tensor) for k, v in kwargs.items())
