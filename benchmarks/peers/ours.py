"""tda-plugins: capture into a training store and a query store (hooks on the ordinary
backward, factor projection inside the hook, inline K-FAC statistics), then
``method_by_name(m).score`` -- the same path as ``benchmarks/attribution.py``."""

from __future__ import annotations

import shutil
from typing import ClassVar

from attribution import capture_store, micro_batches
from torch import Tensor

from peers.base import PeerAdapter, register_peer
from peers.workload import Problem
from tda_plugins import ProjectionConfig
from tda_plugins.methods import method_by_name

#: Our method for each measured configuration.
_METHOD = {"graddot": "graddot", "graddot_proj": "graddot", "kfac": "kfac", "ekfac": "ekfac"}


@register_peer
class Ours(PeerAdapter):
    """Stores on local disk, scored by the registered method (damping 0.1 x mean eig)."""

    name = "ours"
    notes: ClassVar[dict[str, str]] = {
        "graddot_proj": "factor projection k_a = k_g = k in the hook",
        "kfac": "inline K-FAC statistics, damping 0.1 x mean eigenvalue per factor",
        "ekfac": "inline K-FAC statistics + one pass over the store, damping 0.1 x mean",
    }

    def scores(self, problem: Problem, method: str) -> Tensor:
        root = problem.work / "ours"
        shutil.rmtree(root, ignore_errors=True)
        projection = (
            ProjectionConfig(kind="factor", k_a=problem.k, k_g=problem.k)
            if method == "graddot_proj"
            else None
        )
        curvature = method in ("kfac", "ekfac")
        train = capture_store(
            problem.model,
            micro_batches(problem.train, problem.batch),
            root / "train",
            projection,
            curvature,
        )
        queries = capture_store(
            problem.model,
            micro_batches(problem.queries, problem.batch),
            root / "queries",
            projection,
            False,
        )
        result = method_by_name(_METHOD[method]).score(train, queries)
        shutil.rmtree(root, ignore_errors=True)
        return result.values.T
