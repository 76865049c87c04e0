"""Adam-state preconditioning of training gradients (LESS).

The optimizer's first and second moments are saved per captured layer in the store's
materialized layout (``optimizer.safetensors``). A training example's gradient ``g`` is
turned into the update Adam would take from it:

    m' = b1 m + (1 - b1) g,   v' = b2 v + (1 - b2) g^2
    G  = (m' / (1 - b1^(t+1))) / (sqrt(v' / (1 - b2^(t+1))) + eps)

``g`` is the stored per-example gradient (the example's own summed token loss).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from torch import Tensor

from tda_plugins.capture.engine import CaptureEngine
from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.parallel.dtensor import gathered
from tda_plugins.store.io import atomic_write_bytes
from tda_plugins.store.layout import StoreError
from tda_plugins.utils.progress import end_of_run_bar

OPTIMIZER_FILE = "optimizer.safetensors"


class AdamMoments(Protocol):
    """What saving the moments reads of an optimizer: a live ``torch.optim.Optimizer``,
    or the state a trainer checkpointed (``param_groups`` with ``betas`` and ``eps``;
    ``state``: parameter -> its ``exp_avg``, ``exp_avg_sq`` and ``step``)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> Mapping[Tensor, Any]: ...


def adam_state_refusal(engine: CaptureEngine, optimizer: AdamMoments) -> str | None:
    """Why ``optimizer`` holds no Adam moments for the engine's captured parameters
    (``exp_avg`` and ``exp_avg_sq`` in each one's state: Adam, AdamW, NAdam, RAdam, OLMo-core's
    SkipStepAdamW; not Adamax, Adafactor or 8-bit states), or ``None`` when it does."""
    for name, (module, adapter) in engine.captured_layers.items():
        for local, param in adapter.captured_parameters(module).items():
            state = optimizer.state.get(param, {})
            if "exp_avg" not in state or "exp_avg_sq" not in state:
                kind = type(optimizer).__name__
                held = sorted(state) if state else "nothing (no step updated it)"
                return (
                    f"the optimizer ({kind}) keeps no Adam moments for {name}.{local} (its "
                    f"state holds {held}, not exp_avg and exp_avg_sq)"
                )
    return None


def save_adam_state(
    root: str | Path,
    engine: CaptureEngine,
    optimizer: AdamMoments,
    *,
    write: bool = True,
) -> None:
    """Save an Adam/AdamW optimizer's moments for the engine's captured layers.

    Under FSDP2 or HSDP the moments are DTensors sharded like the parameters, and
    gathering each one whole is a collective: then every rank must call this (the
    layers come in the same order everywhere), and only the rank with ``write=True``
    writes the file. One layer's moments are whole at a time; the writing rank keeps
    their fp32 copies on the CPU until the file is written. Unsharded moments (one
    process, DDP) are read as they are, with no communication.
    """
    groups = optimizer.param_groups
    if not groups or any("betas" not in g or "eps" not in g for g in groups):
        raise TypeError(f"LESS needs an Adam-family optimizer, got {type(optimizer).__name__}")
    group = optimizer.param_groups[0]
    tensors: dict[str, Tensor] = {}
    step = 0
    layers = engine.captured_layers.items()
    total = sum(
        2 * 4 * p.numel()
        for module, adapter in dict(layers).values()
        for p in adapter.captured_parameters(module).values()
    )
    bar = end_of_run_bar(total if write else 0, "saving the Adam moments")
    for name, (module, adapter) in layers:
        params = adapter.captured_parameters(module)
        states = [optimizer.state.get(p, {}) for p in params.values()]
        if any("exp_avg" not in s for s in states):
            raise StoreError(f"the optimizer has no Adam state for {name}; save after a step")
        step = max(step, *(int(gathered(s["step"])) for s in states))
        for moment in ("exp_avg", "exp_avg_sq"):
            values = {local: gathered(s[moment]) for local, s in zip(params, states, strict=True)}
            if write:
                # a copy: a tied weight's uses (embedding and head) flatten to one tensor,
                # which safetensors refuses to write twice
                flat = adapter.flatten(module, values)
                tensors[f"{name}::{moment}"] = flat.to("cpu", torch.float32, copy=True)
                bar.update(4 * sum(p.numel() for p in params.values()))
    bar.close()
    if not write:
        return
    meta = {"betas": json.dumps(list(group["betas"])), "eps": str(group["eps"]), "step": str(step)}
    atomic_write_bytes(Path(root) / OPTIMIZER_FILE, save(tensors, metadata=meta))


class AdamUpdate:
    """Turns stored per-example gradients into Adam updates (``optimizer.safetensors``)."""

    def __init__(self, root: str | Path):
        path = Path(root) / OPTIMIZER_FILE
        if not path.exists():
            raise StoreError(
                f"{root} has no optimizer state ({OPTIMIZER_FILE}); LESS needs the Adam moments "
                "saved at the end of training (save_adam_state, or the trainer callbacks)"
            )
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
        self.tensors = load_file(path)
        self.beta1, self.beta2 = json.loads(meta["betas"])
        self.eps = float(meta["eps"])
        self.step = int(meta["step"])

    def __call__(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        key = f"{layer}::exp_avg"
        if key not in self.tensors:
            raise StoreError(f"no Adam state for layer {layer}")
        m, v = self.tensors[key], self.tensors[f"{layer}::exp_avg_sq"]
        g = grads.materialize()
        if g.shape[1] != m.shape[0]:
            raise StoreError(
                f"LESS needs unprojected gradients: layer {layer} has {g.shape[1]} entries, "
                f"its Adam state {m.shape[0]}; capture the store without projection"
            )
        t = self.step + 1
        m_new = (self.beta1 * m + (1 - self.beta1) * g) / (1 - self.beta1**t)
        v_new = (self.beta2 * v + (1 - self.beta2) * g.pow(2)) / (1 - self.beta2**t)
        return DenseGrad(m_new / (v_new.sqrt() + self.eps))
