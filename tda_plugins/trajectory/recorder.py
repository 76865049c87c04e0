"""``TrajectoryRecorder``: the capture consumer that records each optimizer step.

Per step it keeps what a trajectory-aware method needs to replay the step's effect of
each example on the final weights, beside the gradients the store already holds:

- the examples the step trained on and each one's ``loss_scale`` (its stored gradient
  entered ``.grad`` as ``g / loss_scale``), from the micro-batch records;
- the clipping factor: the norm of every ``.grad`` when each micro-batch's backward ends
  (the last one's is the norm the trainer clips), turned into torch's
  ``min(1, max_grad_norm / (norm + 1e-6))``;
- after the optimizer's update (:meth:`after_update`, called by the integration before
  any scheduler moves the learning rate on): each parameter group's ``lr``, betas, eps and
  weight decay, each captured layer's Adam step count and whether the update touched it,
  and its second moment ``exp_avg_sq`` in the store's flattened layout.

Where ``.grad`` is still there after the update (the transformers ``Trainer``), it is
checked against the backward's: its norm against the clipped norm, and
:data:`GRAD_SAMPLES` evenly strided entries of every ``.grad`` against the same entries at
the backward's end times the clipping factor (a norm alone misses an edit that clipping
brings back to ``max_grad_norm``, or a sign flip). Anything that edits ``.grad`` between
the backward and the optimizer (data selection, another callback) would make the
recorded step not the run's, and is refused at that step.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.store.layout import StoreError
from tda_plugins.trajectory.optimizer import (
    adam_groups,
    adam_step_count,
    group_of_parameters,
    second_moment,
)
from tda_plugins.trajectory.record import LayerUpdate, StepRecord
from tda_plugins.trajectory.writer import LayerLayout, TrajectoryWriter

#: Relative difference allowed between ``.grad``'s norm after clipping and the clipped
#: norm measured at the backward's end (fp32 rounding of one rescale); also between the
#: sampled entries, relative to the largest of them.
NORM_TOLERANCE = 1e-4

#: Entries of each ``.grad`` (its local shard) sampled at the backward's end and compared
#: after the update: at most this many per parameter, evenly strided over it.
GRAD_SAMPLES = 64


def layer_layouts(layers: Mapping[str, tuple[nn.Module, LayerAdapter]]) -> dict[str, LayerLayout]:
    """Per layer, its captured parameters' names and which of them each entry of its
    flattened ``(D,)`` layout belongs to (``adapter.flatten`` of constant tensors)."""
    out = {}
    for name, (module, adapter) in layers.items():
        params = adapter.captured_parameters(module)
        marks = {
            local: torch.full(p.shape, float(i)) for i, (local, p) in enumerate(params.items())
        }
        out[name] = (tuple(params), adapter.flatten(module, marks).to(torch.uint8))
    return out


def uncovered_parameters(
    optimizer: torch.optim.Optimizer, layers: Mapping[str, tuple[nn.Module, LayerAdapter]]
) -> list[str]:
    """Captured parameters the optimizer does not update (``layer.local`` names)."""
    groups = group_of_parameters(optimizer)
    return [
        f"{name}.{local}"
        for name, (module, adapter) in layers.items()
        for local, p in adapter.captured_parameters(module).items()
        if id(p) not in groups
    ]


def grad_norm(model: nn.Module) -> Tensor:
    """The 2-norm of every ``.grad`` of ``model`` together, as ``clip_grad_norm_`` takes it
    (a 0-dim tensor on the device: no host sync)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads)


