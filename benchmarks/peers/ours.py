"""tda-plugins, two ways:

* ``ours``: capture into a training store and a query store (hooks on the ordinary
  backward, factor projection inside the hook, inline K-FAC statistics), then
  ``method_by_name(m).score`` -- the same path as ``benchmarks/attribution.py``; the run
  ends attribution-ready, with everything on disk.
* ``ours-memory``: the same calls inside ``tda_plugins.store.memory_store()``: the
  stores' gradients stay in this process (copied on the writer's thread), read back
  through the same reader; nothing but the small header and index files is written.
* ``ours-live``: the query gradients are captured first and kept in memory, prepared as
  each query micro-batch finishes (``tda_plugins.live.queries.QueryCollector``); each
  training micro-batch is scored against them as its backward finishes (a capture
  consumer calling ``tda_plugins.live.queries.score_record``, the routed ops of the live
  influence logger); nothing is written. GradDot only
  (live K-FAC needs the factors of the whole training set before the first score).
"""

from __future__ import annotations

from pathlib import Path

import torch
from attribution import capture_store, micro_batches
from torch import Tensor

from peers.base import PeerAdapter, register_peer
from peers.workload import Problem, example_losses, row_batches
from tda_plugins import CaptureEngine, LayerSelection, ProjectionConfig
from tda_plugins.capture import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.grads import QueryGradients
from tda_plugins.live.queries import QueryCollector, score_record
from tda_plugins.methods import method_by_name
from tda_plugins.store import memory_store

#: Our method for each measured configuration.
_METHOD = {"graddot": "graddot", "graddot_proj": "graddot", "kfac": "kfac", "ekfac": "ekfac"}


def projection_of(problem: Problem, method: str) -> ProjectionConfig | None:
    """Factor projection with ``k`` per side for the projected row, else none."""
    if method != "graddot_proj":
        return None
    return ProjectionConfig(kind="factor", k_a=problem.k, k_g=problem.k)


@register_peer
class Ours(PeerAdapter):
    """Stores on local disk, scored by the registered method (damping 0.1 x mean eig)."""

    name = "ours"
    clears_scratch = True

    def scores(self, problem: Problem, method: str) -> Tensor:
        return self.scores_in(self.scratch(problem), problem, method)

    def scores_in(self, root: Path, problem: Problem, method: str) -> Tensor:
        """Capture the training and query stores under ``root``, then score."""
        projection = projection_of(problem, method)
        curvature = method in ("kfac", "ekfac")
        train, queries = (
            capture_store(
                problem.model,
                micro_batches(rows, problem.batch),
                root / part,
                projection,
                curvature and part == "train",
            )
            for part, rows in (("train", problem.train), ("queries", problem.queries))
        )
        return method_by_name(_METHOD[method]).score(train, queries).values.T


@register_peer
class OursMemory(Ours):
    """Stores held in this process's memory (``memory_store``), scored the same way."""

    name = "ours-memory"
    clears_scratch = False

    def scores(self, problem: Problem, method: str) -> Tensor:
        with memory_store() as root:
            return self.scores_in(root, problem, method)


class _LiveScores(CaptureConsumer):
    """Scores each finished training micro-batch against every query at once (one
    prepared query side)."""

    def __init__(self, queries: QueryGradients):
        self.queries = queries
        self.blocks: list[Tensor] = []

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        self.blocks.append(score_record(record, self.queries, cosine=False))


@register_peer
class OursLive(PeerAdapter):
    """In-memory query gradients, training rows scored inside their own backward."""

    name = "ours-live"

    def _capture(self, problem: Problem, rows: Tensor, method: str, consumer: CaptureConsumer):
        """One captured forward + backward of ``rows`` per micro-batch into ``consumer``."""
        layers = LayerSelection(kind="linear")
        projection = projection_of(problem, method)
        engine = CaptureEngine(
            problem.model,
            layers=layers,
            projection=projection,
            consumers=[consumer],
            parameter_grads=False,
        )
        with engine:
            for ids in row_batches(rows, problem.batch):
                example_losses(problem.model, ids).sum().backward()
                problem.model.zero_grad(set_to_none=True)
            engine.end()

    def scores(self, problem: Problem, method: str) -> Tensor:
        collector = QueryCollector(problem.queries.shape[0])
        self._capture(problem, problem.queries, method, collector)
        live = _LiveScores(collector.gradients())
        del collector
        self._capture(problem, problem.train, method, live)
        return torch.cat(live.blocks).T
