"""dattri-llm: live attribution (``Attributor.attribute``) through its ``HookManager``
on the model's ordinary backward: ``TracInAttributor`` at one checkpoint (GradDot), with
capture-time "logra" factor projection for the projected row, ``KFACAttributor`` and
``EKFACAttributor`` with relative damping 0.1 (our convention)."""

from __future__ import annotations

import re
from typing import Any, ClassVar

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
    """dattri-llm 0.1 on the live model; capture style "auto" (its cost model)."""

    name = "dattri-llm"
    notes: ClassVar[dict[str, str]] = {
        "graddot_proj": "logra factor projection, proj_dim = k per side (rademacher)",
        "kfac": "damping 0.1, relative_damping=True",
        "ekfac": "damping 0.1, relative_damping=True",
    }

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
            hooks = HookManagerConfig(linear_io=layers, capture_style="auto")
        args = AttributionArguments(
            output_dir=str(problem.work / "dattri-llm"),
            per_device_train_batch_size=problem.batch,
            per_device_eval_batch_size=problem.batch,
            dataloader_pin_memory=False,
            use_cpu=True,
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
