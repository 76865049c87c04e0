"""tda-plugins, two ways:

* ``ours``: capture into a training store and a query store (hooks on the ordinary
  backward, factor projection inside the hook, inline K-FAC statistics), then
  ``method_by_name(m).score`` -- the same path as ``benchmarks/attribution.py``; the run
  ends attribution-ready, with everything on disk.
* ``ours-memory``: the same calls inside ``tda_plugins.store.memory_store()``: the
  stores' gradients stay in this process (copied on the writer's thread), read back
  through the same reader; nothing but the small header and index files is written.
* ``ours-live``: ``tda_plugins.score_examples``, the public call: the query gradients are
  captured first and kept in memory, prepared as each query micro-batch finishes; each
  training micro-batch is scored against them as its backward finishes (the routed ops
  of the live influence logger); nothing is written. GradDot only (live K-FAC needs the
  factors of the whole training set before the first score).
"""

from __future__ import annotations

from pathlib import Path

from attribution import capture_store, micro_batches
from torch import Tensor

from peers.base import PeerAdapter, register_peer
from peers.workload import Problem
from tda_plugins import ProjectionConfig, score_examples
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


@register_peer
class OursLive(PeerAdapter):
    """``score_examples``: query gradients in memory, training rows scored inside their
    own backward."""

    name = "ours-live"

    def scores(self, problem: Problem, method: str) -> Tensor:
        projection = {}
        if projection_of(problem, method) is not None:
            projection = {"projection": "factor", "k_a": problem.k, "k_g": problem.k}
        scores = score_examples(
            problem.model,
            [{"input_ids": r} for r in problem.train.tolist()],
            [{"input_ids": r} for r in problem.queries.tolist()],
            layers="linear",
            batch_size=problem.batch,
            progress=False,
            **projection,
        )
        return scores.values.T
