"""The user's own example ids through the ``Trainer``/``SFTTrainer`` data path.

    trainer = SFTTrainer(..., train_dataset=dataset, callbacks=[GradientCaptureCallback(...)])
    use_id_column(trainer, "id")  # the dataset's integer "id" column names every example

Without it an example's id is a content hash of its tokens after the trainer's own
processing (``tda_plugins.capture.identity``): stable, but not the user's, and equal for
duplicated rows. A dataset column cannot reach a callback by itself: the ``Trainer``
drops the columns its model's ``forward`` does not take, and TRL's collator keeps only
the keys it knows. :func:`use_id_column` carries it through, for every callback of the
trainer at once (capture, influence logging, data selection):

1. the column is kept by the trainer's unused-column removal;
2. the trainer's collator is wrapped: it takes the column out of each row, collates the
   rest as before, and puts the ids in the batch under
   :data:`~tda_plugins.capture.identity.EXAMPLE_IDS_KEY` (a ``(B,)`` int64 tensor);
3. the capture engines read them there in their forward pre-hook, and the model's
   ``forward`` is wrapped to take the key out before the model sees it.
"""

from __future__ import annotations

import functools
import types
from collections import Counter
from collections.abc import Callable, Sequence
from numbers import Integral
from typing import Any

import torch
from torch import nn

from tda_plugins.capture.identity import EXAMPLE_IDS_KEY


class IdColumnCollator:
    """Wraps a collator: ``column`` out of each row, into the batch as example ids.

    Rows without the column (an evaluation set without ids) are collated unchanged.
    """

    def __init__(self, collator: Callable[[list[dict[str, Any]]], dict[str, Any]], column: str):
        self.collator = collator
        self.column = column

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        carrying = [self.column in row for row in rows]
        if not any(carrying):
            return self.collator(list(rows))
        if not all(carrying):
            raise ValueError(
                f"some rows of a batch have no {self.column!r}: give every example an id"
            )
        ids = [_integer_id(row[self.column], self.column) for row in rows]
        batch = self.collator([{k: v for k, v in row.items() if k != self.column} for row in rows])
        batch[EXAMPLE_IDS_KEY] = torch.tensor(ids, dtype=torch.long)
        return batch


def use_id_column(trainer: Any, column: str = "id") -> None:
    """Name the trainer's examples by its training dataset's integer ``column``.

    Call it once, after building the trainer and before ``trainer.train()``. The store,
    ``selection.jsonl``, the influence report and the scores then use these ids; two rows
    with the same text and different ids stay two examples.

    Raises:
        ValueError: the dataset has no such column, its values are not integers, or an
            id repeats (two examples under one id would be scored as one).
    """
    if isinstance(trainer.data_collator, IdColumnCollator):
        raise ValueError("use_id_column was already called on this trainer")
    _check_column(trainer.train_dataset, column)
    if trainer.args.remove_unused_columns:
        keep = getattr(trainer, "_set_signature_columns_if_needed", None)
        if keep is None:
            raise TypeError(
                f"{type(trainer).__name__} has no unused-column removal this function knows; "
                "set remove_unused_columns=False in the training arguments"
            )
        keep()
        if column not in trainer._signature_columns:
            trainer._signature_columns.append(column)
    trainer.data_collator = IdColumnCollator(trainer.data_collator, column)
    _forward_without_ids(trainer.model)


def _forward_without_ids(model: nn.Module) -> None:
    """Wrap ``model.forward`` (bound to ``model``, so a deep copy rebinds it) to drop the
    ids key: pre-hooks, the engines' included, still see it."""
    forward = model.forward
    function = forward.__func__ if isinstance(forward, types.MethodType) else type(model).forward

    @functools.wraps(function)
    def without_ids(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop(EXAMPLE_IDS_KEY, None)
        return function(self, *args, **kwargs)

    model.forward = types.MethodType(without_ids, model)


def _check_column(dataset: Any, column: str) -> None:
    """Refuse a missing, non-integer or repeating id column of a map-style dataset (an
    iterable dataset is checked batch by batch by the collator)."""
    names = getattr(dataset, "column_names", None)
    if not isinstance(names, list):
        return
    if column not in names:
        raise ValueError(
            f"the training dataset has no column {column!r} (it has {names}); add one, "
            f"e.g. dataset.add_column({column!r}, list(range(len(dataset))))"
        )
    values = dataset[column]
    for value in values:
        _integer_id(value, column)
    repeated = next((i for i, n in Counter(values).items() if n > 1), None)
    if repeated is not None:
        raise ValueError(
            f"id {repeated} occurs twice in the {column!r} column: give each example its own id"
        )


def _integer_id(value: Any, column: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(
            f"example ids must be integers, but {column!r} holds {value!r}; map your ids to "
            f"integers first (e.g. dataset.add_column('row', list(range(len(dataset)))) and "
            "use_id_column(trainer, 'row'), keeping your own ids in the dataset)"
        )
    if not -(2**63) <= int(value) < 2**63:
        raise ValueError(f"example id {value} in {column!r} does not fit in int64")
    return int(value)
