"""Reading an Adam-family optimizer for the trajectory: which ones are followed, their
hyperparameters per step, and their per-parameter state.

AdamW-influence replays AdamW's update with decoupled weight decay (torch
``AdamW``/``Adam(decoupled_weight_decay=True)``, OLMo-core's ``AdamW`` and
``SkipStepAdamW``):

    theta <- theta (1 - lr wd);   m <- b1 m + (1 - b1) G;   v <- b2 v + (1 - b2) G^2
    theta <- theta - lr / (1 - b1^k) * m / (sqrt(v / (1 - b2^k)) + eps)

with ``k`` Adam's step count after the increment. Anything else (SGD, Adafactor,
AMSGrad, ``maximize``, Adam's coupled L2 decay, other Adam variants whose state or update
differs) is refused before the first step, with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from tda_plugins.parallel.dtensor import gathered
from tda_plugins.store.layout import StoreError
from tda_plugins.trajectory.record import AdamGroup

#: Classes whose update is the one above (matched by name, so that OLMo-core need not be
#: imported): torch's ``Adam``/``AdamW`` and OLMo-core's ``SkipStepAdamW``.
FOLLOWED = (
    "torch.optim.adam.Adam",
    "torch.optim.adamw.AdamW",
    "olmo_core.optim.adamw.SkipStepAdamW",
)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_refusal(optimizer: object) -> str | None:
    """Why the trajectory cannot follow ``optimizer`` (with the way out), or ``None`` when
    its update is the AdamW update above."""
    if optimizer is None:
        return "record_trajectory needs the run's optimizer, and the trainer passed none"
    names = {_qualified(c) for c in type(optimizer).__mro__}
    if not isinstance(optimizer, torch.optim.Optimizer) or not names & set(FOLLOWED):
        return (
            f"record_trajectory follows Adam/AdamW only, and the optimizer is "
            f"{type(optimizer).__name__}; train with AdamW (the transformers default, "
            "optim='adamw_torch'), or set record_trajectory=False"
        )
    for i, group in enumerate(optimizer.param_groups):
        reason = _group_refusal(group)
        if reason is not None:
            return (
                f"record_trajectory cannot follow parameter group {i} of "
                f"{type(optimizer).__name__}: {reason}"
            )
    if not getattr(optimizer, "stepfix", True):
        return (
            "SkipStepAdamW(step_increment_bugfix=False) never advances its step count, so its "
            "bias corrections are not Adam's; set step_increment_bugfix=True"
        )
    return None


def _group_refusal(group: Mapping[str, object]) -> str | None:
    if group.get("amsgrad"):
        return "AMSGrad divides by the running maximum of v; set amsgrad=False"
    if group.get("maximize"):
        return "maximize=True ascends the loss; set maximize=False"
    decoupled = group.get("decoupled_weight_decay", True)
    if group.get("weight_decay") and not decoupled:
        return (
            "Adam's coupled L2 decay adds weight_decay * theta to the gradient; use AdamW "
            "(decoupled weight decay) or weight_decay=0"
        )
    return None


def adam_groups(optimizer: torch.optim.Optimizer) -> tuple[AdamGroup, ...]:
    """Each parameter group's hyperparameters as they are now (read after the update, and
    before any scheduler moves ``lr`` on, they are the ones the update used)."""
    out = []
    for group in optimizer.param_groups:
        beta1, beta2 = (float(b) for b in group["betas"])
        values = (float(group["lr"]), beta1, beta2, float(group["eps"]))
        out.append(AdamGroup(*values, float(group.get("weight_decay", 0.0))))
    if not all(math.isfinite(x) for g in out for x in g.to_json().values()):
        raise StoreError("an optimizer hyperparameter is not finite; the step cannot be recorded")
    return tuple(out)


def group_of_parameters(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``id(parameter)`` -> index of its parameter group."""
    return {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}


def adam_step_count(optimizer: torch.optim.Optimizer, params: Mapping[str, nn.Parameter]) -> int:
    """Adam's step count of a layer's parameters (0 before their first update); its
    parameters must agree (they are updated together)."""
    counts = set()
    for param in params.values():
        step = optimizer.state.get(param, {}).get("step", 0)
        counts.add(int(step.item()) if isinstance(step, Tensor) else int(step))
    if len(counts) != 1:
        raise StoreError(
            f"the parameters {sorted(params)} of one layer have different Adam step counts "
            f"{sorted(counts)}; record_trajectory needs a layer's parameters updated together"
        )
    return counts.pop()


def second_moment(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> Tensor:
    """Adam's ``exp_avg_sq`` of ``param``, whole (a DTensor is gathered)."""
    state = optimizer.state.get(param, {})
    if "exp_avg_sq" not in state:
        raise StoreError(
            "the optimizer holds no exp_avg_sq for a captured parameter after its step; "
            "record_trajectory needs Adam's second moment"
        )
    return gathered(state["exp_avg_sq"])
