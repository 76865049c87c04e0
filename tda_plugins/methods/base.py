"""The attribution-method interface, its registry, and the shared scoring loop.

A method is a small strategy: what it does to query gradients (a preconditioner), what
it does to training gradients (LESS: Adam), and whether it unit-normalizes both sides
(cosine). :meth:`AttributionMethod.score` streams the training store in chunks and sums
the per-layer cross-Grams, each routed by the cost model. The first-order methods also
take parameter groups (:mod:`~tda_plugins.methods.groups`: parameters left out, layers
unit-normalized), applied to both sides after the method's own transforms.

Score convention: ``score(z, q) = <P g_q, T g_z>`` summed over layers, with ``g`` each
example's gradient of its own summed token loss; higher = more helpful to the query.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tda_plugins.grads.base import PerExampleGrad, values_dtype
from tda_plugins.grads.blocks import spans
from tda_plugins.grads.dense import sum_of_uses
from tda_plugins.grads.ops import (
    QueryGradients,
    example_norms,
    example_sq_norms,
    layer_sum,
    per_token_scores,
    safe_norms,
)
from tda_plugins.grads.projection import projected_tie
from tda_plugins.methods.groups import ParameterGroups, ScoringSpace
from tda_plugins.methods.scores import Scores
from tda_plugins.methods.token_rows import summed_occurrences
from tda_plugins.parallel.ranks import Ranks, on_device
from tda_plugins.precondition.base import PRECONDITIONERS, Preconditioner, TrainingChunks
from tda_plugins.store.layout import StoreError
from tda_plugins.store.reader import StoreChunk, StoreReader
from tda_plugins.utils.heap import release_free_heap
from tda_plugins.utils.registry import Registry

METHODS: Registry[AttributionMethod] = Registry("attribution method")
#: Class decorator: make a method available under a name (CLI ``--method``).
register_method = METHODS.register


def method_by_name(name: str, **options: Any) -> AttributionMethod:
    """Instantiate a registered method; unknown names list the known ones."""
    return METHODS.create(name, **options)


@dataclass(frozen=True)
class ScoreRun:
    """How one scoring call runs (the options of :meth:`AttributionMethod.score`).

    Attributes:
        chunk_examples: training examples read and scored at once (whole micro-batches);
            ``None``: :func:`default_chunk` of the query count.
        progress: show progress bars (on rank 0).
        allow_mismatch: score queries of another model than the store's.
        ranks: the processes that share the work and where they compute (default: this
            process, on the CPU).
        label: what the progress bar names the pass (``None``: ``"<method> scores"``).
    """

    chunk_examples: int | None = None
    progress: bool = False
    allow_mismatch: bool = False
    ranks: Ranks = field(default_factory=Ranks)
    label: str | None = None

    def chunk(self, queries: int) -> int:
        """Training examples per chunk against ``queries`` queries."""
        return self.chunk_examples or default_chunk(queries)


class AttributionMethod(ABC):
    """Scores training examples against queries from two compatible stores."""

    name: ClassVar[str]
    #: Unit-normalize train and query gradients (over all layers) before the dot.
    normalize: ClassVar[bool] = False
    #: The registered preconditioner (``precondition/``) applied to the queries; what it
    #: needs from the store (``needs_curvature``) is read from it, not from the method.
    preconditioner_name: ClassVar[str] = "identity"
    #: Why the method refuses parameter groups (``exclude_params``, ``normalize_layers``);
    #: ``None``: it takes them.
    no_parameter_groups: ClassVar[str | None] = None
    #: The score is linear in each side's raw gradient, so the uses of a tied weight are
    #: scored as the one parameter they share by giving them one query side (the sum of
    #: their query gradients); a method that normalizes or transforms the training side
    #: per layer cannot, and refuses stores with tied layers.
    scores_tied_weights: ClassVar[bool] = True

    def __init__(
        self,
        damping: float = 0.1,
        *,
        exclude_params: str | Sequence[str] = (),
        normalize_layers: bool = False,
    ):
        """``damping``: the curvature methods' (relative); ``exclude_params``: parameter
        name patterns left out of both sides, ``normalize_layers``: each layer's gradient
        unit-normalized per example before the dot (:class:`ParameterGroups`)."""
        self.preconditioner: Preconditioner = PRECONDITIONERS.create(
            self.preconditioner_name, damping=damping
        )
        self.groups = ParameterGroups.of(exclude_params, normalize_layers)
        if self.groups.active and self.no_parameter_groups is not None:
            raise ValueError(
                f"{type(self).__name__} takes no exclude_params or normalize_layers: "
                f"{self.no_parameter_groups}; leave them out, or score with graddot, "
                "gradcos, tracin or less"
            )
        #: The groups resolved against the store being scored (set by :meth:`prepare`).
        self.space = ScoringSpace()

    def prepare(
        self,
        store: StoreReader,
        queries: StoreReader,
        run: ScoreRun | None = None,
        *,
        per_group: bool = False,
    ) -> None:
        """Validate the pair of stores (``run.allow_mismatch``: queries of another model
        than the store's are scored all the same, see
        :meth:`~tda_plugins.store.StoreReader.require_compatible`) and fit what the method
        needs (spread over ``run.ranks``, its results on their device). The method's own
        refusals (:meth:`refuse`) come first, then the parameter groups are resolved, so
        that a pattern that matches nothing fails before any work."""
        run = run or ScoreRun()
        self.refuse(store, run)
        store.require_compatible(queries, run.allow_mismatch)
        self.space = self.groups.resolve(store.config, queries.config)
        require_tie_support(
            store, self.scores_tied_weights and not self.groups.normalize_layers, self.space
        )
        fit = self.preconditioner.fit_for_scoring if per_group else self.preconditioner.fit
        fit(store, run.progress, ranks=run.ranks)
        #: The tied units as recorded by the capture, and as the curvature statistics tie
        #: them (older stores record them only there).
        self.ties = list(dict.fromkeys([*store.config.tied, *self.preconditioner.tied_units]))

    def refuse(self, store: StoreReader, run: ScoreRun) -> None:
        """Raise, before any work, where the method cannot score ``store`` as ``run``
        asks; set up what it reads besides the preconditioner. Default: nothing."""
        return None

    def train_side(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        """Transform of the training gradients: LESS's Adam step, or the preconditioner's
        basis (EK-FAC may score in its eigenbasis); called after the queries' side."""
        return self.preconditioner.train_side(layer, grads)

    def query_side(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        return self.preconditioner(layer, grads)

    def _train_layers(self, layers: Mapping[str, PerExampleGrad]) -> dict[str, PerExampleGrad]:
        """The training side of ``layers`` as scored: the method's transform, then the
        parameter groups."""
        return {n: self.space.side(n, self.train_side(n, g)) for n, g in layers.items()}

    def _query_layer(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        """One layer's query side as scored (the preconditioner, then the groups)."""
        return self.space.side(layer, self.query_side(layer, grads))

    def score(
        self,
        store: StoreReader,
        queries: StoreReader,
        chunk_examples: int | None = None,
        progress: bool = False,
        *,
        allow_mismatch: bool = False,
        ranks: Ranks | None = None,
    ) -> Scores:
        """``(N, M)`` scores of every stored training example against every query: one
        row per example id, in store order of its first occurrence; an example stored
        more than once (several epochs, duplicated rows) scores the sum of its rows
        (:meth:`~tda_plugins.methods.scores.Scores.summed_by_id`).

        ``chunk_examples``: training examples read and scored at once (whole
        micro-batches); ``None`` (default): :func:`default_chunk` of the query count.

        ``ranks``: the processes that share the work and where they compute (default:
        this process, on the CPU). Each rank fits its share of the preconditioner and
        scores its part of the store (:meth:`~tda_plugins.parallel.ranks.Ranks.part`, the very
        chunks one process reads); every rank returns all the scores, in store order.

        The heap a training or capture pass freed is given back first
        (:func:`~tda_plugins.utils.heap.release_free_heap`), so that scoring's buffers do not
        come on top of it."""
        run = ScoreRun(
            chunk_examples, progress, allow_mismatch=allow_mismatch, ranks=ranks or Ranks()
        )
        return self.scores(store, queries, run)

    def scores(self, store: StoreReader, queries: StoreReader, run: ScoreRun) -> Scores:
        """:meth:`score` with its options in one value: what a method overrides."""
        ranks = run.ranks
        release_free_heap()
        self.prepare(store, queries, run, per_group=True)
        _require_queries(queries)
        chunk = run.chunk(queries.num_examples)
        # layer groups and the query cache follow the whole store, as in one process
        groups = layer_groups(
            store,
            queries,
            chunk,
            self.space.layers(store.layer_names),
            self.ties,
        )
        groups = self.preconditioner.split_groups(groups, store)
        part = ranks.part(store, chunk)
        examples = 0 if part is None else part.num_examples
        show = run.progress and ranks.rank == 0
        bar = tqdm(total=examples, desc=run.label or f"{self.name} scores", disable=not show)
        totals = _Totals(queries.num_examples, self.normalize)
        query_ids = torch.empty(0, dtype=torch.long)
        with bar:
            for names in groups:
                source = self.preconditioner.training_chunks(
                    _ScorePass(store, part, chunk, ranks.device), names, ranks, run.progress
                )
                query = queries.load_all(names)
                query_ids = query.example_ids
                query.layers = on_device(query.layers, ranks.device)
                query_groups = self._query_groups(query)
                bar.total = examples * len(groups) * len(query_groups)
                for i, rows in enumerate(query_groups):
                    last = i == len(query_groups) - 1
                    totals.add(rows, self._score_pass(source, query, rows, bar, last))
                # the next group's training chunks (EK-FAC's kept rotated gradients, up to
                # their budget) are built without this group's still held
                del source, query
        train_ids = ranks.rows(totals.train_ids()).cpu()
        scores = Scores(train_ids, query_ids, ranks.rows(totals.values()).cpu(), self.name)
        scores.require_finite()
        return scores.summed_by_id()

    def _query_groups(self, query: StoreChunk) -> list[slice]:
        """Query rows preconditioned and scored together: all of them, unless the
        preconditioner makes them dense; then as many as fit :data:`QUERY_CACHE_BYTES`
        (each further group reads and multiplies the training gradients once more)."""
        if not self.preconditioner.dense_queries:
            return [slice(0, query.size)]
        per_query = sum(g.dim * values_dtype(g).itemsize for g in query.layers.values())
        step = max(1, QUERY_CACHE_BYTES // max(per_query, 1))
        return spans(query.size, step)

    def _score_pass(
        self,
        source: TrainingChunks,
        query: StoreChunk,
        rows: slice,
        bar: tqdm,
        release: bool,
    ) -> _Pass:
        """Dots of every training example of ``source`` with the queries ``rows`` over the
        layers of ``query`` (and their squared norms for cosine), in one pass through it.

        ``release`` (the last pass over ``query``): each layer's loaded query gradients
        leave ``query`` as soon as its prepared side exists, so that the two are not held
        together for every layer (a preconditioned side is a second copy)."""
        layers = list(query.layers)
        sides = self._query_sides(query, rows, release)
        # materialized queries are worth keeping only for a second training chunk
        cache = QUERY_CACHE_BYTES if source.store.num_examples > source.chunk else 0
        prepared = QueryGradients(sides, cache)
        del sides  # prepared swaps factors for materialized queries: nothing else holds them
        ids = [torch.empty(0, dtype=torch.long)]
        blocks = [torch.empty(0, rows.stop - rows.start, device=source.device)]
        squares = [torch.empty(0, device=source.device)]
        for part in source.chunks(layers):
            t_layers = self._train_layers(part.layers)
            ids.append(part.example_ids)
            blocks.append(prepared.scores(t_layers))
            if self.normalize:
                squares.append(example_sq_norms(t_layers))
            bar.update(part.size)
        # the empty first entries only give a rank without examples its shapes
        dots = torch.cat(blocks[1:]) if len(blocks) > 1 else blocks[0]
        train_sq = torch.cat(squares[1:]) if len(squares) > 1 else squares[0]
        return _Pass(
            torch.cat(ids),
            dots,
            train_sq if self.normalize else None,
            prepared.sq_norms() if self.normalize else None,
        )

    def _query_sides(
        self, query: StoreChunk, rows: slice, release: bool
    ) -> dict[str, PerExampleGrad]:
        """Each layer's query side of the queries ``rows``; the uses of a tied weight
        (:attr:`~tda_plugins.precondition.base.Preconditioner.tied_units`) share one,
        prepared from the sum of their query gradients, so that their dots with each use's
        training gradients add up to the weight's. ``release``: each loaded query leaves
        ``query`` once its side exists."""
        unit_of = {n: unit for unit in self.ties for n in unit}
        sides: dict[str, PerExampleGrad] = {}
        for name in list(query.layers):
            if name in sides:
                continue
            unit = unit_of.get(name, (name,))
            uses = [
                (query.layers.pop(n) if release else query.layers[n]).select(rows) for n in unit
            ]
            side = self._query_layer(name, sum_of_uses(uses))
            del uses
            sides.update(dict.fromkeys(unit, side))
        return sides

    def token_scores(
        self, store: StoreReader, queries: StoreReader, train_ids: list[int]
    ) -> dict[int, Tensor]:
        """Train id -> ``(M, T)`` score of each of its tokens; a row sums to its score
        (an example stored more than once: its occurrences added token by token,
        :func:`~tda_plugins.methods.token_rows.summed_occurrences`).

        Needs per-token training gradients (a store written with ``keep_tokens``).
        """
        self.prepare(store, queries)
        layers = self.space.layers(store.layer_names)
        _require_queries(queries)
        query = queries.load_all(layers)
        q_layers = self._query_sides(query, slice(None), release=False)
        q_norms = example_norms(q_layers) if self.normalize else None
        wanted = set(train_ids)
        occurrences: dict[int, list[Tensor]] = {}
        # one micro-batch a chunk: each row keeps its own width, so that the real tokens of
        # an example's occurrences can be found in theirs (left padding: at the end)
        for chunk in store.iter_chunks(1, layers=layers):
            rows = [i for i, x in enumerate(chunk.example_ids.tolist()) if x in wanted]
            if not rows:
                continue
            index = torch.tensor(rows)
            t_layers = self._train_layers({n: g.select(index) for n, g in chunk.layers.items()})
            per_token = layer_sum([per_token_scores(t_layers[n], q_layers[n]) for n in q_layers])
            if q_norms is not None:
                scale = torch.outer(example_norms(t_layers), q_norms)
                per_token = per_token / scale.unsqueeze(2)
            for row, example in zip(per_token, chunk.example_ids[index].tolist(), strict=True):
                occurrences.setdefault(example, []).append(row.float())
        missing = wanted - set(occurrences)
        if missing:
            raise StoreError(f"train ids {sorted(missing)[:5]} are not in the store {store.root}")
        texts = store.token_texts(set(occurrences))
        return {i: summed_occurrences(i, rows, texts.get(i)) for i, rows in occurrences.items()}


@dataclass
class _ScorePass:
    """The training examples one pass scores: ``part`` (this rank's share of ``store``,
    ``None`` for none) read in chunks of ``chunk`` examples, moved to ``device``."""

    store: StoreReader
    part: StoreReader | None
    chunk: int
    device: torch.device

    @property
    def examples(self) -> int:
        return 0 if self.part is None else self.part.num_examples

    def chunks(self, layers: list[str]) -> Iterator[StoreChunk]:
        if self.part is None:
            return
        for chunk in self.part.iter_chunks(self.chunk, layers=layers):
            chunk.layers = on_device(chunk.layers, self.device)
            yield chunk


@dataclass
class _Pass:
    """One pass through the store: ``(N,)`` training ids, their ``(N, m)`` dots with
    ``m`` queries over some layers, and for cosine the ``(N,)`` and ``(m,)`` squared
    norms over the same layers."""

    train_ids: Tensor
    dots: Tensor
    train_sq: Tensor | None
    query_sq: Tensor | None


class _Totals:
    """Sums of the passes: each adds its layers' dots into its query columns (and, for
    cosine, its layers' squared norms: the training side's once per layer group, from
    the pass over its first query columns)."""

    def __init__(self, queries: int, normalize: bool):
        self.queries = queries
        self.normalize = normalize
        self._ids: Tensor | None = None
        self._dots = self._train_sq = self._query_sq = torch.empty(0)

    def add(self, rows: slice, part: _Pass) -> None:
        if self._ids is None:
            self._ids = part.train_ids
            self._dots = part.dots.new_zeros(part.dots.shape[0], self.queries)
            self._train_sq = part.dots.new_zeros(part.dots.shape[0])
            self._query_sq = part.dots.new_zeros(self.queries)
        elif not torch.equal(self._ids, part.train_ids):
            raise StoreError("the store's examples changed order between two reads of it")
        self._dots[:, rows] += part.dots
        if part.train_sq is not None and part.query_sq is not None:
            if rows.start == 0:
                self._train_sq += part.train_sq
            self._query_sq[rows] += part.query_sq

    def train_ids(self) -> Tensor:
        if self._ids is None:
            raise StoreError("no pass through the store was made")
        return self._ids

    def values(self) -> Tensor:
        """``(N, M)`` fp32 scores (cosines when normalizing)."""
        dots = self._dots
        if self.normalize:
            dots = dots / torch.outer(safe_norms(self._train_sq), safe_norms(self._query_sq))
        return dots.float()


#: Most bytes of stored gradients, the queries' and one training chunk's, that
#: :meth:`AttributionMethod.score` holds at once: the layers are scored in groups that
#: fit (each group one more pass over the store, reading only its layers).
SCORE_GROUP_BYTES = 1 << 29


def layer_groups(
    store: StoreReader,
    queries: StoreReader,
    chunk: int,
    layers: list[str] | None = None,
    units: Sequence[tuple[str, ...]] = (),
) -> list[list[str]]:
    """Consecutive layers (of ``layers``, default all) whose stored gradients, every
    query's and a training chunk's of ``chunk`` examples, fit :data:`SCORE_GROUP_BYTES`
    together (at least one layer a group); sizes from the shards' headers. The layers of
    each of ``units`` (the uses of a tied weight) go in one group, at the place of the
    first."""
    train, query = store.layer_nbytes(), queries.layer_nbytes()
    rows = min(chunk, max(store.num_examples, 1))
    unit_of = {n: unit for unit in units for n in unit}
    groups: list[list[str]] = []
    used = 0
    for name in store.layer_names if layers is None else layers:
        unit = unit_of.get(name, (name,))
        if name != unit[0]:
            continue
        size = sum(rows * train[n] + queries.num_examples * query[n] for n in unit)
        if groups and used + size <= SCORE_GROUP_BYTES:
            groups[-1].extend(unit)
            used += size
        else:
            groups.append(list(unit))
            used = size
    return groups


#: Most bytes of materialized query gradients :meth:`AttributionMethod.score` keeps for
#: all its training chunks; beyond them a layer's queries are rebuilt block by block for
#: each chunk (no extra memory; the chunk is at least as large as the query count, so
#: this at most doubles that layer's materialization work). A store read in one chunk
#: keeps none: each query is then built once either way.
QUERY_CACHE_BYTES = 1 << 29


def require_tie_support(store: StoreReader, supported: bool, space: ScoringSpace) -> None:
    """Refuse a store whose scored layers (``space``'s) hold the uses of a tied weight (an
    embedding and the head that shares its weight) where no method can score them as one
    parameter (a projected store: each use is projected with maps of its own), or for a
    method that cannot (``supported`` false)."""
    scored = [t for t in store.config.tied if space.layers(t)]
    if not scored:
        return
    unit = " and ".join(scored[0])
    projected = projected_tie(scored[0], store.config.projection)
    if projected:
        raise StoreError(
            f"{store.root}: {projected}, or capture one of the two uses only (e.g. --layers "
            "linear), or leave both out of the scores (exclude_params naming both)"
        )
    if not supported:
        raise StoreError(
            f"{store.root} holds {unit}, which share one weight; this method normalizes or "
            "transforms each layer's gradient on its own and would miss the terms between "
            "the two uses: score with graddot, tracin, kfac, ekfac or logra (which count the "
            "shared weight once), or capture one of the two uses only (e.g. --layers linear)"
        )


def default_chunk(queries: int) -> int:
    """Training examples scored at once against ``queries`` queries: as many as there are
    queries, between 8 and 256. Each chunk reads the whole prepared query side once, so
    that reading costs no more than the chunk's own gradients; a chunk is held in memory
    whole (one buffer per stored tensor), so no larger chunk is taken."""
    return min(256, max(8, queries))


def _require_queries(queries: StoreReader) -> None:
    if queries.num_examples == 0:
        raise StoreError(f"the query store {queries.root} holds no example; capture queries first")
