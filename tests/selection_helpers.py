"""References for online data selection: what ``.grad`` must be after a step's selection.

* :func:`fresh_kept_gradient`: one backward over the kept examples alone, in their own
  micro-batches, of ``sum of their summed token losses / their label tokens`` (the
  normalization of a trainer that divides by ``num_items_in_batch``), without the engine.
* :func:`clipped`: that gradient after ``clip_grad_norm_``'s rule.
* :func:`oracle_kept`: what ``step_cosine`` keeps, by brute force on per-example gradients
  computed one example at a time (:func:`greedy_by_hand`).
* :class:`SelectionAudit`: a ``TrainerCallback`` placed after ``DataSelectionCallback``
  that keeps, per optimizer step, the weights, the micro-batches the model trained on,
  the ``num_items_in_batch`` it was told and every ``.grad`` the optimizer is about to use.
* :func:`assert_trainer_grads_match_fresh`: that audit against the fresh backward over
  the examples the selection kept, clipped.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import TrainerCallback

from tda_plugins import causal_lm_example_losses
from tda_plugins.capture import content_hash
from tests.oracle import loop_oracle, max_rel_error

#: Tolerance of an fp64 ``.grad`` against the fresh backward over the kept examples.
FP64_TOL = 1e-6
#: Right-padded lengths of the 8 examples of a step (length 10).
LENGTHS = (10, 7, 9, 5, 10, 8, 6, 10)

Batch = Mapping[str, Tensor]

#: The selection settings the mechanism tests were written for, pinned so that they do not
#: follow the library's defaults: a fixed share dropped by the lowest dot with the target,
#: recomputed at every step.
PINNED: dict[str, Any] = {"rule": "bottom_fraction", "score": "dot", "refresh_every": 1}


def label_counts(batch: Batch) -> Tensor:
    """``(B,)`` tokens each example's causal-LM loss sums over: shifted labels != -100, or
    the batch's ``shift_labels`` != -100 where a collator gave them."""
    if "shift_labels" in batch:
        return (batch["shift_labels"] != -100).sum(dim=1)
    return (batch["labels"][:, 1:] != -100).sum(dim=1)


def example_losses(model: nn.Module, batch: Batch) -> Tensor:
    """``(B,)`` each example's summed next-token loss. ``labels`` go into the model call
    too, as a trainer passes them (the selection counts loss tokens from them). With
    ``shift_labels`` (position ``t`` predicts ``shift_labels[:, t]``) the loss is taken
    against them, as transformers' loss does."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
    logits = model(**inputs).logits
    if "shift_labels" not in batch:
        return causal_lm_example_losses(logits, batch["labels"])
    targets = batch["shift_labels"]
    per_token = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2).double(), targets, ignore_index=-100, reduction="none"
    )
    return per_token.sum(dim=1)


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters by name (a tied weight once, under its first name)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def current_grads(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every trainable parameter's ``.grad`` (zeros where it is ``None``)."""
    return {
        n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for n, p in trainable(model).items()
    }


def fresh_kept_gradient(
    model: nn.Module,
    micro_batches: Sequence[Batch],
    keep: Sequence[Tensor],
    backprop_tokens: float | None = None,
) -> dict[str, Tensor]:
    """Gradient of ``sum_{kept i} L_i / N_kept`` for every trainable parameter.

    ``L_i`` is example ``i``'s summed token loss and ``N_kept`` the kept examples' label
    tokens. Each micro-batch is forwarded with its dropped rows removed (``keep[j]`` is
    the ``(B_j,)`` bool mask of micro-batch ``j``); the engine and ``.grad`` are untouched.

    ``backprop_tokens``: backpropagate ``sum_{kept} L_i / backprop_tokens`` (what the
    trainer's own backward divided by) and rescale by ``backprop_tokens / N_kept`` in
    fp64 afterwards. The same gradient, but rounded as the trainer's backward was: the
    Llama RMSNorm computes in fp32 even in an fp64 model, so there a different loss scale
    alone moves the gradient by ~1e-7 relative.
    """
    params = trainable(model)
    total = torch.zeros((), dtype=torch.float64)
    tokens = 0
    for batch, kept in zip(micro_batches, keep, strict=True):
        if not bool(kept.any()):
            continue
        rows = {k: v[kept] for k, v in batch.items()}
        total = total + example_losses(model, rows).sum()
        tokens += int(label_counts(rows).sum())
    assert tokens > 0, "the kept examples have no label tokens"
    divisor = tokens if backprop_tokens is None else backprop_tokens
    grads = torch.autograd.grad(total / divisor, list(params.values()), allow_unused=True)
    rescale = divisor / tokens
    return {
        n: torch.zeros_like(p) if g is None else g * rescale
        for (n, p), g in zip(params.items(), grads, strict=True)
    }


