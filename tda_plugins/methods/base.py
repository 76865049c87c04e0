"""The attribution-method interface, its registry, and the shared scoring loop.

A method is a small strategy: what it does to query gradients (a preconditioner), what
it does to training gradients (LESS: Adam), and whether it unit-normalizes both sides
(cosine). :meth:`AttributionMethod.score` streams the training store in chunks and sums
the per-layer cross-Grams, each routed by the cost model.

Score convention: ``score(z, q) = <P g_q, T g_z>`` summed over layers, with ``g`` each
example's gradient of its own summed token loss; higher = more helpful to the query.
"""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tda_plugins.grads.factors import PerExampleGrad, values_dtype
from tda_plugins.grads.ops import QueryGradients, example_norms, layer_sum, per_token_scores
from tda_plugins.methods.scores import Scores
from tda_plugins.precondition.base import Identity, Preconditioner
from tda_plugins.registry import Registry
from tda_plugins.store.layout import StoreError
from tda_plugins.store.reader import StoreChunk, StoreReader

METHODS: Registry[AttributionMethod] = Registry("attribution method")
#: Class decorator: make a method available under a name (CLI ``--method``).
register_method = METHODS.register


def method_by_name(name: str, **options: Any) -> AttributionMethod:
    """Instantiate a registered method; unknown names list the known ones."""
    return METHODS.create(name, **options)


class AttributionMethod(ABC):
    """Scores training examples against queries from two compatible stores."""

    name: ClassVar[str]
    #: Unit-normalize train and query gradients (over all layers) before the dot.
    normalize: ClassVar[bool] = False

    def __init__(self, damping: float = 0.1):
        self.preconditioner: Preconditioner = Identity(damping)

    def prepare(self, store: StoreReader, queries: StoreReader, progress: bool = False) -> None:
        """Validate the pair of stores and fit what the method needs."""
        store.require_compatible(queries)
        self.preconditioner.fit(store, progress)

    def train_side(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        """Transform of the training gradients (identity except for LESS)."""
        return grads

    def query_side(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        return self.preconditioner(layer, grads)

    def score(
        self,
        store: StoreReader,
        queries: StoreReader,
        chunk_examples: int | None = None,
        progress: bool = False,
    ) -> Scores:
        """``(N, M)`` scores of every stored training example against every query.

        ``chunk_examples``: training examples read and scored at once (whole
        micro-batches); ``None`` (default): :func:`default_chunk` of the query count."""
        self.prepare(store, queries, progress)
        query = _load_queries(queries)
        groups = self._query_groups(query)
        chunk = chunk_examples or default_chunk(query.size)
        total = store.num_examples * len(groups)
        with tqdm(total=total, desc=f"{self.name} scores", disable=not progress) as bar:
            parts = [self._score_group(store, query, rows, chunk, bar) for rows in groups]
        ids = parts[0][0]
        values = torch.cat([block for _, block in parts], dim=1)
        return Scores(ids, query.example_ids, values, self.name)

    def _score_group(
        self, store: StoreReader, query: StoreChunk, rows: slice, chunk: int, bar: tqdm
    ) -> tuple[Tensor, Tensor]:
        """``(N,)`` training ids and their ``(N, m)`` scores against the queries ``rows``,
        over one pass through the store in chunks of ``chunk`` examples."""
        prepared = QueryGradients(
            {n: self.query_side(n, g.select(rows)) for n, g in query.layers.items()},
            QUERY_CACHE_BYTES,
        )
        ids, blocks = [], []
        for part in store.iter_chunks(chunk):
            t_layers = {n: self.train_side(n, g) for n, g in part.layers.items()}
            block = prepared.scores(t_layers)
            if self.normalize:
                block = block / torch.outer(example_norms(t_layers), prepared.norms())
            ids.append(part.example_ids)
            blocks.append(block.float())
            bar.update(part.size)
        return torch.cat(ids), torch.cat(blocks)

    def _query_groups(self, query: StoreChunk) -> list[slice]:
        """Query rows preconditioned and scored together: all of them, unless the
        preconditioner makes them dense; then as many as fit :data:`QUERY_CACHE_BYTES`
        (each further group reads and multiplies the training gradients once more)."""
        if not self.preconditioner.dense_queries:
            return [slice(0, query.size)]
        per_query = sum(g.dim * values_dtype(g).itemsize for g in query.layers.values())
        step = max(1, QUERY_CACHE_BYTES // max(per_query, 1))
        return [slice(i, min(i + step, query.size)) for i in range(0, query.size, step)]

    def token_scores(
        self, store: StoreReader, queries: StoreReader, train_ids: list[int]
    ) -> dict[int, Tensor]:
        """Train id -> ``(M, T)`` score of each of its tokens; a row sums to its score.

        Needs per-token training gradients (a store written with ``keep_tokens``).
        """
        self.prepare(store, queries)
        query = _load_queries(queries)
        q_layers = {n: self.query_side(n, g) for n, g in query.layers.items()}
        q_norms = example_norms(q_layers) if self.normalize else None
        wanted = set(train_ids)
        out: dict[int, Tensor] = {}
        for chunk in store.iter_chunks():
            rows = [i for i, x in enumerate(chunk.example_ids.tolist()) if x in wanted]
            if not rows:
                continue
            index = torch.tensor(rows)
            t_layers = {n: self.train_side(n, g.select(index)) for n, g in chunk.layers.items()}
            per_token = layer_sum([per_token_scores(t_layers[n], q_layers[n]) for n in q_layers])
            if q_norms is not None:
                scale = torch.outer(example_norms(t_layers), q_norms)
                per_token = per_token / scale.unsqueeze(2)
            for row, example in zip(per_token, chunk.example_ids[index].tolist(), strict=True):
                out[example] = row.float()
        missing = wanted - set(out)
        if missing:
            raise StoreError(f"train ids {sorted(missing)[:5]} are not in the store {store.root}")
        return out


#: Most bytes of materialized query gradients :meth:`AttributionMethod.score` keeps for
#: all its training chunks; beyond them a layer's queries are rebuilt block by block for
#: each chunk (no extra memory; the chunk is at least as large as the query count, so
#: this at most doubles that layer's materialization work).
QUERY_CACHE_BYTES = 1 << 30


def default_chunk(queries: int) -> int:
    """Training examples scored at once against ``queries`` queries: as many as there are
    queries, between 8 and 256. Each chunk reads the whole prepared query side once, so
    that reading costs no more than the chunk's own gradients; a chunk of several stored
    micro-batches is a concatenated copy of them, so no larger chunk is taken."""
    return min(256, max(8, queries))


def _load_queries(queries: StoreReader) -> StoreChunk:
    if queries.num_examples == 0:
        raise StoreError(f"the query store {queries.root} holds no example; capture queries first")
    return queries.load_all()
