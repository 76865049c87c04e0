"""What the engine hands to consumers: one record per finished micro-batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.grads.base import PerExampleGrad, unique_nbytes


@dataclass
class LayerRecord:
    """One layer's per-example gradients in a micro-batch.

    Attributes:
        name: the module's name in the hooked model.
        module: the module itself (for parameter shapes; never for its data).
        adapter: the adapter that captured it.
        grads: per-example gradients (factorized, projected or materialized).
    """

    name: str
    module: nn.Module
    adapter: LayerAdapter
    grads: PerExampleGrad

    def param_grads(self) -> dict[str, Tensor]:
        """``"<module>.<param>"`` -> ``(B, *param.shape)`` (unprojected captures only)."""
        return {
            f"{self.name}.{local}" if self.name else local: g
            for local, g in self.adapter.param_grads(self.module, self.grads).items()
        }


@dataclass
class MicroBatchRecord:
    """Per-example gradients of every selected layer for one micro-batch.

    Loss convention: the gradients are contributions to the gradient of the loss that was
    backpropagated (for a trainer's mean loss, each example's share of ``.grad``; for a
    summed per-example loss, each example's own gradient). They stay on the model's
    device; :meth:`to` moves them (asynchronously where the device allows).

    Attributes:
        index: micro-batch counter since the engine was attached (0-based).
        step: optimizer step the micro-batch belongs to (0-based).
        example_ids: ``(B,)`` int64 ids (explicit, else a content hash of the unpadded ids).
        content_ids: the ids are content hashes (no explicit ids were given), so duplicated
            rows share one, in a micro-batch or a step alike: one example trained twice.
        token_mask: ``(B, T)`` bool, true at real (non-padding) tokens; ``None`` when the
            forward call had no 2-D attention mask.
        layers: module name -> :class:`LayerRecord`, in model order.
        projected: whether the gradients were projected in the hook.
        input_ids: ``(B, T)`` token ids of the forward call, when it had them (a reference,
            for reports; never copied by the engine).
        labels: the ``labels`` keyword of the forward call, when it had one (a reference).
        shift_labels: the ``shift_labels`` keyword, when it had one (a reference):
            transformers' next-token targets, ``(B, T)`` with position ``t`` predicting
            ``shift_labels[:, t]``, which its causal-LM loss uses in place of ``labels``.
        loss_scale: multiply the gradients by this to get each example's own gradient
            under the store's loss convention (e.g. the token count a mean loss divided
            by); 1 when the backpropagated loss already was the per-example summed loss.
        loss_scale_rounding: the relative rounding ``loss_scale`` carries (0: exact; a
            scale read off a 16-bit gradient, TRL's fused head on a bfloat16 model, 2^-8).
    """

    index: int
    step: int
    example_ids: Tensor
    token_mask: Tensor | None
    layers: dict[str, LayerRecord] = field(default_factory=dict)
    projected: bool = False
    loss_scale: float | Tensor = 1.0
    loss_scale_rounding: float = 0.0
    input_ids: Tensor | None = None
    labels: Tensor | None = None
    shift_labels: Tensor | None = None
    content_ids: bool = False

    @property
    def batch_size(self) -> int:
        return int(self.example_ids.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = True) -> MicroBatchRecord:
        """A copy with every tensor moved to ``device``."""

        def move(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=non_blocking)

        return MicroBatchRecord(
            index=self.index,
            step=self.step,
            example_ids=move(self.example_ids),
            token_mask=None if self.token_mask is None else move(self.token_mask),
            layers={
                n: LayerRecord(r.name, r.module, r.adapter, r.grads.map_tensors(move))
                for n, r in self.layers.items()
            },
            projected=self.projected,
            loss_scale=move(self.loss_scale)
            if isinstance(self.loss_scale, Tensor)
            else self.loss_scale,
            loss_scale_rounding=self.loss_scale_rounding,
            input_ids=None if self.input_ids is None else move(self.input_ids),
            labels=None if self.labels is None else move(self.labels),
            shift_labels=None if self.shift_labels is None else move(self.shift_labels),
            content_ids=self.content_ids,
        )

    def example_grads(self) -> dict[str, PerExampleGrad]:
        """Layer name -> its gradients under the store's loss convention (``loss_scale``
        applied; the captured tensors themselves when the scale is the number 1)."""
        if not isinstance(self.loss_scale, Tensor) and self.loss_scale == 1:
            return {name: r.grads for name, r in self.layers.items()}
        return {name: r.grads.scaled(self.loss_scale) for name, r in self.layers.items()}

    def param_grads(self) -> dict[str, Tensor]:
        """Module-qualified parameter name -> ``(B, *param.shape)``, for unprojected captures."""
        if self.projected:
            raise ValueError(
                "this record was projected in the hook; per-parameter gradients need a "
                "capture without projection"
            )
        out: dict[str, Tensor] = {}
        for record in self.layers.values():
            out.update(record.param_grads())
        return out

    def nbytes(self) -> int:
        """Bytes held by the gradient tensors (a shared input factor counts once)."""
        return unique_nbytes([r.grads for r in self.layers.values()])
