"""Attribution scores: a train x query matrix keyed by example ids, top-k, saving."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from torch import Tensor

from tda_plugins.store.io import atomic_write_bytes, atomic_write_json
from tda_plugins.store.layout import StoreError

SCORES_FILE = "scores.safetensors"
TOPK_FILE = "topk.json"


@dataclass
class Scores:
    """Influence of every training example on every query.

    Attributes:
        train_ids: ``(N,)`` int64 training example ids (unique once :meth:`summed_by_id`,
            as every method returns them).
        query_ids: ``(M,)`` int64 query example ids.
        values: ``(N, M)`` fp32; positive = the training example pushes the query's loss
            down (helpful), negative = up (harmful), under the method's convention.
        method: the method's registered name.
        train_texts: training example id -> text, where the store holds texts (from a
            store, read from its folder when first used: a report reads the few it shows;
            ``dict(scores.train_texts)`` takes them all at once, before the store moves).
        query_texts: query id -> text, likewise.
    """

    train_ids: Tensor
    query_ids: Tensor
    values: Tensor
    method: str
    train_texts: Mapping[int, str] = field(default_factory=dict)
    query_texts: Mapping[int, str] = field(default_factory=dict)

    def require_finite(self) -> None:
        """Refuse NaN/inf scores, naming the first pair (a score is never written as a
        bare ``NaN``, which is not JSON)."""
        bad = ~torch.isfinite(self.values)
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise StoreError(
                f"the score of training example {int(self.train_ids[row])} on query "
                f"{int(self.query_ids[col])} is {float(self.values[row, col])} ({int(bad.sum())} "
                "scores are not finite): the gradients overflow in this dtype, or a store is "
                "damaged; recapture in float32/float64"
            )

    def summed_by_id(self) -> Scores:
        """One row per training id, in order of first occurrence, the sum of its rows.

        An example the store holds more than once (trained in several epochs, or
        duplicated rows under one content hash) scores the sum over its occurrences: the
        removal of every occurrence, the convention of the score's derivative. ``self``
        when every id is already unique."""
        ids = self.train_ids.tolist()
        unique = list(dict.fromkeys(ids))
        if len(unique) == len(ids):
            return self
        where = {i: r for r, i in enumerate(unique)}
        rows = torch.tensor([where[i] for i in ids], dtype=torch.long)
        values = self.values.new_zeros(len(unique), self.values.shape[1])
        values.index_add_(0, rows, self.values)
        return replace(self, train_ids=torch.tensor(unique, dtype=torch.long), values=values)

    def top_k(self, k: int) -> list[dict[str, Any]]:
        """Per query: the ``k`` most helpful examples (highest positive scores) and the
        ``k`` most harmful (lowest negative scores); a list holds fewer when fewer
        examples score on that side (a zero score is neither)."""
        if k < 1:
            raise ValueError(f"top-k needs k >= 1, got {k}")
        out = []
        for j, query_id in enumerate(self.query_ids.tolist()):
            column = self.values[:, j]
            high = torch.topk(column, min(k, int((column > 0).sum())))
            low = torch.topk(-column, min(k, int((column < 0).sum())))
            out.append(
                {
                    "query_id": query_id,
                    "helpful": _pairs(self.train_ids[high.indices], high.values),
                    "harmful": _pairs(self.train_ids[low.indices], -low.values),
                }
            )
        return out

    def rows(self) -> dict[str, list[Any]]:
        """The scores as columns of one row per (training example, query) pair:
        ``train_id``, ``query_id``, ``score``, and ``train_text``/``query_text`` where
        texts are known (``None`` for an example without one)."""
        n, m = self.values.shape
        train = self.train_ids.repeat_interleave(m).tolist()
        query = self.query_ids.repeat(n).tolist()
        columns: dict[str, list[Any]] = {
            "train_id": train,
            "query_id": query,
            "score": self.values.reshape(-1).tolist(),
        }
        if self.train_texts:
            columns["train_text"] = [self.train_texts.get(i) for i in train]
        if self.query_texts:
            columns["query_text"] = [self.query_texts.get(i) for i in query]
        return columns

    def to_pandas(self) -> Any:
        """:meth:`rows` as a ``pandas.DataFrame`` (needs pandas, installed with ``[hf]``)."""
        try:
            import pandas as pd
        except ImportError as error:
            raise ImportError("Scores.to_pandas needs pandas: pip install pandas") from error
        return pd.DataFrame(self.rows())

    def to_dataset(self) -> Any:
        """:meth:`rows` as a ``datasets.Dataset`` (needs the ``[hf]`` extra)."""
        try:
            from datasets import Dataset
        except ImportError as error:
            raise ImportError("Scores.to_dataset needs datasets: pip install datasets") from error
        return Dataset.from_dict(self.rows())

    def save(
        self, directory: str | Path, k: int = 10, sources: dict[str, str] | None = None
    ) -> None:
        """Write ``scores.safetensors`` (ids and matrix) and ``topk.json`` (refusing
        non-finite scores); ``sources``: the scored stores' row digests by side
        (``store``, ``queries``), recorded so that a report checks it is given them."""
        self.require_finite()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {
            "train_ids": self.train_ids.contiguous(),
            "query_ids": self.query_ids.contiguous(),
            "values": self.values.contiguous(),
        }
        atomic_write_bytes(out / SCORES_FILE, save(tensors, metadata={"method": self.method}))
        top = {"method": self.method, "k": k, "queries": self.top_k(k)}
        if sources is not None:
            top["sources"] = sources
        atomic_write_json(out / TOPK_FILE, top)

    @classmethod
    def load(cls, directory: str | Path) -> Scores:
        """The scores :meth:`save` wrote in ``directory``.

        Raises:
            FileNotFoundError: no scores there.
            ValueError: a file that :meth:`save` did not write whole (a missing entry, or
                a matrix that does not fit its ids), naming the file.
        """
        path = Path(directory) / SCORES_FILE
        if not path.exists():
            raise FileNotFoundError(f"no {SCORES_FILE} in {directory}; run `tda attribute` first")
        tensors = load_file(path)
        missing = sorted({"train_ids", "query_ids", "values"} - set(tensors))
        if missing:
            raise ValueError(f"{path} lacks {missing}: not scores tda attribute wrote")
        with safe_open(path, "pt") as f:
            method = (f.metadata() or {}).get("method")
        if method is None:
            raise ValueError(f"{path} names no method: not scores tda attribute wrote")
        train_ids, query_ids, values = (tensors[k] for k in ("train_ids", "query_ids", "values"))
        if tuple(values.shape) != (len(train_ids), len(query_ids)):
            raise ValueError(
                f"{path}: its values are {tuple(values.shape)} for {len(train_ids)} training "
                f"and {len(query_ids)} query ids; the file is damaged: run tda attribute again"
            )
        return cls(train_ids, query_ids, values, method)


def saved_sources(directory: str | Path) -> dict[str, str]:
    """The row digests :meth:`Scores.save` recorded of the scored stores, by side (empty
    where it recorded none)."""
    sources = json.loads((Path(directory) / TOPK_FILE).read_text()).get("sources")
    return sources if isinstance(sources, dict) else {}


def saved_top_k(directory: str | Path) -> int | None:
    """The ``k`` a :meth:`Scores.save` in ``directory`` wrote its top-k with (``None``:
    saved before it was recorded)."""
    path = Path(directory) / TOPK_FILE
    try:
        k = json.loads(path.read_text()).get("k")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{path} is not the top-k tda attribute wrote ({exc})") from None
    return k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else None


def _pairs(ids: Tensor, values: Tensor) -> list[dict[str, float | int]]:
    return [{"id": i, "score": s} for i, s in zip(ids.tolist(), values.tolist(), strict=True)]
