"""The exact metagradient: the derivative of each query's loss after training with respect
to the weight of each training example's loss, by reverse-mode differentiation through
every recorded AdamW step (docs/design.md section 13).

Not a registered :class:`~tda_plugins.methods.base.AttributionMethod`: those score from
gradient stores, this one replays the training run, so it needs the model and the data.
It is the reference the store-based methods approximate, and a method of its own for
small fine-tunes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from tda_plugins.methods.adamw_replay import (
    AdamState,
    Denominator,
    adamw_update,
    denominator_by_name,
)
from tda_plugins.methods.scores import Scores
from tda_plugins.methods.second_order import require_second_derivatives
from tda_plugins.methods.training_run import (
    AdamWSettings,
    LossConvention,
    MicroBatch,
    TrainingStep,
    TrainingTrajectory,
    convention_by_name,
)
from tda_plugins.session.batch import LossFn, causal_lm_losses, evaluating


@dataclass
class WeightDerivatives:
    """``d L_q(theta_T) / d w_z`` for every training example ``z`` and query ``q``.

    Attributes:
        train_ids: ``(N,)`` int64, the trajectory's distinct example ids, ascending.
        query_ids: ``(M,)`` int64, the queries in the order given.
        values: ``(N, M)``, in the model's dtype (at least fp32): the derivative of the
            query's summed token loss at the final weights with respect to the weight of
            the training example's loss in every step it was trained in.
    """

    train_ids: Tensor
    query_ids: Tensor
    values: Tensor

    def scores(self) -> Scores:
        """The library's convention, ``score = -d L_q / d w_z``: the first-order rise of
        the query's loss when ``z`` is left out (``w_z: 1 -> 0``); positive = helpful."""
        return Scores(self.train_ids, self.query_ids, (-self.values).float().cpu(), "metagradient")


class _LossModule(nn.Module):
    """``loss_fn(model, batch)`` as a module, so that ``functional_call`` can swap the
    model's weights (under the ``model.`` prefix) for the duration of one call."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Mapping[str, Any]) -> Tensor:
        return self.loss_fn(self.model, batch)


class _Run:
    """Per-example losses of the model as a function of its trainable weights."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        self.module = _LossModule(model, loss_fn)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not self.names:
            raise ValueError(
                "the model has no trainable parameter (requires_grad): mark the ones the run "
                "trained (a LoRA model: its adapters)"
            )
        self.device = dict(model.named_parameters())[self.names[0]].device

    def losses(self, params: Sequence[Tensor], batch: MicroBatch) -> Tensor:
        """``(B,)`` each example's summed loss at ``params``."""
        weights = {f"model.{n}": p for n, p in zip(self.names, params, strict=True)}
        inputs = {
            k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in batch.inputs.items()
        }
        losses = functional_call(self.module, weights, (inputs,))
        if losses.shape != (batch.size,):
            raise ValueError(
                f"loss_fn must return ({batch.size},) per-example losses, got {tuple(losses.shape)}"
            )
        return losses

    def gradient_graph(
        self, params: Sequence[Tensor], scale: float, batch: MicroBatch
    ) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        """The loss weights ``w`` (``(B,)`` ones) and the gradient of
        ``scale * sum_i w_i L_i`` at ``params`` (leaves), with its graph in both (``None``
        for a parameter the loss does not use)."""
        losses = self.losses(params, batch)
        weights = torch.ones_like(losses, requires_grad=True)
        objective = scale * (weights * losses).sum()
        grads = torch.autograd.grad(objective, params, create_graph=True, allow_unused=True)
        return weights, grads

    def gradient(
        self, params: Sequence[Tensor], step: TrainingStep, scales: list[float]
    ) -> list[Tensor]:
        """The step's accumulated gradient ``dJ_t / d theta`` at ``params`` (no graph)."""
        leaves = [p.detach().requires_grad_() for p in params]
        total = [torch.zeros_like(p) for p in params]
        for scale, batch in zip(scales, step.micro_batches, strict=True):
            objective = scale * self.losses(leaves, batch).sum()
            parts = torch.autograd.grad(objective, leaves, materialize_grads=True)
            total = [t + g for t, g in zip(total, parts, strict=True)]
        return total


