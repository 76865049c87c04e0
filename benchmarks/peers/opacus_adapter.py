"""opacus: per-sample gradients materialized by ``GradSampleModule`` hooks (its
registered per-layer-type samplers) on a copy of the model with only the chosen layers
trainable (GPT-2's ``Conv1D`` swapped for equivalent ``nn.Linear``); GradDot is the dot
of the flattened per-sample gradients. opacus computes per-sample gradients only: no
projection, no curvature."""

from __future__ import annotations

import torch
from opacus import GradSampleModule
from torch import Tensor

from peers.base import PeerAdapter, register_peer
from peers.workload import Problem, example_losses, linear_copy, row_batches


@register_peer
class Opacus(PeerAdapter):
    """opacus 1.6 ``GradSampleModule`` (hooks mode), query gradients held in memory."""

    name = "opacus"

    def prepare(self, problem: Problem, method: str) -> Problem:
        model = linear_copy(problem.model)
        chosen = {f"{n}.{p}" for n in problem.layers for p in ("weight", "bias")}
        for name, param in model.named_parameters():
            param.requires_grad_(name in chosen)
        self.model = GradSampleModule(model, batch_first=True, loss_reduction="sum")
        return problem

    def _gradients(self, rows: Tensor, batch: int) -> list[Tensor]:
        """Per micro-batch: ``(b, D)`` flattened per-sample gradients of the layers."""
        out = []
        params = [p for p in self.model.parameters() if p.requires_grad]
        for ids in row_batches(rows, batch):
            example_losses(self.model, ids).sum().backward()
            out.append(torch.cat([p.grad_sample.flatten(1) for p in params], dim=1))
            self.model.zero_grad(set_to_none=True)
        return out

    def scores(self, problem: Problem, method: str) -> Tensor:
        queries = torch.cat(self._gradients(problem.queries, problem.batch))
        train = self._gradients(problem.train, problem.batch)
        return torch.cat([queries @ block.T for block in train], dim=1)