def _strided(grad: Tensor) -> Tensor:
    """Up to :data:`GRAD_SAMPLES` evenly strided entries of ``grad`` (a DTensor's local
    shard), as a new fp64 ``(S,)`` tensor on its device."""
    flat = (grad.to_local() if hasattr(grad, "to_local") else grad).reshape(-1)
    return flat[:: max(1, flat.numel() // GRAD_SAMPLES)][:GRAD_SAMPLES].to(torch.float64, copy=True)


def grad_samples(model: nn.Module) -> dict[int, Tensor]:
    """``id(parameter) -> (S,)`` strided entries of every ``.grad`` of ``model`` now."""
    return {id(p): _strided(p.grad) for p in model.parameters() if p.grad is not None}


class TrajectoryRecorder(CaptureConsumer):
    """Records each optimizer step into ``writer`` (see the module docstring).

    Args:
        writer: the store's trajectory folder of this rank.
        layers: the captured layers (name -> module, adapter), as the engine resolved them.
        optimizer: the run's optimizer (one :func:`~.optimizer.optimizer_refusal` accepts).
        model: the trained model, whose ``.grad`` norm clipping reads.
        max_grad_norm: the trainer's clipping threshold; ``None`` or 0: no clipping.
    """

    def __init__(
        self,
        writer: TrajectoryWriter,
        *,
        layers: Mapping[str, tuple[nn.Module, LayerAdapter]],
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        max_grad_norm: float | None,
    ):
        self.writer = writer
        self.optimizer = optimizer
        self.model = model
        self.max_grad_norm = float(max_grad_norm or 0.0)
        self._layers = dict(layers)
        self._params = {n: a.captured_parameters(m) for n, (m, a) in self._layers.items()}
        writer.write_layout(layer_layouts(self._layers))
        self._batches: list[tuple[Tensor, Tensor]] = []
        self._norm: Tensor | None = None
        self._samples: dict[int, Tensor] = {}
        #: The step whose update is awaited: its number, examples, backward norm, counts.
        self._awaited: tuple[int, list[tuple[Tensor, Tensor]], Tensor | None, dict[str, int]]
        self._awaited = (-1, [], None, {})
        #: The awaited step's ``.grad`` samples at its backward's end (:func:`grad_samples`).
        self._awaited_samples: dict[int, Tensor] = {}

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        scale = record.loss_scale
        size = record.batch_size
        if isinstance(scale, Tensor):
            per_example = scale.detach().reshape(()).double().expand(size)
        else:
            per_example = torch.full((size,), float(scale), dtype=torch.float64)
        self._batches.append((record.example_ids.detach(), per_example))
        self._norm = grad_norm(self.model)
        self._samples = grad_samples(self.model)

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        counts = {name: adam_step_count(self.optimizer, p) for name, p in self._params.items()}
        self._awaited = (step, self._batches, self._norm, counts)
        self._awaited_samples = self._samples
        self._batches, self._norm, self._samples = [], None, {}

    def after_update(self) -> None:
        """The optimizer has updated the weights (its ``lr`` still the step's): write the
        step. Nothing happens for a step that trained on no example here."""
        step, batches, norm, before = self._awaited
        self._awaited = (-1, [], None, {})
        if not batches:
            return
        clip = self._clip(step, norm)
        groups = group_of_parameters(self.optimizer)
        tensors: dict[str, Tensor] = {
            "example_ids": torch.cat([ids for ids, _ in batches]).cpu(),
            "loss_scale": torch.cat([scale for _, scale in batches]).cpu(),
        }
        updates = {}
        for name, (module, adapter) in self._layers.items():
            params = self._params[name]
            after = adam_step_count(self.optimizer, params)
            updates[name] = LayerUpdate(
                tuple(groups[id(p)] for p in params.values()), after, after > before[name]
            )
            moments = {local: second_moment(self.optimizer, p) for local, p in params.items()}
            flat = adapter.flatten(module, moments).detach()
            dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
            # a copy: the optimizer updates its state in place at the next step
            tensors[f"{name}::exp_avg_sq"] = flat.to("cpu", dtype, copy=True)
        record = StepRecord(
            step,
            tensors["example_ids"],
            tensors["loss_scale"],
            clip,
            adam_groups(self.optimizer),
            updates,
            type(self.optimizer).__name__,
        )
        self.writer.write_step(step, tensors, record.metadata())

    def _clip(self, step: int, norm: Tensor | None) -> float:
        """The clipping factor of ``step`` from the norm at its backward's end, checked
        against ``.grad`` where the update left it."""
        if norm is None:
            raise StoreError(f"no backward finished before optimizer step {step}")
        coef = torch.ones((), dtype=norm.dtype, device=norm.device)
        if self.max_grad_norm > 0:  # torch's clip_grads_with_norm_, in the norm's dtype
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        if any(p.grad is not None for p in self.model.parameters()):
            expected, found = float(coef * norm), float(grad_norm(self.model))
            if abs(found - expected) > NORM_TOLERANCE * max(expected, found, 1e-30):
                self._refuse_edit(
                    step,
                    f"has norm {found:.6g}, not the {expected:.6g} of the captured backward "
                    f"clipped at max_grad_norm={self.max_grad_norm}",
                )
            self._check_samples(step, coef)
        return float(coef)

    def _check_samples(self, step: int, coef: Tensor) -> None:
        """``.grad``'s sampled entries now are the backward's times ``coef``."""
        before = self._awaited_samples
        after = grad_samples(self.model)
        if before.keys() != after.keys():
            self._refuse_edit(step, "has .grad on other parameters than the captured backward")
        if not after:
            return
        now = torch.cat([after[k] for k in before])
        then = torch.cat([before[k] for k in before]) * coef.to(now)
        scale = torch.maximum(now.abs().max(), then.abs().max()).clamp(min=1e-30)
        if bool((now - then).abs().max() > NORM_TOLERANCE * scale):
            self._refuse_edit(
                step,
                "differs entry by entry from the captured backward's (clipped at "
                f"max_grad_norm={self.max_grad_norm})",
            )

    def _refuse_edit(self, step: int, what: str) -> None:
        raise StoreError(
            f"at optimizer step {step} the gradient the optimizer applied {what}: something "
            "edited .grad in between (data selection, another callback), so the recorded "
            "trajectory would not be the run's. Train without it, or set "
            "record_trajectory=False"
        )

    def on_end(self) -> None:
        self.writer.flush()

    def on_detach(self) -> None:
        self.writer.close()