@dataclass
class _Saved:
    """What the replay keeps of step ``t``: the state before it and its gradient."""

    state: AdamState
    grads: list[Tensor]


class _Metagradient:
    """One replay of the run, then one backward through it for all queries."""

    def __init__(
        self,
        run: _Run,
        *,
        trajectory: TrainingTrajectory,
        settings: AdamWSettings,
        convention: LossConvention,
        denominator: Denominator,
    ):
        self.run = run
        self.steps = list(trajectory.steps)
        self.settings = settings
        self.denominator = denominator
        self.decays = [settings.decay_of(n) for n in run.names]
        # every scale before the first step: a micro-batch without labels fails here
        self.scales = [convention.scales(step) for step in self.steps]
        self.train_ids = trajectory.example_ids()

    def update(self, state: AdamState, grads: Sequence[Tensor], index: int) -> AdamState:
        """AdamW's step ``index`` (0-based) from ``state`` with ``grads``."""
        return adamw_update(
            state,
            grads,
            lr=self.steps[index].lr,
            step=index + 1,
            settings=self.settings,
            decays=self.decays,
            denominator=self.denominator,
        )

    def replay(
        self, start: list[Tensor], keep_on: torch.device | str | None, progress: bool
    ) -> tuple[list[_Saved], list[Tensor]]:
        """Train again from ``start``: each step's state and gradient (on ``keep_on``),
        and the final weights."""
        state = AdamState.start(start)
        saved = []
        for index in tqdm(
            range(len(self.steps)), desc="metagradient: replay", disable=not progress
        ):
            grads = self.run.gradient(state.params, self.steps[index], self.scales[index])
            saved.append(_Saved(state.to(keep_on), [g.to(keep_on) for g in grads]))
            with torch.no_grad():
                state = self.update(state, grads, index)
        return saved, state.params

    def require_reproduced(
        self, start: list[Tensor], replayed: list[Tensor], trained: list[Tensor], tolerance: float
    ) -> None:
        """Refuse a replay whose final weights do not give the trained weights' losses.

        On the first and last steps' micro-batches, the ``(B,)`` per-example losses at the
        replayed weights must lie within ``tolerance * ||L(trained) - L(start)||`` of those
        at the trained weights (norms over all those examples). Compared in the losses,
        not the weights: the weights may part along directions the loss does not see (an
        attention key bias has an exactly zero gradient; in fp32 AdamW turns its rounding
        noise into steps of up to ``lr``), which change no score.
        """
        chosen = sorted({0, len(self.steps) - 1})
        batches = [b for t in chosen for b in self.steps[t].micro_batches]
        with torch.no_grad():
            losses = [
                torch.cat([self.run.losses(params, b).double() for b in batches])
                for params in (start, replayed, trained)
            ]
        before, after, target = losses
        moved = float((target - before).norm())
        error = float((after - target).norm())
        if not error <= tolerance * moved:
            raise ValueError(
                f"the replay does not reproduce the run: on the first and last steps' "
                f"examples its final losses lie {error:.3g} from the trained weights' "
                f"losses, {error / max(moved, 1e-300):.3g} of the run's change in them "
                f"{moved:.3g} (tolerance {tolerance}); check that every step is recorded "
                "with its learning rate, the loss convention, clipping and weight decay, "
                "and that the run had no dropout; a run in bf16, or one whose losses barely "
                "moved, may need a larger replay_tolerance"
            )

    def query_adjoints(self, final: list[Tensor], queries: Sequence[MicroBatch]) -> list[AdamState]:
        """Per query, the adjoint of the final state: ``(d L_q / d theta_T, 0, 0)``."""
        leaves = [p.detach().requires_grad_() for p in final]
        zeros = [torch.zeros_like(p) for p in final]
        adjoints = []
        for batch in queries:
            losses = self.run.losses(leaves, batch)
            for j in range(batch.size):
                grads = torch.autograd.grad(
                    losses[j], leaves, retain_graph=j < batch.size - 1, materialize_grads=True
                )
                adjoints.append(AdamState(list(grads), zeros, zeros))
        return adjoints

    def step_backward(
        self, index: int, saved: _Saved, adjoints: list[AdamState], out: Tensor
    ) -> list[AdamState]:
        """Carry every query's adjoint from after step ``index`` to before it, adding the
        step's examples' ``d L_q / d w`` into ``out`` (``(N, M)``)."""
        device = self.run.device
        leaves = [x.detach().to(device).requires_grad_() for x in saved.state.tensors()]
        grads = [g.detach().to(device).requires_grad_() for g in saved.grads]
        state = AdamState.from_tensors(leaves)
        after = self.update(state, grads, index).tensors()
        before, grad_adjoints = [], []
        for q, adjoint in enumerate(adjoints):
            parts = torch.autograd.grad(
                after,
                leaves + grads,
                adjoint.tensors(),
                retain_graph=q < len(adjoints) - 1,
                materialize_grads=True,
            )
            before.append(AdamState.from_tensors(parts[: len(leaves)]))
            grad_adjoints.append(parts[len(leaves) :])
        del after
        step = self.steps[index]
        for scale, batch in zip(self.scales[index], step.micro_batches, strict=True):
            derivatives = self.micro_batch_backward(
                state.params, scale, batch, grad_adjoints, before
            )
            rows = torch.searchsorted(self.train_ids, batch.example_ids.cpu().long()).to(out.device)
            out.index_add_(0, rows, derivatives.to(out.dtype))
        return before

    def require_second_derivatives(self, start: list[Tensor]) -> None:
        """Check the first micro-batch's gradient graph and take one Hessian-vector
        product through it, before the replay: a model op without a double backward
        fails here, not after a whole replay (docs/design.md section 13.4)."""
        leaves = [p.detach().requires_grad_() for p in start]
        batch = self.steps[0].micro_batches[0]
        weights, grads = self.run.gradient_graph(leaves, 1.0, batch)
        require_second_derivatives(self.run.names, grads, weights)
        probe = [[torch.ones_like(p) for p in leaves]]
        try:
            self.micro_batch_backward(leaves, 1.0, batch, probe, [AdamState.start(leaves)])
        except RuntimeError as error:
            raise RuntimeError(
                f"the model cannot be differentiated twice ({error}); the metagradient needs "
                "Hessian-vector products: load it with attn_implementation='eager' or 'sdpa' "
                "(run on PyTorch's math kernel here), not a fused kernel such as "
                "flash_attention_2"
            ) from error

    def micro_batch_backward(
        self,
        params: list[Tensor],
        scale: float,
        batch: MicroBatch,
        grad_adjoints: Sequence[Sequence[Tensor]],
        before: list[AdamState],
    ) -> Tensor:
        """Recompute one micro-batch's gradient with its graph and pull each query's
        gradient adjoint ``a_g`` through it: ``a_g^T d g_b / d theta`` (a Hessian-vector
        product, added to the weights' adjoint in ``before``) and ``a_g^T d g_b / d w``,
        returned ``(B, M)``."""
        weights, grads = self.run.gradient_graph(params, scale, batch)
        live = [(i, g) for i, g in enumerate(grads) if g is not None]
        columns = []
        for q, adjoint in enumerate(grad_adjoints):
            parts = torch.autograd.grad(
                [g for _, g in live],
                [*params, weights],
                [adjoint[i] for i, _ in live],
                retain_graph=q < len(grad_adjoints) - 1,
                materialize_grads=True,
            )
            before[q].params = [a + h for a, h in zip(before[q].params, parts[:-1], strict=True)]
            columns.append(parts[-1])
        return torch.stack(columns, dim=1)


