"""Token-level scores of each query's top-k examples: which tokens made an example
helpful or harmful (``tda attribute --tokens``).

An example's score is a sum over its tokens (``dW_i = sum_t g_it a_it^T``, so
``<P g_q, dW_i> = sum_t <P g_q, g_it a_it^T>``); the share of token ``t`` is the term of
position ``t``: the loss terms and activations at that position of the training example.
Only stores kept with per-token factors (``keep_tokens``) have them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from tda_plugins.methods.base import AttributionMethod
from tda_plugins.methods.scores import Scores
from tda_plugins.store.layout import StoreError
from tda_plugins.store.reader import StoreReader
from tda_plugins.store.texts import TokenTexts

#: Methods whose score is one pass of ``<P g_q, T g_z>`` over the store's per-token
#: factors: TracIn adds other checkpoints, LESS turns each example into a dense update.
TOKEN_METHODS = ("graddot", "gradcos", "kfac", "ekfac", "logra")
TOKENS_FILE = "tokens.json"


def require_token_scores(store: StoreReader, method: str) -> None:
    """Refuse, before any scoring, what cannot give token scores (with the way out)."""
    if method not in TOKEN_METHODS:
        raise ValueError(
            f"token scores are defined for {', '.join(TOKEN_METHODS)}, not {method!r}; "
            "leave --tokens out or pick one of those"
        )
    if not store.metadata.get("keep_tokens", False):
        raise StoreError(
            f"{store.root} keeps no per-token factors, which token scores need: recapture "
            "with `tda capture --keep-tokens` (or the callback's keep_tokens=True)"
        )


def token_report(
    scorer: AttributionMethod,
    store: StoreReader,
    queries: StoreReader,
    scores: Scores,
    k: int,
) -> list[dict[str, Any]]:
    """Per query, its top-k helpful and harmful examples (:meth:`Scores.top_k`), each
    with the score of every real token (its values sum to the example's score).

    Returns:
        ``[{"query_id", "helpful": [entry], "harmful": [entry]}]``, each entry
        ``{"id", "score", "positions", "values", "tokens"}``: ``values[j]`` is the score of
        the token at ``positions[j]`` of the captured row, ``tokens[j]`` its text (``None``
        where the store saved no tokens: then every position of the row is listed).
    """
    top = scores.top_k(k)
    wanted = sorted({r["id"] for q in top for side in ("helpful", "harmful") for r in q[side]})
    per_token = scorer.token_scores(store, queries, wanted) if wanted else {}
    texts = store.token_texts(wanted)
    column = {int(q): j for j, q in enumerate(scores.query_ids.tolist())}
    report = []
    for entry in top:
        j = column[entry["query_id"]]
        sides = {
            side: [_entry(r, per_token[r["id"]][j], texts.get(r["id"])) for r in entry[side]]
            for side in ("helpful", "harmful")
        }
        report.append({"query_id": entry["query_id"], **sides})
    return report


def _entry(row: dict[str, Any], values: Tensor, tokens: TokenTexts | None) -> dict[str, Any]:
    """One example's token scores: ``values`` is its ``(T,)`` row of the query."""
    positions = list(range(values.shape[0])) if tokens is None else tokens.positions
    return {
        "id": row["id"],
        "score": row["score"],
        "positions": positions,
        "values": values[positions].tolist(),
        "tokens": None if tokens is None else tokens.pieces,
    }
