"""``tda_plugins.attribute``: the Python form of ``tda attribute``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tda_plugins.methods.base import method_by_name
from tda_plugins.methods.scores import Scores
from tda_plugins.parallel.ranks import Ranks
from tda_plugins.store.reader import StoreReader


def attribute(
    store: str | Path | StoreReader,
    queries: str | Path | StoreReader,
    method: str = "graddot",
    *,
    allow_mismatch: bool = False,
    chunk_examples: int | None = None,
    progress: bool = False,
    ranks: Ranks | None = None,
    **options: Any,
) -> Scores:
    """Score every training example of ``store`` against every query of ``queries``.

    Args:
        store: the training gradient store (a path, or an open :class:`StoreReader`).
        queries: the query store, captured with the same projection and at least the
            store's layers (more are left out of the scores, with a warning).
        method: a registered method (``graddot``, ``gradcos``, ``tracin``, ``kfac``,
            ``ekfac``, ``logra``, ``less``).
        allow_mismatch: score queries of another model than the store's anyway.
        chunk_examples: training examples scored at once (default: from the query count).
        progress: show a progress bar.
        ranks: the ranks to spread the scoring over (under ``torchrun``: each scores a part
            of the store, every rank gets the whole result); ``None``: this process alone.
        **options: the method's own options (``damping=0.1`` for the curvature methods,
            refused for the others; TracIn's ``learning_rate`` and ``extra`` checkpoints),
            and, for ``graddot``, ``gradcos``, ``tracin`` and ``less``, which parameters
            count: ``exclude_params=("bias",)`` leaves out every parameter whose name
            within its layer, or full name ``<layer>.<name>``, matches one of the glob
            patterns, and ``normalize_layers=True`` unit-normalizes each layer's gradient
            per example before the dot (:class:`~tda_plugins.methods.groups.ParameterGroups`).

    Returns:
        :class:`Scores` (``(N, M)``, higher = more helpful; each example's gradient is that
        of its own summed token loss; one row per example id, an example the store holds
        more than once, as after several epochs, scoring the sum of its occurrences),
        with the stores' texts where they hold them:
        ``scores.top_k(10)``, ``scores.to_pandas()``, ``scores.to_dataset()``.
    """
    scorer = method_by_name(method, **options)
    if "damping" in options and not scorer.preconditioner.needs_curvature:
        raise ValueError(
            f"damping applies to the curvature methods (kfac, ekfac, logra); {method!r} has "
            "no curvature to damp: leave damping out"
        )
    train = store if isinstance(store, StoreReader) else StoreReader(store)
    query = queries if isinstance(queries, StoreReader) else StoreReader(queries)
    scores = scorer.score(
        train, query, chunk_examples, progress, allow_mismatch=allow_mismatch, ranks=ranks
    )
    return replace(scores, train_texts=train.lazy_texts(), query_texts=query.texts())
