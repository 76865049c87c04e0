"""dattri: GradDot through ``TracInAttributor`` (one checkpoint, weight 1, no
normalisation) with its ``"identity"`` projector, on ``torch.func`` per-example gradients
(``vmap`` of ``grad``) of the chosen layers' weights and biases; it recomputes the query
gradients once per training micro-batch. The projected row is ``LoGraAttributor`` with
``hessian="Identity"``: its hooks on ``nn.Linear`` (GPT-2's ``Conv1D`` swapped for
equivalent ``nn.Linear``) project the output gradient and the input (bias column
appended) with two Gaussian matrices of ``sqrt(proj_dim) = k`` rows each, so a layer's
gradient is ``k x k`` -- the same kind of factor projection as ours.

LoGra takes its training loss from the task (here each example's summed token loss, as
the batch mean it expects), but its query gradients from the model's own ``outputs.loss``
(transformers' mean over all ``B (T - 1)`` next-token losses of the batch, times the
batch size ``B`` that it multiplies back): its query columns are the summed-loss ones
divided by ``T - 1``, so the adapter multiplies them by ``T - 1``."""

from __future__ import annotations

import shutil
from typing import Any

import torch
from common import RowDataset, collate_rows
from dattri.algorithm import LoGraAttributor, TracInAttributor
from dattri.task import AttributionTask
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

from peers.base import PeerAdapter, register_peer
from peers.workload import Problem, example_losses, linear_copy, parameter_names
from tda_plugins import causal_lm_example_losses


@register_peer
class Dattri(PeerAdapter):
    """dattri 0.3 on CPU, fp32, one checkpoint (the problem's model)."""

    name = "dattri"
    clears_scratch = True

    def prepare(self, problem: Problem, method: str) -> Problem:
        # LoGra hooks nn.Linear only and leaves the hooked weights without .grad: a copy.
        self.model = linear_copy(problem.model)
        return problem

    def scores(self, problem: Problem, method: str) -> Tensor:
        if method == "graddot":
            return self._tracin(problem).T
        return self._logra(problem).T

    def _tracin(self, problem: Problem) -> Tensor:
        """``(N, Q)`` full-dimensional GradDot by ``TracInAttributor``."""
        model = self.model

        def loss(params: dict[str, Tensor], data: tuple[Tensor, ...]) -> Tensor:
            # One example under vmap; an unbatched all-ones mask keeps transformers'
            # mask checks off the vmapped ids (data-dependent control flow).
            ids = data[0][None]
            mask = torch.ones(ids.shape, dtype=torch.long)
            inputs = {"input_ids": ids, "attention_mask": mask}
            logits = functional_call(model, params, (), inputs).logits
            return causal_lm_example_losses(logits, ids)[0]

        task = AttributionTask(loss_func=loss, model=model, checkpoints=model.state_dict())
        attributor = TracInAttributor(
            task,
            weight_list=torch.ones(1),
            normalized_grad=False,
            projector_kwargs={"proj_type": "identity", "device": str(problem.device)},
            layer_name=parameter_names(model, problem.layers),
        )
        train = DataLoader(TensorDataset(problem.train), batch_size=problem.batch)
        queries = DataLoader(TensorDataset(problem.queries), batch_size=problem.batch)
        return attributor.attribute(train, queries)

    def _logra(self, problem: Problem) -> Tensor:
        """``(N, Q)`` factor-projected GradDot by ``LoGraAttributor`` (no Hessian)."""

        def loss(model: nn.Module, batch: dict[str, Tensor], device: Any) -> Tensor:
            # LoGra multiplies the per-example gradients by the batch size (a batch-mean
            # loss): the mean of the summed losses gives each example's summed gradient.
            return example_losses(model, batch["input_ids"]).mean()

        work = self.scratch(problem)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        task = AttributionTask(
            loss_func=loss, model=self.model, checkpoints=self.model.state_dict()
        )
        attributor = LoGraAttributor(
            task,
            layer_names=list(problem.layers),
            hessian="Identity",
            proj_dim=problem.k * problem.k,
            offload="none",
            cache_dir=str(work),
        )
        train, queries = (
            DataLoader(RowDataset(rows), batch_size=problem.batch, collate_fn=collate_rows)
            for rows in (problem.train, problem.queries)
        )
        attributor.cache(train)
        return attributor.attribute(train, queries) * (problem.train.shape[1] - 1)
