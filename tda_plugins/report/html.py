"""A self-contained HTML page: each query with its most helpful and most harmful examples."""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from pathlib import Path
from typing import Any

from tda_plugins.methods.scores import Scores
from tda_plugins.store.io import atomic_write_bytes
from tda_plugins.store.texts import texts_of

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem; max-width: 70rem; }
.query { border-top: 2px solid #444; margin-top: 2rem; padding-top: 1rem; }
table { border-collapse: collapse; width: 100%; margin: .5rem 0 1rem; }
td, th { border-bottom: 1px solid #ddd; padding: .3rem .5rem; vertical-align: top; }
td.score { text-align: right; font-family: monospace; white-space: nowrap; }
td.id { font-family: monospace; color: #555; }
pre { white-space: pre-wrap; margin: 0; font-size: .85rem; }
.helpful td.score { color: #1a7f37; } .harmful td.score { color: #cf222e; }
pre span { border-radius: 2px; }
"""

#: ``(query id, train id)`` -> a :func:`~tda_plugins.report.tokens.token_report` entry.
TokenEntries = dict[tuple[int, int], dict[str, Any]]
#: The two lists of a query's top-k.
SIDES = ("helpful", "harmful")


def _text(texts: Mapping[int, str], example_id: int, limit: int = 600) -> str:
    text = texts.get(example_id)
    if text is None:
        return "<em>(text not stored)</em>"
    short = text if len(text) <= limit else text[:limit] + " ..."
    return f"<pre>{escape(short)}</pre>"


def _highlighted(entry: dict[str, Any]) -> str:
    """The example's tokens, each on a background whose strength is its share of the
    example's largest token score: green where it helps the query, red where it harms."""
    peak = max((abs(v) for v in entry["values"]), default=0.0) or 1.0
    spans = []
    for piece, value in zip(entry["tokens"], entry["values"], strict=True):
        rgb = "26,127,55" if value > 0 else "207,34,46"
        spans.append(
            f"<span title='{value:+.3g}' style='background: rgba({rgb},{abs(value) / peak:.2f})'>"
            f"{escape(piece)}</span>"
        )
    return f"<pre>{''.join(spans)}</pre>"


def _table(
    kind: str,
    rows: list[dict],
    texts: Mapping[int, str],
    query_id: int,
    tokens: TokenEntries,
) -> str:
    def cell(r: dict[str, Any]) -> str:
        entry = tokens.get((query_id, r["id"]))
        if entry is None or entry["tokens"] is None:
            return _text(texts, r["id"])
        return _highlighted(entry)

    if not rows:
        sign = "positive" if kind == "helpful" else "negative"
        return f"<h3>Most {kind}</h3><p class='none'>No training example scores {sign}.</p>"
    body = "".join(
        f"<tr><td class='id'>{r['id']}</td><td class='score'>{r['score']:+.4g}</td>"
        f"<td>{cell(r)}</td></tr>"
        for r in rows
    )
    return (
        f"<h3>Most {kind}</h3><table class='{kind}'><tr><th>train id</th><th>score</th>"
        f"<th>text</th></tr>{body}</table>"
    )


def render_html(
    scores: Scores,
    train_texts: Mapping[int, str],
    query_texts: Mapping[int, str],
    *,
    k: int = 10,
    query_names: dict[int, str] | None = None,
    tokens: list[dict[str, Any]] | None = None,
) -> str:
    """The report page as a string (texts are escaped; missing texts are marked); each
    query is headed by its name where ``query_names`` gives one (as the logs call it).
    With ``tokens`` (a :func:`~tda_plugins.report.tokens.token_report`), each example's
    tokens are shaded by their share of its score. Only the shown examples' texts are
    read (from a :class:`~tda_plugins.store.texts.StoreTexts`, only those)."""
    by_pair: TokenEntries = {
        (q["query_id"], e["id"]): e for q in tokens or [] for side in SIDES for e in q[side]
    }
    top = scores.top_k(k)
    shown = texts_of(train_texts, {r["id"] for q in top for side in SIDES for r in q[side]})
    sections = []
    for entry in top:
        qid = entry["query_id"]
        name = (query_names or {}).get(qid)
        title = f"Query {escape(name)} (id {qid})" if name else f"Query {qid}"
        sections.append(
            f"<div class='query'><h2>{title}</h2>{_text(query_texts, qid, 2000)}"
            f"{_table('helpful', entry['helpful'], shown, qid, by_pair)}"
            f"{_table('harmful', entry['harmful'], shown, qid, by_pair)}</div>"
        )
    n, m = scores.values.shape
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>tda-plugins report</title>"
        f"<style>{_STYLE}</style></head><body><h1>Training-data attribution</h1>"
        f"<p>Method <b>{escape(scores.method)}</b>: {n} training examples, {m} queries. "
        f"Positive scores lower the query's loss (helpful); negative raise it (harmful).</p>"
        f"{''.join(sections)}</body></html>"
    )


def write_html(path: str | Path, page: str) -> Path:
    """Write a :func:`render_html` page to ``path`` atomically; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, page.encode())
    return out