def adam_step_metric(optimizer: torch.optim.Optimizer, param: Tensor, grad: Tensor) -> Tensor:
    """Adam's ``1 / (sqrt(v_hat) + eps)`` in the step it takes from ``param``'s state with
    ``grad``: read from torch's own Adam stepping a copy of the parameter and its state
    (no state: the first step)."""
    group = optimizer.param_groups[0]
    shadow = param.detach().clone().requires_grad_(True)
    stepper = torch.optim.Adam([shadow], lr=group["lr"], betas=group["betas"], eps=group["eps"])
    if param in optimizer.state:
        stepper.state[shadow] = copy.deepcopy(optimizer.state[param])
    shadow.grad = grad.detach().clone().to(shadow.dtype)
    stepper.step()
    state = stepper.state[shadow]
    v_hat = state["exp_avg_sq"] / (1 - group["betas"][1] ** float(state["step"]))
    return 1.0 / (v_hat.sqrt() + group["eps"])


def greedy_by_hand(vectors: Tensor, target: Tensor, margin: float) -> Tensor:
    """``(N,)`` kept mask: from all examples, remove the one whose removal gives the
    highest ``cos(sum of the rest, target)`` while that beats the current cosine by more
    than ``margin`` times its size."""
    kept = list(range(vectors.shape[0]))

    def cosine(rows: list[int]) -> float:
        step = vectors[rows].sum(0)
        return float(step @ target / (step.norm() * target.norm()))

    current = cosine(kept)
    while len(kept) > 1:
        value, worst = max((cosine([j for j in kept if j != i]), i) for i in kept)
        if value <= current + max(margin, 1e-9) * abs(current):
            break
        kept.remove(worst)
        current = value
    return torch.tensor([i in kept for i in range(vectors.shape[0])])


def oracle_kept(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    window: Batch,
    target: Batch,
    margin: float,
) -> Tensor:
    """``step_cosine``'s kept set by :func:`greedy_by_hand` on the oracle's per-example
    gradients over every trainable parameter, in Adam's metric ``P`` when there is an
    optimizer (``<g_i, P T>``, ``<g_i, P g_j>``: the vectors scaled by ``sqrt(P)``)."""
    names = list(trainable(model))
    per_example = loop_oracle(model, window, names)
    target_grad = {n: g.sum(0) for n, g in loop_oracle(model, target, names).items()}
    scale = {}
    for name in names:
        if optimizer is None:
            scale[name] = torch.ones_like(target_grad[name])
            continue
        grad = per_example[name].sum(0) / label_counts(window).sum()
        scale[name] = adam_step_metric(optimizer, model.get_parameter(name), grad).sqrt()
    vectors = torch.cat([(per_example[n] * scale[n]).flatten(1) for n in names], dim=1)
    direction = torch.cat([(target_grad[n] * scale[n]).flatten() for n in names])
    return greedy_by_hand(vectors, direction, margin)


def global_norm(grads: Mapping[str, Tensor]) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