def loss_weight_derivatives(
    model: nn.Module,
    trajectory: TrainingTrajectory,
    queries: MicroBatch | Sequence[MicroBatch],
    *,
    optimizer: AdamWSettings,
    loss_convention: str | LossConvention,
    loss_fn: LossFn | None = None,
    adam_denominator: str = "exact",
    initial_state: Mapping[str, Tensor] | None = None,
    trained_state: Mapping[str, Tensor] | None = None,
    replay_tolerance: float = 1e-4,
    state_device: torch.device | str | None = None,
    progress: bool = False,
) -> WeightDerivatives:
    """``d L_q(theta_T) / d w_z`` for every training example ``z`` and query ``q``, exact.

    The run is replayed from the initial weights; step ``t`` backpropagates
    ``J_t = sum_b c_b sum_{i in b} w_i L_i`` over its micro-batches (``c_b`` from
    ``loss_convention``, ``L_i`` example ``i``'s summed loss from ``loss_fn``), clips, and
    takes AdamW's step. ``w_z`` weighs every occurrence of example ``z`` (all epochs);
    ``L_q`` is the query's summed loss at the final weights. The derivative goes through
    every step: Hessian-vector products by double backward, Adam's ``m`` and ``v``
    differentiated, the clipping too.

    Args:
        model: the module; its trainable parameters (``requires_grad``) are the ones the
            run trained (LoRA: the adapters), the others stay as they are. Its weights are
            not changed; it runs in eval mode (no dropout: a run trained with dropout is
            replayed without it). The replay and the query gradients run on the model's
            own attention kernel, as the run did; the Hessian-vector products on
            PyTorch's math kernel (the fused kernels have no second derivative).
        trajectory: the steps, their micro-batches and learning rates.
        queries: micro-batches of query examples.
        optimizer: AdamW's hyperparameters (:meth:`AdamWSettings.from_optimizer`).
        loss_convention: how the trainer scaled each micro-batch's loss: ``"window_mean"``
            (transformers ``Trainer`` with ``num_items_in_batch``: causal LMs),
            ``"micro_batch_mean"`` (mean per micro-batch / accumulation steps), ``"sum"``,
            or a :class:`LossConvention`.
        loss_fn: ``loss_fn(model, batch) -> (B,)`` per-example summed losses; default:
            each example's summed next-token cross-entropy (labels shifted, -100 ignored).
        adam_denominator: ``"exact"`` differentiates ``sqrt(v) + eps``; ``"fixed"`` holds
            each step's value constant.
        initial_state: the trainable parameters' values before the first step, by name as
            in ``model.named_parameters()`` (other entries are ignored); default: the
            module's current values.
        trained_state: the trainable parameters' values the run ended at: at the
            replay's final weights, the per-example losses of the first and last steps'
            micro-batches must lie within ``replay_tolerance * ||L(trained) - L(start)||``
            of the trained weights' losses, else the trajectory is refused (after the
            replay, before the backward): a missing step, a wrong learning rate, loss
            convention, clipping or weight decay, or dropout in the run.
        replay_tolerance: see ``trained_state``. A transformers ``Trainer`` run in fp64
            (whose loss is taken in fp32) replays to 5e-8, an fp32 GPT-2 run to 2e-6;
            leaving out a weight decay of 0.01 misses by 1e-4, of 0.1 by 1.5e-3, a 1%
            higher learning rate by 4e-3, clipping by 0.07. Raise it for runs in bf16.
        state_device: where the replay keeps each step's state (``"cpu"`` to offload);
            default: the model's device.
        progress: progress bars over the replay's and the backward's steps.

    Returns:
        :class:`WeightDerivatives` (``(N, M)``; ``.scores()`` for the score convention).

    Cost (docs/design.md section 13.5): the replay is one training run; the backward,
    per step and micro-batch, a forward, a backward with its graph and, per query, a
    backward through that graph: for one query about 4-5x the training run's compute,
    about 2.5x more per further query.
    Memory: 4 copies of the trainable weights per step (weights, ``m``, ``v``, gradient),
    3 more per query (the adjoints), and one micro-batch's double-backward graph.
    """
    run = _Run(model, loss_fn or causal_lm_losses)
    optimizer.require_names(run.names)
    plan = _Metagradient(
        run,
        trajectory=trajectory,
        settings=optimizer,
        convention=convention_by_name(loss_convention),
        denominator=denominator_by_name(adam_denominator),
    )
    batches = [queries] if isinstance(queries, MicroBatch) else list(queries)
    if sum(b.size for b in batches) == 0:
        raise ValueError("no query example: give at least one query micro-batch")
    query_ids = torch.cat([b.example_ids.cpu().long() for b in batches])
    start = (
        [p.detach() for n, p in model.named_parameters() if p.requires_grad]
        if initial_state is None
        else _values_by_name(model, run.names, initial_state, "initial_state")
    )
    # PyTorch's fused attention kernels have no double backward; its math kernel has. The
    # replay and the query gradients are first order: they keep the run's own kernel, so
    # that the replayed steps are the run's (the kernels round differently: section 13.4).
    second_order = partial(sdpa_kernel, SDPBackend.MATH)
    with evaluating(model):
        with second_order():
            plan.require_second_derivatives(start)
        saved, final = plan.replay(start, state_device, progress)
        if trained_state is not None:
            ends = _values_by_name(model, run.names, trained_state, "trained_state")
            plan.require_reproduced(start, final, ends, replay_tolerance)
        adjoints = plan.query_adjoints(final, batches)
        dtype = torch.promote_types(final[0].dtype, torch.float32)
        out = torch.zeros(len(plan.train_ids), len(query_ids), dtype=dtype, device=run.device)
        backward = tqdm(total=len(saved), desc="metagradient: backward", disable=not progress)
        with backward, second_order():
            for index in reversed(range(len(saved))):
                adjoints = plan.step_backward(index, saved.pop(), adjoints, out)
                backward.update(1)
    return WeightDerivatives(plan.train_ids, query_ids, out.cpu())


