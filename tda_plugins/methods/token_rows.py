"""One example's per-token scores over its occurrences in a store, in one row layout.

A training store holds an example once per step it was trained in (several epochs, or
duplicated rows under one content hash), each occurrence in a row padded to its own
micro-batch: ``T`` differs between them, and so do the real tokens' positions when
the padding is on the left. Its score sums the occurrences
(:meth:`~tda_plugins.methods.scores.Scores.summed_by_id`), so its token scores do too,
token by token. The ``L`` real tokens sit at the start of each row (right padding) or at
its end (left padding), the same side for every occurrence (one tokenizer pads the whole
run); ``L`` and the layout of the result are those the store saved with the example's
tokens (:class:`~tda_plugins.store.texts.TokenTexts`). A padded position scores zero (no
loss reaches it, and no real token attends to it), so a row's real tokens carry all of
its score.
"""

from __future__ import annotations

from torch import Tensor

from tda_plugins.store.layout import StoreError
from tda_plugins.store.texts import TokenTexts


def summed_occurrences(example_id: int, rows: list[Tensor], tokens: TokenTexts | None) -> Tensor:
    """The ``(M, T)`` token scores of example ``example_id`` from its occurrences'
    ``(M, T_k)`` ``rows`` (store order).

    Rows of one length hold the real tokens at the same positions and are added as they
    are. Otherwise each occurrence's ``L`` real tokens are added, token by token, into
    a row in the layout the store saved (``tokens.positions``; ``T`` its last position
    plus one): taken from the end of a row when the run pads on the left (the saved
    layout starts past 0) and otherwise from the side whose padded positions score
    zero. Refused where the layout is unknown (a store without texts) or is not one
    run of tokens, or a side cannot be told."""
    first = rows[0]
    if all(r.shape == first.shape for r in rows):
        return sum(rows[1:], first.clone())
    positions = _contiguous(tokens)
    if positions is None:
        raise StoreError(
            f"example {example_id} is stored {len(rows)} times in rows of different lengths, "
            "and the store saved no layout of its tokens (one run of positions) that tells "
            "where they sit in each, so its token scores cannot be added up: capture with "
            "store_texts=True, or score without --tokens"
        )
    length = len(positions)
    right = None if positions[0] == 0 else False
    out = first.new_zeros(*first.shape[:-1], positions[-1] + 1)
    for row in rows:
        out[..., positions[0] :] += row[..., _real_tokens(example_id, row, length, right)]
    return out


def _contiguous(tokens: TokenTexts | None) -> list[int] | None:
    """The saved real-token positions when they are one run; ``None`` otherwise."""
    if tokens is None or not tokens.positions:
        return None
    positions = tokens.positions
    return positions if positions == list(range(positions[0], positions[-1] + 1)) else None


def _real_tokens(example_id: int, row: Tensor, length: int, right: bool | None) -> slice:
    """Where the ``length`` real tokens sit in ``(M, T_k)`` ``row``: at its start when
    the run pads on the right, at its end when on the left (``right``: ``None`` when
    unknown, then told by which padded positions score zero)."""
    width = row.shape[-1]
    start, end = slice(0, length), slice(width - length, width)
    if length == width:
        return start
    if right is None:
        pads_right = not bool(row[..., length:].any())
        pads_left = not bool(row[..., : width - length].any())
        if pads_right == pads_left:
            raise StoreError(
                f"example {example_id} is stored in rows of different lengths, and which "
                "side of one is padding cannot be told, so its token scores cannot be added "
                "up: score without --tokens"
            )
        right = pads_right
    return start if right else end
