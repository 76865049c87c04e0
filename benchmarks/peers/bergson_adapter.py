"""bergson: its in-memory collector (``InMemoryCollector`` driven by ``CollectorComputer``
over a ``datasets.Dataset``, the loop ``bergson build`` runs) collects the query
gradients, then a second pass over the training rows scores them on the fly with its
``Scorer`` (``bergson score``'s streaming path). Loss: each example's summed token loss
(``loss_reduction="sum"``); biases included; per-module factor projection
(``projection_dim = k``: a k x k gradient per module, rademacher) for the projected row.
GPT-2's ``Conv1D`` is hooked natively."""

from __future__ import annotations

import torch
from bergson import IndexConfig, InMemoryCollector, Scorer
from bergson.collector.collector import CollectorComputer
from bergson.gradients import GradientProcessor
from bergson.score.score_writer import InMemorySequenceScoreWriter
from datasets import Dataset
from torch import Tensor

from peers.base import PeerAdapter, register_peer
from peers.workload import Problem


@register_peer
class Bergson(PeerAdapter):
    """bergson 2.5 collector + streaming scorer on CPU, fp32."""

    name = "bergson"

    def _collect(
        self, problem: Problem, rows: Tensor, method: str, scorer: Scorer | None = None
    ) -> InMemoryCollector:
        """One pass of bergson's collector over ``rows`` in micro-batches of
        ``problem.batch`` (scoring them when ``scorer`` is given)."""
        cfg = IndexConfig(run_path=str(problem.work / "bergson"), loss_reduction="sum")
        cfg.partial_run_path.mkdir(parents=True, exist_ok=True)
        processor = GradientProcessor(
            projection_dim=problem.k if method == "graddot_proj" else None, include_bias=True
        )
        data = Dataset.from_dict({"input_ids": rows.tolist()})
        collector = InMemoryCollector(
            model=problem.model,
            data=data,
            cfg=cfg,
            processor=processor,
            target_modules=set(problem.layers),
            scorer=scorer,
        )
        count = len(data)
        batches = [
            list(range(i, min(i + problem.batch, count))) for i in range(0, count, problem.batch)
        ]
        computer = CollectorComputer(
            problem.model, data, collector=collector, batches=batches, cfg=cfg
        )
        computer.run_with_collector_hooks()
        return collector

    def scores(self, problem: Problem, method: str) -> Tensor:
        queries = self._collect(problem, problem.queries, method).gradients
        writer = InMemorySequenceScoreWriter(problem.train.shape[0], problem.queries.shape[0])
        scorer = Scorer(queries, list(queries), writer, problem.device, torch.float32)
        self._collect(problem, problem.train, method, scorer)
        return writer.scores.T