def metagradient(
    model: nn.Module,
    trajectory: TrainingTrajectory,
    queries: MicroBatch | Sequence[MicroBatch],
    **options: Any,
) -> Scores:
    """Exact metagradient scores: ``score(z, q) = -d L_q(theta_T) / d w_z``, the
    first-order rise of query ``q``'s loss when training example ``z`` is left out of the
    run (positive = helpful, as every method's scores), keyed by example ids.

    Same arguments as :func:`loss_weight_derivatives` (``optimizer`` and
    ``loss_convention`` required), whose docstring states the convention and the cost."""
    return loss_weight_derivatives(model, trajectory, queries, **options).scores()


def _values_by_name(
    model: nn.Module, names: list[str], state: Mapping[str, Tensor], what: str
) -> list[Tensor]:
    """The trainable parameters' values in ``state``, on the model's devices and dtypes."""
    params = dict(model.named_parameters())
    missing = [n for n in names if n not in state]
    if missing:
        raise ValueError(
            f"{what} lacks trainable parameters {missing[:3]} ({len(missing)} in all): give "
            "every trainable parameter's value, by its model.named_parameters() name"
        )
    out = []
    for n in names:
        value = state[n]
        if value.shape != params[n].shape:
            raise ValueError(
                f"{what}[{n!r}] has shape {tuple(value.shape)}, the model's parameter "
                f"{tuple(params[n].shape)}"
            )
        out.append(value.detach().to(device=params[n].device, dtype=params[n].dtype))
    return out
