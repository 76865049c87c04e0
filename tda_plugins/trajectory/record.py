"""What one recorded optimizer step says: hyperparameters, per-layer update facts, clipping.

A :class:`StepRecord` is the JSON ``"record"`` of a step file's metadata (checked as
untrusted input when read) together with the step's tensors: the example ids it trained
on, each example's ``loss_scale`` and, per layer, Adam's second moment after the step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from tda_plugins.store.layout import StoreError


@dataclass(frozen=True)
class AdamGroup:
    """One optimizer parameter group's hyperparameters at a step (the values the update
    used: ``lr`` is the scheduler's value for this step)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def to_json(self) -> dict[str, float]:
        return {
            "lr": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }

    @classmethod
    def from_json(cls, value: Any, where: str) -> AdamGroup:
        fields = ("lr", "beta1", "beta2", "eps", "weight_decay")
        if not isinstance(value, dict) or sorted(value) != sorted(fields):
            raise StoreError(f"{where} is not a parameter group record")
        numbers = [value[f] for f in fields]
        if not all(isinstance(x, int | float) and math.isfinite(x) for x in numbers):
            raise StoreError(f"{where} holds a non-finite or non-numeric hyperparameter")
        return cls(*(float(x) for x in numbers))


@dataclass(frozen=True)
class LayerUpdate:
    """What the optimizer did to one captured layer at a step.

    Attributes:
        groups: the parameter group of each captured parameter of the layer, in the order
            of the layout's parameter names.
        adam_step: Adam's step count after the step (the ``k`` of its bias corrections
            ``1 - beta^k``).
        updated: whether the optimizer updated the layer at this step (``False``: a
            skipped step, whose state and weights stayed as they were).
    """

    groups: tuple[int, ...]
    adam_step: int
    updated: bool

    def to_json(self) -> dict[str, Any]:
        return {"groups": list(self.groups), "adam_step": self.adam_step, "updated": self.updated}

    @classmethod
    def from_json(cls, value: Any, where: str, n_groups: int) -> LayerUpdate:
        if not isinstance(value, dict) or sorted(value) != ["adam_step", "groups", "updated"]:
            raise StoreError(f"{where} is not a layer update record")
        groups, step, updated = value["groups"], value["adam_step"], value["updated"]
        if not isinstance(groups, list) or not all(
            type(g) is int and 0 <= g < n_groups for g in groups
        ):
            raise StoreError(f"{where}: groups must be indices of the step's parameter groups")
        if type(step) is not int or step < 0 or type(updated) is not bool:
            raise StoreError(f"{where}: adam_step must be an integer >= 0, updated a bool")
        if updated and step < 1:
            raise StoreError(f"{where}: an updated layer has adam_step >= 1")
        return cls(tuple(groups), step, updated)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step of the run.

    Loss convention: ``example_ids[i]``'s stored gradient ``g_i`` (its own summed token
    loss) entered the step's gradient as ``g_i / loss_scale[i]`` (the trainer's
    normalization: token mean over the window, accumulation, world size), then the whole
    gradient was multiplied by ``clip`` (gradient clipping; 1 when none applied).

    Attributes:
        step: the optimizer step (the store's step numbering).
        example_ids: ``(N,)`` int64 ids of the examples the step trained on.
        loss_scale: ``(N,)`` float64, as above.
        clip: the clipping factor applied to the whole gradient.
        groups: the optimizer's parameter groups at this step.
        layers: captured layer name -> :class:`LayerUpdate`.
        optimizer: the optimizer's class name.
    """

    step: int
    example_ids: Tensor
    loss_scale: Tensor
    clip: float
    groups: tuple[AdamGroup, ...]
    layers: dict[str, LayerUpdate]
    optimizer: str

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata of the step file (the tensors are stored apart)."""
        record = {
            "step": self.step,
            "clip": self.clip,
            "optimizer": self.optimizer,
            "groups": [g.to_json() for g in self.groups],
            "layers": {name: u.to_json() for name, u in self.layers.items()},
        }
        return {"record": json.dumps(record, allow_nan=False)}

    @classmethod
    def parse(
        cls, metadata: dict[str, str] | None, example_ids: Tensor, loss_scale: Tensor, where: str
    ) -> StepRecord:
        """Validate a step file's metadata and tensors."""
        try:
            record = json.loads((metadata or {})["record"])
        except (KeyError, json.JSONDecodeError) as error:
            raise StoreError(f"{where} has no readable step record ({error!r})") from error
        keys = ["clip", "groups", "layers", "optimizer", "step"]
        if not isinstance(record, dict) or sorted(record) != keys:
            raise StoreError(f"{where}: the step record lacks or adds fields (wants {keys})")
        clip, groups_raw, layers_raw = record["clip"], record["groups"], record["layers"]
        if not isinstance(clip, int | float) or not 0 < clip <= 1:
            raise StoreError(f"{where}: clip must be a number in (0, 1]")
        if not isinstance(groups_raw, list) or not groups_raw:
            raise StoreError(f"{where}: groups must be a non-empty list")
        groups = tuple(
            AdamGroup.from_json(g, f"{where} group {i}") for i, g in enumerate(groups_raw)
        )
        if not isinstance(layers_raw, dict):
            raise StoreError(f"{where}: layers must map layer names to update records")
        layers = {
            str(name): LayerUpdate.from_json(u, f"{where} layer {name}", len(groups))
            for name, u in layers_raw.items()
        }
        if example_ids.dim() != 1 or loss_scale.shape != example_ids.shape:
            raise StoreError(f"{where}: example_ids and loss_scale must be (N,) tensors")
        if not bool(loss_scale.isfinite().all()) or bool((loss_scale == 0).any()):
            raise StoreError(f"{where}: every loss_scale must be finite and non-zero")
        return cls(
            int(record["step"]),
            example_ids,
            loss_scale,
            float(clip),
            groups,
            layers,
            str(record["optimizer"]),
        )
