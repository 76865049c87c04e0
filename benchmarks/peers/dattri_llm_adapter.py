"""dattri-llm: live attribution (``Attributor.attribute``) through its ``HookManager``
on the model's ordinary backward: ``TracInAttributor`` at one checkpoint (GradDot), with
capture-time "logra" factor projection for the projected row, ``KFACAttributor`` and
``EKFACAttributor`` with relative damping 0.1 (our convention)."""

from __future__ import annotations

import re
from typing import Any

from common import RowDataset
from dattri_llm import AttributionArguments, AttributionTask, HookManagerConfig
from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from torch import Tensor, nn

from peers.base import PeerAdapter, register_peer
from peers.workload import Problem, example_losses

_ATTRIBUTORS = {
    "graddot": TracInAttributor,
    "graddot_proj": TracInAttributor,
    "kfac": KFACAttributor,
    "ekfac": EKFACAttributor,
}


def _summed_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The batch's summed per-example token losses (each example's own summed loss)."""
    return example_losses(model, batch["input_ids"]).sum()


@register_peer
class DattriLLM(PeerAdapter):
    """dattri-llm 0.1 on the live model; capture style "auto" (its cost model), except
    "factorized" for K-FAC and EK-FAC."""

    name = "dattri-llm"

    def scores(self, problem: Problem, method: str) -> Tensor:
        layers = [f"{re.escape(n)}$" for n in problem.layers]
        if method == "graddot_proj":
            projection = {
                "__default__": {
                    "style": "logra",
                    "proj_dim": problem.k,
                    "proj_type": "rademacher",
                    "proj_seed": 0,
                    "proj_max_batch_size": 32,
                }
            }
            hooks = HookManagerConfig(linear_io=layers, projection_kwargs=projection)
        else:
            # "auto" (its cost model) materializes a layer once T >= N_i N_o / (N_i + N_o),
            # and a materialized layer cannot enter K-FAC (dattri-llm then warns and falls
            # back to a capped dense Fisher, or leaves the layer out): K-FAC and EK-FAC
            # capture factorized, as dattri-llm's warning advises.
            style = "factorized" if method in ("kfac", "ekfac") else "auto"
            hooks = HookManagerConfig(linear_io=layers, capture_style=style)
        args = AttributionArguments(
            output_dir=str(problem.work / "dattri-llm"),
            per_device_train_batch_size=problem.batch,
            per_device_eval_batch_size=problem.batch,
            dataloader_pin_memory=False,
            use_cpu=problem.device.type == "cpu",
        )
        task = AttributionTask(loss_func=_summed_loss, model=problem.model)
        options: dict[str, Any] = {}
        if method in ("kfac", "ekfac"):
            options = {"damping": 0.1, "relative_damping": True}
        score = _ATTRIBUTORS[method](args, task=task).attribute(
            RowDataset(problem.train), RowDataset(problem.queries), hook_config=hooks, **options
        )
        _, matrix = score.agnostic_matrix()
        return matrix.T
