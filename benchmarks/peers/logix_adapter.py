"""logix-ai: a ``LogIX`` run (the class behind ``logix.init``, without its global
singleton) that watches the chosen layers on a copy of the model (GPT-2's ``Conv1D``
swapped for equivalent ``nn.Linear``: LogIX hooks ``nn.Linear``/``nn.Conv2d`` only and
freezes every parameter it does not watch). A pass over the training rows logs their
per-example gradients to its on-disk log (plus forward/backward covariances for K-FAC and
EK-FAC, and a second pass for the corrected eigenvalues of EK-FAC); then each query
micro-batch is logged in memory and scored by ``compute_influence_all`` against the log.

Conventions that differ from the reference: LogIX's per-example gradient is the weight's
only (no bias column); its K-FAC/EK-FAC damping is ``0.1 x mean`` of the *first*
module's Kronecker (or corrected) eigenvalues, reused for every module, added to the
product ``S (x) A`` rather than to each factor."""

from __future__ import annotations

import copy
from typing import Any

import torch
from logix import LogIX
from torch import Tensor, nn

from peers.base import PeerAdapter, register_peer
from peers.workload import Problem, example_losses, linear_copy, row_batches

_COVARIANCES = {"forward": ["covariance"], "backward": ["covariance"]}
#: What LogIX logs on the training pass, per method.
_TRAIN_LOG: dict[str, dict[str, list[str]]] = {
    "graddot": {"grad": ["log"]},
    "kfac": {"grad": ["log"], **_COVARIANCES},
    "ekfac": {"grad": ["log"], **_COVARIANCES},
}


@register_peer
class LogIXPeer(PeerAdapter):
    """logix-ai 0.1 on CPU, fp32, log and statistics under the problem's scratch folder."""

    name = "logix"

    def prepare(self, problem: Problem, method: str) -> Problem:
        self.template = linear_copy(problem.model)
        return problem

    def _pass(self, run: LogIX, model: nn.Module, rows: Tensor, batch: int) -> None:
        """One logged forward + backward per micro-batch of ``rows`` (ids = row numbers)."""
        start = 0
        for ids in row_batches(rows, batch):
            with run(data_id=list(range(start, start + len(ids)))):
                model.zero_grad(set_to_none=True)
                example_losses(model, ids).sum().backward()
            start += len(ids)

    def scores(self, problem: Problem, method: str) -> Tensor:
        work = problem.work / "logix"
        work.mkdir(parents=True, exist_ok=True)
        config = work / "config.yaml"
        config.write_text(f"root_dir: {work}\n")
        # watch() freezes the parameters it does not track: a fresh copy per call.
        model = copy.deepcopy(self.template)
        run = LogIX("bench", str(config))
        run.watch(model, name_filter=list(problem.layers))
        run.setup(_TRAIN_LOG[method])
        run.save(True)
        self._pass(run, model, problem.train, problem.batch)
        run.finalize()
        if method == "ekfac":
            run.setup({"grad": ["log", "corrected_eigval"]})
            run.save(False)
            self._pass(run, model, problem.train, problem.batch)
            run.finalize()
        loader = run.build_log_dataloader(batch_size=problem.batch)
        run.setup({"grad": ["log"]})
        run.eval()
        options: dict[str, Any] = {"precondition": method != "graddot", "hessian": "kfac"}
        out = []
        for ids in row_batches(problem.queries, problem.batch):
            with run(data_id=list(range(len(ids)))):
                model.zero_grad(set_to_none=True)
                example_losses(model, ids).sum().backward()
            out.append(run.compute_influence_all(run.get_log(), loader, **options)["influence"])
        return torch.cat(out)
