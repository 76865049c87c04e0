"""The training run a metagradient replays: its steps, micro-batches, AdamW settings and
the loss convention the trainer used (docs/design.md section 13).

Plain data, independent of how the run was recorded: a recorder fills these in, the
metagradient (:mod:`tda_plugins.methods.metagradient`) replays them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from tda_plugins.utils.registry import Registry


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of examples, training or query.

    Attributes:
        example_ids: ``(B,)`` int64 ids; an id names one example wherever it occurs.
        inputs: keyword inputs of the loss function, each with ``B`` rows: for a causal
            LM ``input_ids``, ``attention_mask`` and ``labels`` (``(B, T)``, ``-100``
            ignored, shifted inside the loss as transformers does).
    """

    example_ids: Tensor
    inputs: Mapping[str, Tensor]

    def __post_init__(self) -> None:
        ids = self.example_ids
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(
                f"example_ids must be a (B,) integer tensor, got {ids.dtype} {tuple(ids.shape)}"
            )
        for name, value in self.inputs.items():
            if isinstance(value, Tensor) and (value.dim() == 0 or value.shape[0] != len(ids)):
                raise ValueError(
                    f"input {name!r} has shape {tuple(value.shape)} but the micro-batch has "
                    f"{len(ids)} example ids: give one id per row"
                )

    @property
    def size(self) -> int:
        return len(self.example_ids)


@dataclass(frozen=True)
class TrainingStep:
    """One optimizer step: the micro-batches whose gradients it accumulated, and the
    learning rate the scheduler gave it."""

    micro_batches: Sequence[MicroBatch]
    lr: float

    def __post_init__(self) -> None:
        if not self.micro_batches:
            raise ValueError("a training step needs at least one micro-batch")
        if not (self.lr >= 0 and self.lr < float("inf")):
            raise ValueError(f"a step's learning rate must be finite and >= 0, got {self.lr}")


@dataclass(frozen=True)
class TrainingTrajectory:
    """The run, step by step, from the initial weights to the final ones."""

    steps: Sequence[TrainingStep]

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("the trajectory has no step: record at least one optimizer step")

    def example_ids(self) -> Tensor:
        """``(N,)`` the distinct training example ids, ascending."""
        ids = [mb.example_ids.cpu() for step in self.steps for mb in step.micro_batches]
        return torch.unique(torch.cat(ids).long())