def clipped(grads: Mapping[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    """``grads`` scaled as ``torch.nn.utils.clip_grad_norm_`` scales them (``max_norm``
    0: not clipped, as the trainers take it)."""
    if max_norm <= 0:
        return dict(grads)
    coefficient = min(1.0, max_norm / (global_norm(grads) + 1e-6))
    return {n: g * coefficient for n, g in grads.items()}


# -- auditing a real Trainer run ------------------------------------------------------------


@dataclass
class StepAudit:
    """One optimizer step as the trainer ran it."""

    weights: dict[str, Tensor] = field(default_factory=dict)
    micro_batches: list[dict[str, Tensor]] = field(default_factory=list)
    #: Per micro-batch: the ``num_items_in_batch`` the model was called with (nan: none).
    num_items: list[float] = field(default_factory=list)
    #: Per micro-batch: loss tokens TRL's fused head counted (``label_mask``; -1: none).
    label_mask_tokens: list[int] = field(default_factory=list)
    grads: dict[str, Tensor] = field(default_factory=dict)


class SelectionAudit(TrainerCallback):
    """Records each step's weights (``on_step_begin``), training micro-batches (a forward
    hook; evaluation-mode forwards such as the target's are not training data) and
    ``.grad`` at ``on_pre_optimizer_step``. Put it after ``DataSelectionCallback``, so
    that ``.grad`` is the one the optimizer steps with."""

    def __init__(self) -> None:
        self.steps: dict[int, StepAudit] = {}
        self._step = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        kwargs["model"].register_forward_hook(self._record_batch, with_kwargs=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step = state.global_step
        weights = {k: v.detach().clone() for k, v in kwargs["model"].state_dict().items()}
        self.steps[self._step] = StepAudit(weights)

    def _record_batch(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        audit = self.steps[self._step]
        keys = ("input_ids", "attention_mask", "labels", "shift_labels")
        audit.micro_batches.append({k: kwargs[k].detach().clone() for k in keys if k in kwargs})
        count = kwargs.get("num_items_in_batch")
        audit.num_items.append(float("nan") if count is None else float(count))
        label_mask = getattr(output, "label_mask", None)
        audit.label_mask_tokens.append(-1 if label_mask is None else int(label_mask.sum()))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps[state.global_step].grads = current_grads(kwargs["model"])

    def save(self, directory: Path) -> None:
        """Write every step to ``directory`` (safetensors and JSON), for another process."""
        directory.mkdir(parents=True, exist_ok=True)
        for step, audit in self.steps.items():
            tensors = {f"weights/{k}": v.contiguous() for k, v in audit.weights.items()}
            tensors.update({f"grads/{k}": v.contiguous() for k, v in audit.grads.items()})
            for j, batch in enumerate(audit.micro_batches):
                tensors.update({f"batch{j}/{k}": v.contiguous() for k, v in batch.items()})
            save_file(tensors, str(directory / f"step{step}.safetensors"))
            meta = {
                "micro_batches": len(audit.micro_batches),
                "num_items": audit.num_items,
                "label_mask_tokens": audit.label_mask_tokens,
            }
            (directory / f"step{step}.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, directory: Path) -> SelectionAudit:
        """What :meth:`save` wrote."""
        audit = cls()
        for meta_path in sorted(directory.glob("step*.json")):
            step = int(meta_path.stem.removeprefix("step"))
            meta = json.loads(meta_path.read_text())
            tensors = load_file(str(directory / f"step{step}.safetensors"))

            def part(prefix: str, tensors: dict[str, Tensor] = tensors) -> dict[str, Tensor]:
                return {
                    k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)
                }

            batches = [part(f"batch{j}/") for j in range(meta["micro_batches"])]
            audit.steps[step] = StepAudit(
                part("weights/"),
                batches,
                meta["num_items"],
                meta["label_mask_tokens"],
                part("grads/"),
            )
        return audit


def kept_masks(micro_batches: Sequence[Batch], dropped_ids: set[int]) -> list[Tensor]:
    """Per micro-batch, ``(B,)`` true at the examples (content-hash ids) not dropped."""
    masks = []
    for batch in micro_batches:
        ids = content_hash(batch["input_ids"], batch["attention_mask"]).tolist()
        masks.append(torch.tensor([i not in dropped_ids for i in ids]))
    return masks


@dataclass
class TrainerCheck:
    """What :func:`assert_trainer_grads_match_fresh` compared."""

    steps: int
    worst: float
    fresh_norms: list[float]


def assert_trainer_grads_match_fresh(
    steps: Mapping[int, StepAudit],
    dropped_per_step: Mapping[int, set[int]],
    build_model: Callable[[], nn.Module],
    max_norm: float,
    tol: float,
) -> TrainerCheck:
    """Every step's ``.grad`` equals ``clip(fresh_kept_gradient)`` within ``tol`` (relative,
    per parameter), the fresh gradient taken in a ``build_model()`` (fp64) at the step's
    weights over the micro-batches of all ranks (``steps``) minus the dropped examples."""
    worst, norms = 0.0, []
    assert steps, "no optimizer step was audited"
    for step, audit in sorted(steps.items()):
        model = build_model()
        model.load_state_dict(audit.weights)
        keep = kept_masks(audit.micro_batches, dropped_per_step[step])
        fresh = fresh_kept_gradient(model, audit.micro_batches, keep)
        norms.append(global_norm(fresh))
        error = max_rel_error(audit.grads, clipped(fresh, max_norm))
        assert error <= tol, f"step {step}: .grad is {error:.2e} away from the fresh backward"
        worst = max(worst, error)
    return TrainerCheck(len(steps), worst, norms)
