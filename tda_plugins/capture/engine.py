"""The capture engine: exact per-example gradients from the training backward pass itself.

How it works, per selected layer and forward call: a forward hook registers a tensor hook
on that call's output, closing over the call's input. When the backward pass reaches the
output, the tensor hook receives ``g = dL/dy`` for exactly that call and hands
``(input, g)`` to the layer's adapter. Pairing each call's input with its own output
gradient makes repeated calls of one module, gradient accumulation and both kinds of
gradient checkpointing correct without special cases: under reentrant checkpointing the
first forward runs without grad (nothing is registered) and the recomputation registers
the hooks that fire; under non-reentrant checkpointing the original call's hook fires and
the recomputed call's never does.

A micro-batch starts at the root module's forward (under grad) and finishes when the
backward pass through its output ends (an autograd end-of-backward callback queued from
a hook on the root output), or at the latest at :meth:`CaptureEngine.flush`. Forward
passes without a backward (evaluation, generation, ``torch.no_grad``) leave nothing
behind: the engine keeps only what a backward hook has delivered.

Nothing in the hooks reads tensor values on the host (records stay on the model's device),
but the sampled order check of a layer called on the batch's flattened tokens
(``capture/rows.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cached_property, partial
from typing import Any, Self

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.capture.config import CaptureConfig
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.identity import EXAMPLE_IDS_KEY, content_hash
from tda_plugins.capture.layers import (
    LayerSelection,
    head_layers,
    shared_parameter_ids,
    tied_units,
)
from tda_plugins.capture.normalization import (
    LossNormalization,
    LossScale,
    SummedLoss,
    scale_rounding,
)
from tda_plugins.capture.packing import PACKED_ROWS_FIX, packed_rows
from tda_plugins.capture.records import LayerRecord, MicroBatchRecord
from tda_plugins.capture.rows import (
    RowLayout,
    check_row_major,
    checkable_positions,
    order_check_due,
    other_inputs,
    row_layout,
    row_major_layers,
    token_length,
)
from tda_plugins.grads.base import PerExampleGrad, unique_nbytes
from tda_plugins.grads.projection import ProjectionConfig, Projector

#: The engine that alone captures in the current context (see CaptureEngine.exclusive), or
#: :data:`_NO_ENGINE` inside :func:`capture_suspended`.
_EXCLUSIVE: ContextVar[object | None] = ContextVar("tda_plugins_exclusive", default=None)
_NO_ENGINE = object()


@contextmanager
def capture_suspended() -> Iterator[None]:
    """Inside this block (in this thread or task), no engine captures: passes made between
    training steps that no engine should record (a selection target's plain backward)."""
    token = _EXCLUSIVE.set(_NO_ENGINE)
    try:
        yield
    finally:
        _EXCLUSIVE.reset(token)


class _PendingBatch:
    """Gradients delivered so far for one forward call of the root module."""

    def __init__(
        self,
        example_ids: Tensor,
        *,
        token_mask: Tensor | None,
        input_ids: Tensor | None,
        labels: Tensor | None,
        shift_labels: Tensor | None,
        content_ids: bool,
        tokens: int | None,
        number: int,
        other_inputs: bool,
    ):
        self.example_ids = example_ids
        #: ``T``, the micro-batch's token length (``None``: not known from the forward)
        self.tokens = tokens
        #: this micro-batch's place in the run (0-based), for the sampled order checks
        self.number = number
        #: whether the forward carries images, video or audio besides the tokens
        self.other_inputs = other_inputs
        self.content_ids = content_ids
        self.token_mask = token_mask
        self.input_ids = input_ids
        self.labels = labels
        self.shift_labels = shift_labels
        self.loss_scale: LossScale = SummedLoss().observe({}, None)
        self.grads: dict[str, PerExampleGrad] = {}

    @cached_property
    def checkable(self) -> Tensor | None:
        """``(B, T)`` bool: the padded positions a flattened layer's row order is checked
        at (:func:`~tda_plugins.capture.rows.checkable_positions`), or ``None`` where there
        is none; a host read, made only when a flattened layer's check is due."""
        mask = self.token_mask
        if mask is None or mask.shape[1] != self.tokens:
            return None
        positions = checkable_positions(mask, self.labels, self.shift_labels)
        return positions if bool(positions.any()) else None

    def add(self, name: str, grads: PerExampleGrad) -> None:
        previous = self.grads.get(name)
        self.grads[name] = grads if previous is None else previous.merge_call(grads)


def _output_tensors(output: Any) -> Iterable[Tensor]:
    """Tensors that require grad anywhere in a (nested) model output."""
    if isinstance(output, Tensor):
        if output.requires_grad:
            yield output
    elif isinstance(output, dict):
        for value in output.values():
            yield from _output_tensors(value)
    elif isinstance(output, (list, tuple)):
        for value in output:
            yield from _output_tensors(value)


class CaptureEngine:
    """Hooks a model and records exact per-example gradients of the selected layers.

    Args:
        model: any ``nn.Module``; the root whose forward marks a micro-batch.
        layers: which layers to capture (default: LoRA adapters if present, else linear).
        projection: project gradients inside the hook (default: keep them exact).
        consumers: receive each finished micro-batch (see :class:`CaptureConsumer`).
        normalization: how the training loop normalizes its loss, so that each record's
            ``loss_scale`` converts it to per-example summed losses (default: the loss
            backpropagated is already that sum).
        parameter_grads: ``False`` where nothing needs autograd's own gradients of the
            captured parameters: passes that only attribute (query gradients, scoring a
            fixed model), or a consumer that builds ``.grad`` itself (data selection in one
            process, from the kept examples). During each captured layer's forward its
            captured parameters then leave autograd, so the backward skips their
            weight-gradient products (about a third of a linear layer's work) and does not
            write their ``.grad``; the per-example gradients are captured all the same. A
            call whose input needs no gradient (an embedding's token ids) keeps its
            parameters, which the backward then still needs to reach it, and so does a
            parameter that several captured layers share (tied embeddings).

    Use as a context manager, or call :meth:`attach` / :meth:`detach`. Call
    :meth:`optimizer_step` at each optimizer step so consumers see step boundaries, and
    :meth:`end` when training ends. Example ids: pass them with :meth:`set_example_ids`
    before the forward call, or in the forward's keywords under
    :data:`~tda_plugins.capture.identity.EXAMPLE_IDS_KEY`; else each example gets a
    content hash of its unpadded ``input_ids``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: LayerSelection | None = None,
        projection: ProjectionConfig | None = None,
        consumers: Iterable[CaptureConsumer] = (),
        normalization: LossNormalization | None = None,
        parameter_grads: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"CaptureEngine needs an nn.Module, got {type(model).__name__}")
        self.model = model
        self.selection = layers if layers is not None else LayerSelection()
        self.projector = Projector(projection) if projection is not None else None
        self._consumers = list(consumers)
        self.normalization: LossNormalization = normalization or SummedLoss()
        self._layers: dict[str, tuple[nn.Module, LayerAdapter]] = {}
        self._handles: list[RemovableHandle] = []
        self._pending: _PendingBatch | None = None
        self._unfinished: list[_PendingBatch] = []
        self._step_records: list[MicroBatchRecord] = []
        self._explicit_ids: Tensor | None = None
        self._finish_queued = False
        self._paused = False
        self._micro_batches = 0
        self._step = 0
        self.parameter_grads = parameter_grads
        #: Parameters taken out of autograd for the forward call in progress, per module.
        self._detached: dict[nn.Module, list[nn.Parameter]] = {}
        #: ids of parameters that several captured layers share (never taken out).
        self._shared: set[int] = set()
        #: Layer called on the batch's flattened tokens -> padded micro-batches that have
        #: confirmed its row-major order (:func:`~tda_plugins.capture.rows.check_row_major`).
        self._order_checks: dict[str, int] = {}
        #: Root forward calls under grad so far (the next micro-batch's number).
        self._forwards = 0
        #: Captured layers called on the batch's tokens flattened row-major (by their owner).
        self._row_major: set[str] = set()

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    @property
    def layer_names(self) -> list[str]:
        """Names of the captured modules (empty before :meth:`attach`)."""
        return list(self._layers)

    @property
    def captured_layers(self) -> dict[str, tuple[nn.Module, LayerAdapter]]:
        """Module name -> (module, adapter) of every captured layer."""
        return dict(self._layers)

    @property
    def config(self) -> CaptureConfig:
        """Layers, projection and parameter layouts of this capture (layers are known after
        :meth:`attach`)."""
        projection = None if self.projector is None else self.projector.config
        layouts = {name: adapter.parameter_layout(m) for name, (m, adapter) in self._layers.items()}
        ties = tuple(dict.fromkeys(tied_units(self._layers).values()))
        return CaptureConfig(
            tuple(self._layers),
            projection,
            parameters=layouts,
            tied=ties,
            head_layers=head_layers(self.model),
        )

    @property
    def step(self) -> int:
        """Index of the optimizer step the next micro-batch belongs to."""
        return self._step

    def resume_at_step(self, step: int) -> None:
        """Number the next micro-batches from optimizer step ``step`` (a resumed run)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._step = step

    def attach(self) -> Self:
        """Resolve the layer selection and register the hooks. Raises on a bad selection."""
        if self.attached:
            raise RuntimeError("this CaptureEngine is already attached; detach it first")
        self._layers = self.selection.resolve(self.model)
        self._shared = shared_parameter_ids(self._layers)
        self._row_major = row_major_layers(self.model, self._layers)
        config = self.config  # one model walk (layouts, ties, the head) for every consumer
        try:
            for consumer in self._consumers:
                consumer.on_attach(config)
        except BaseException:
            for consumer in self._consumers:  # e.g. a store gives its writer lock back
                consumer.on_detach()
            raise
        self._handles.append(
            self.model.register_forward_pre_hook(self._on_root_forward, with_kwargs=True)
        )
        self._handles.append(
            self.model.register_forward_hook(self._on_root_output, with_kwargs=True)
        )
        for name, (module, adapter) in self._layers.items():
            if not self.parameter_grads:
                before = partial(self._detach_parameters, adapter)
                self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            hook = partial(self._on_layer_forward, name, adapter)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        return self

    def detach(self) -> None:
        """Remove every hook and drop every held tensor. Undelivered gradients are lost;
        consumers finish their background work on delivered ones (a store's last commit
        is on disk when this returns)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for consumer in self._consumers:
            consumer.on_detach()
        self._restore_all()
        self._pending = None
        self._unfinished.clear()
        self._step_records.clear()
        self._explicit_ids = None
        self._finish_queued = False

    def __enter__(self) -> Self:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forward and backward passes inside this block are not captured by this engine."""
        self._paused, self._pending = True, None
        try:
            yield
        finally:
            self._paused = False

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Inside this block (in this thread or task), only this engine captures: every
        other engine on any model ignores the passes. Query or target gradients computed
        between training steps use it, so no training engine records them."""
        token = _EXCLUSIVE.set(self)
        try:
            yield
        finally:
            _EXCLUSIVE.reset(token)

    @property
    def capturing(self) -> bool:
        """Whether passes made now are recorded by this engine (attached, not paused, and
        no other engine holds :meth:`exclusive`)."""
        return self.attached and not self._ignoring()

    def _ignoring(self) -> bool:
        owner = _EXCLUSIVE.get()
        return self._paused or (owner is not None and owner is not self)

    def add_consumer(self, consumer: CaptureConsumer) -> None:
        """Register a consumer for the micro-batches that finish from now on."""
        if self.attached:
            consumer.on_attach(self.config)
        self._consumers.append(consumer)

    # -- signals from the training loop ------------------------------------------------

    def set_example_ids(self, ids: Tensor) -> None:
        """``(B,)`` integer ids for the examples of the next root forward call."""
        if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.is_floating_point():
            raise ValueError("example ids must be a 1-D integer tensor with one id per example")
        self._explicit_ids = ids

    def flush(self) -> None:
        """Finish every micro-batch whose gradients have arrived (normally automatic)."""
        self._restore_all()
        unfinished, self._unfinished = self._unfinished, []
        for batch in unfinished:
            self._finish(batch)

    def optimizer_step(self) -> None:
        """Mark an optimizer step: consumers get the step's records, then the step advances."""
        self.flush()
        records, self._step_records = self._step_records, []
        for consumer in self._consumers:
            consumer.on_optimizer_step(self._step, records)
        self._step += 1

    def end(self) -> None:
        """Finish pending micro-batches and tell consumers that capture has ended."""
        self.flush()
        for consumer in self._consumers:
            consumer.on_end()

    def held_bytes(self) -> int:
        """Bytes of gradient tensors the engine itself holds right now (a tensor shared by
        several layers, such as the q/k/v input, counts once)."""
        grads = [g for b in self._unfinished for g in b.grads.values()]
        grads += [r.grads for record in self._step_records for r in record.layers.values()]
        return unique_nbytes(grads)

    # -- hooks -----------------------------------------------------------------------

    def _on_root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._ignoring() or not torch.is_grad_enabled():
            return
        # A previous micro-batch whose end-of-backward callback never ran is done now.
        self.flush()
        packed = packed_rows(kwargs)
        if packed is not None:
            raise ValueError(
                f"{packed}: per-example capture would store the whole row as one example "
                f"(its gradient the sum of the sequences'); {PACKED_ROWS_FIX}"
            )
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        token_mask = mask.bool() if isinstance(mask, Tensor) and mask.dim() == 2 else None
        ids, self._explicit_ids = self._explicit_ids, None
        if ids is None:
            ids = kwargs.get(EXAMPLE_IDS_KEY)  # carried in the batch by the data path
        content_ids = ids is None
        multimodal = other_inputs(kwargs)
        if content_ids and multimodal:
            raise ValueError(
                f"{type(module).__name__} was called with images, video or audio besides its "
                "tokens, and no example ids: a content hash of the tokens would name two "
                "examples of one text and other images alike (one example, trained twice); "
                "give each example an id (engine.set_example_ids(ids) before the forward)"
            )
        if ids is None:
            if not isinstance(input_ids, Tensor):
                raise ValueError(
                    f"cannot derive example ids: {type(module).__name__} was called without "
                    "input_ids or a tensor first argument; call engine.set_example_ids(ids) "
                    "before the forward"
                )
            same_shape = token_mask is not None and token_mask.shape == input_ids.shape
            ids = content_hash(input_ids, token_mask if same_shape else None)
        tokens = (
            input_ids
            if isinstance(input_ids, Tensor) and not input_ids.is_floating_point()
            else None
        )
        labels, shift_labels = (kwargs.get(k) for k in ("labels", "shift_labels"))
        self._pending = _PendingBatch(
            ids,
            token_mask=token_mask,
            input_ids=tokens,
            labels=labels if isinstance(labels, Tensor) else None,
            shift_labels=shift_labels if isinstance(shift_labels, Tensor) else None,
            content_ids=content_ids,
            tokens=token_length(input_ids, token_mask, labels),
            number=self._forwards,
            other_inputs=multimodal,
        )
        self._forwards += 1

    def _on_root_output(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        batch = self._pending
        if batch is None or self._ignoring() or not torch.is_grad_enabled():
            return
        batch.loss_scale = self.normalization.observe(kwargs, output)
        for tensor in _output_tensors(output):
            tensor.register_hook(partial(self._on_root_grad, batch))

    def _on_root_grad(self, batch: _PendingBatch, grad: Tensor) -> None:
        if self._finish_queued:
            return
        self._finish_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._finish_queued = False
        self.flush()

    def _detach_parameters(
        self, adapter: LayerAdapter, module: nn.Module, args: tuple, kwargs: dict
    ) -> None:
        """Before a captured call (``parameter_grads=False``): its parameters out of autograd,
        unless its input needs no gradient (then its output would need none either)."""
        if self._pending is None or self._ignoring() or not torch.is_grad_enabled():
            return
        if not adapter.layer_input(module, args, kwargs).requires_grad:
            return
        params = [
            p for p in adapter.captured_parameters(module).values() if id(p) not in self._shared
        ]
        for p in params:
            p.requires_grad_(False)
        self._detached[module] = params

    def _restore_parameters(self, module: nn.Module) -> None:
        for p in self._detached.pop(module, ()):
            p.requires_grad_(True)

    def _restore_all(self) -> None:
        """Every parameter still out of autograd back in: a forward cut short between a
        layer's two hooks leaves its parameters out (non-reentrant checkpointing stops its
        recomputation, by an exception, once it has the tensors it needs)."""
        for module in list(self._detached):
            self._restore_parameters(module)

    def _on_layer_forward(
        self,
        name: str,
        adapter: LayerAdapter,
        module: nn.Module,
        args: tuple,
        kwargs: dict,
        output: Any,
    ) -> Any:
        self._restore_parameters(module)
        batch = self._pending
        if batch is None or self._ignoring() or not torch.is_grad_enabled():
            return None
        out = output if isinstance(output, Tensor) else output[0]
        if not out.requires_grad:
            return None
        x = adapter.layer_input(module, args, kwargs)
        layout = row_layout(
            name,
            out.shape,
            batch.example_ids.shape[0],
            batch.tokens,
            other_inputs=batch.other_inputs,
            row_major=name in self._row_major,
        )
        replaced = None
        if layout is None:
            # A call shared by the whole batch (GPT-2's position embedding): expanding its
            # output to the batch is numerically the same broadcast, and makes the gradient
            # arriving there per-example.
            examples = batch.example_ids.shape[0]
            out = out.expand(examples, *out.shape[1:])
            x = x.expand(examples, *x.shape[1:])
            replaced = out if isinstance(output, Tensor) else (out, *output[1:])
            layout = RowLayout(examples)
        # The hook holds the input through a one-slot holder it empties when it fires, so the
        # input is not kept alive past this call's backward by the hook itself.
        holder: list[Tensor | None] = [x]
        out.register_hook(
            partial(self._on_layer_grad, batch, name, module, adapter, layout, holder)
        )
        return replaced

    def _on_layer_grad(
        self,
        batch: _PendingBatch,
        name: str,
        module: nn.Module,
        adapter: LayerAdapter,
        layout: RowLayout,
        holder: list[Tensor | None],
        grad: Tensor,
    ) -> None:
        x, holder[0] = holder[0], None
        if not self.attached or x is None:  # detached, or a second backward through the call
            return
        self._restore_all()
        checks = self._order_checks.get(name, 0)
        if layout.flattened and order_check_due(checks, batch.number):
            positions = batch.checkable
            if positions is not None and check_row_major(name, grad, positions):
                self._order_checks[name] = checks + 1
        grads = adapter.capture(module, layout.per_example(x), layout.per_example(grad))
        if self.projector is not None:
            grads = self.projector(name, grads)
        batch.add(name, grads)
        if not any(b is batch for b in self._unfinished):
            self._unfinished.append(batch)

    def _finish(self, batch: _PendingBatch) -> None:
        grads, batch.grads = batch.grads, {}
        record = MicroBatchRecord(
            index=self._micro_batches,
            step=self._step,
            example_ids=batch.example_ids,
            token_mask=batch.token_mask,
            layers={
                name: LayerRecord(name, module, adapter, grads[name])
                for name, (module, adapter) in self._layers.items()
                if name in grads
            },
            projected=self.projector is not None,
            loss_scale=batch.loss_scale(),
            loss_scale_rounding=scale_rounding(batch.loss_scale),
            input_ids=batch.input_ids,
            labels=batch.labels,
            shift_labels=batch.shift_labels,
            content_ids=batch.content_ids,
        )
        _require_every_layer(record, self._layers)
        self._micro_batches += 1
        for consumer in self._consumers:
            consumer.on_micro_batch(record)
        if any(c.wants_step_records for c in self._consumers):
            self._step_records.append(record)


def _require_every_layer(record: MicroBatchRecord, layers: Iterable[str]) -> None:
    """Refuse a micro-batch without the gradients of some captured layer: it received none
    through its module call (no consumer can hold, score or correct that layer's share of
    the step), before any consumer sees it and before the optimizer step."""
    absent = next((name for name in layers if name not in record.layers), None)
    if absent is not None:
        raise RuntimeError(
            f"layer {absent!r} received no gradient through its module call in a micro-batch "
            f"of step {record.step + 1} (unused, or its weight used directly, as a fused loss "
            "head does: Liger's fused linear cross-entropy, TRL's fused LM head), so its "
            "per-example gradients are missing; leave it out of the captured layers "
            "(LayerSelection(exclude=...)) or turn the fusion off"
        )