@dataclass(frozen=True, kw_only=True)
class AdamWSettings:
    """The hyperparameters of ``torch.optim.AdamW`` (``amsgrad=False``, ``maximize=False``)
    the run used, apart from the per-step learning rate.

    Attributes:
        weight_decay: decoupled decay: one value for every trainable parameter, or a value
            per parameter name (``model.named_parameters()``; names not listed get 0, as
            the biases and norms of transformers' ``Trainer``).
        max_grad_norm: the trainer's gradient clipping (``clip_grad_norm_`` of the
            accumulated gradient over all trainable parameters), ``None`` for none; 0 or
            less is none too, as transformers' ``Trainer`` takes it (kept as ``None``).
            transformers' ``TrainingArguments`` clips at 1.0 by default.
        betas, eps: as ``torch.optim.AdamW``.
    """

    weight_decay: float | Mapping[str, float]
    max_grad_norm: float | None
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            object.__setattr__(self, "max_grad_norm", None)

    def decay_of(self, name: str) -> float:
        if isinstance(self.weight_decay, Mapping):
            return float(self.weight_decay.get(name, 0.0))
        return float(self.weight_decay)

    def require_names(self, trainable: Sequence[str]) -> None:
        """Refuse per-parameter decays naming no trainable parameter (a typo would
        silently drop a decay)."""
        if isinstance(self.weight_decay, Mapping):
            unknown = sorted(set(self.weight_decay) - set(trainable))
            if unknown:
                raise ValueError(
                    f"weight_decay names {unknown[:3]} that are not trainable parameters of the "
                    f"model (trainable: {list(trainable)[:3]}...): use model.named_parameters() "
                    "names"
                )

    @classmethod
    def from_optimizer(
        cls, optimizer: torch.optim.Optimizer, model: nn.Module, *, max_grad_norm: float | None
    ) -> AdamWSettings:
        """The settings of a ``torch.optim.AdamW`` over ``model``'s parameters (its param
        groups' decays by parameter name); every group must share betas, eps and its
        learning rate (the replay takes one per step; a scheduler's groups are compared by
        their ``initial_lr``). accelerate's wrapper (a ``Trainer``'s
        ``trainer.optimizer``) is unwrapped."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if type(optimizer) is not torch.optim.AdamW:
            raise ValueError(
                f"the metagradient replays torch.optim.AdamW, got {type(optimizer).__name__} "
                "(torch.optim.Adam's weight_decay is an L2 term, not AdamW's decay)"
            )
        names = {id(p): n for n, p in model.named_parameters()}
        groups = optimizer.param_groups
        shared = {(tuple(g["betas"]), g["eps"], g["amsgrad"], g["maximize"]) for g in groups}
        if len(shared) != 1 or any(g["amsgrad"] or g["maximize"] for g in groups):
            raise ValueError(
                "the optimizer's groups must share betas and eps, without amsgrad or maximize; "
                f"got {sorted(shared, key=str)}"
            )
        rates = sorted({float(g.get("initial_lr", g["lr"])) for g in groups})
        if len(rates) != 1:
            raise ValueError(
                f"the optimizer's groups train at different learning rates {rates}, but the "
                "replay takes one per step (TrainingStep.learning_rate): give every group "
                "the same rate"
            )
        decay = {names[id(p)]: float(g["weight_decay"]) for g in groups for p in g["params"]}
        betas = tuple(groups[0]["betas"])
        return cls(
            weight_decay=decay,
            max_grad_norm=max_grad_norm,
            betas=(float(betas[0]), float(betas[1])),
            eps=float(groups[0]["eps"]),
        )


class LossConvention(ABC):
    """How the trainer scaled each micro-batch's loss: step ``t`` backpropagates

        J_t = sum_b c_b sum_{i in b} w_i L_i

    with ``L_i`` example ``i``'s summed token loss, ``c_b`` the scale of micro-batch ``b``
    (:meth:`scales`, fixed by the run, not a function of ``w``) and ``w_i = 1`` in the
    real run."""

    name: ClassVar[str]

    @abstractmethod
    def scales(self, step: TrainingStep) -> list[float]:
        """``c_b`` for each micro-batch of ``step``."""


LOSS_CONVENTIONS: Registry[LossConvention] = Registry("loss convention")


@LOSS_CONVENTIONS.register("sum")
class SummedLoss(LossConvention):
    """``c_b = 1``: the summed token loss of every example, unnormalized."""

    def scales(self, step: TrainingStep) -> list[float]:
        return [1.0] * len(step.micro_batches)


@LOSS_CONVENTIONS.register("micro_batch_mean")
class MicroBatchMean(LossConvention):
    """``c_b = 1 / (A N_b)``: the mean token loss of each micro-batch (``N_b`` its label
    tokens after the causal shift), divided by the ``A`` accumulation steps; transformers'
    ``Trainer`` for a model that takes no ``num_items_in_batch``."""

    def scales(self, step: TrainingStep) -> list[float]:
        count = len(step.micro_batches)
        return [1.0 / (count * label_tokens(mb)) for mb in step.micro_batches]


@LOSS_CONVENTIONS.register("window_mean")
class WindowMean(LossConvention):
    """``c_b = 1 / sum_b N_b``: the summed token loss of the whole accumulation window over
    its label-token count; transformers' ``Trainer`` (``num_items_in_batch``) for causal
    LMs, which take it, in one process."""

    def scales(self, step: TrainingStep) -> list[float]:
        total = sum(label_tokens(mb) for mb in step.micro_batches)
        return [1.0 / total] * len(step.micro_batches)


def label_tokens(batch: MicroBatch) -> int:
    """Label tokens a causal LM predicts in ``batch``: ``labels[..., 1:] != -100``."""
    labels = batch.inputs.get("labels")
    if not isinstance(labels, Tensor):
        raise ValueError(
            "a mean loss convention counts label tokens, but a micro-batch has no 'labels': "
            "use loss_convention='sum' or a LossConvention of your own"
        )
    count = int((labels[..., 1:] != -100).sum())
    if count == 0:
        raise ValueError(
            f"micro-batch with ids {batch.example_ids.tolist()[:5]} has no label token: the "
            "trainer's mean loss is undefined there; leave it out of the trajectory"
        )
    return count


def convention_by_name(convention: str | LossConvention) -> LossConvention:
    """A registered convention by name, or the given instance."""
    if isinstance(convention, LossConvention):
        return convention
    return LOSS_CONVENTIONS.create(convention)
