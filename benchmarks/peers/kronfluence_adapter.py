"""kronfluence: ``Analyzer.fit_all_factors`` then ``compute_pairwise_scores`` with the
"identity" (GradDot), "kfac" and "ekfac" strategies, on a copy of the model wrapped by
``prepare_model`` (kronfluence hooks ``nn.Linear``/``nn.Conv2d``: GPT-2's ``Conv1D``
layers are swapped for equivalent ``nn.Linear`` ones). kronfluence has no gradient
projection (only a low-rank query approximation), so the projected row is not run."""

from __future__ import annotations

import logging

from common import RowDataset
from kronfluence.analyzer import Analyzer, prepare_model
from kronfluence.arguments import FactorArguments, ScoreArguments
from kronfluence.task import Task
from torch import Tensor, nn

from peers.base import PeerAdapter, register_peer
from peers.workload import Problem, example_losses, linear_copy

_STRATEGY = {"graddot": "identity", "kfac": "kfac", "ekfac": "ekfac"}


class _SummedLoss(Task):
    """Each example's own summed token loss on both sides, on the chosen layers."""

    def __init__(self, layers: tuple[str, ...]):
        self.layers = layers

    def compute_train_loss(
        self, batch: dict[str, Tensor], model: nn.Module, sample: bool = False
    ) -> Tensor:
        return example_losses(model, batch["input_ids"]).sum()

    def compute_measurement(self, batch: dict[str, Tensor], model: nn.Module) -> Tensor:
        return example_losses(model, batch["input_ids"]).sum()

    def get_influence_tracked_modules(self) -> list[str]:
        return list(self.layers)


@register_peer
class Kronfluence(PeerAdapter):
    """kronfluence 1.0 on CPU; damping left to its heuristic (0.1 x mean eigenvalue)."""

    name = "kronfluence"

    def prepare(self, problem: Problem, method: str) -> Problem:
        self.task = _SummedLoss(problem.layers)
        # prepare_model freezes every parameter: a copy keeps the floor's model trainable.
        self.model = prepare_model(linear_copy(problem.model), self.task)
        return problem

    def scores(self, problem: Problem, method: str) -> Tensor:
        analyzer = Analyzer(
            analysis_name="bench",
            model=self.model,
            task=self.task,
            cpu=problem.device.type == "cpu",
            disable_tqdm=True,
            log_level=logging.WARNING,
            output_dir=str(problem.work / "kronfluence"),
        )
        train, queries = RowDataset(problem.train), RowDataset(problem.queries)
        analyzer.fit_all_factors(
            "factors",
            dataset=train,
            per_device_batch_size=problem.batch,
            factor_args=FactorArguments(strategy=_STRATEGY[method]),
            overwrite_output_dir=True,
        )
        analyzer.compute_pairwise_scores(
            "scores",
            "factors",
            query_dataset=queries,
            train_dataset=train,
            per_device_query_batch_size=problem.batch,
            per_device_train_batch_size=problem.batch,
            score_args=ScoreArguments(damping_factor=None),
            overwrite_output_dir=True,
        )
        return analyzer.load_pairwise_scores("scores")["all_modules"]
