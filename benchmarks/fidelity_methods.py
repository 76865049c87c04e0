"""The attributor interface of the fidelity benchmark, and our methods behind it.

An **attributor** gets a :class:`FidelityTask` (how to build the model, the trained
weights and optimizer state, the training and validation blocks, and the training run
itself as a :class:`TrainingRun`) and returns a ``(M, N)`` score matrix: validation block
``v`` against training block ``j``, in dataset order (the benchmark reads the removed
blocks' columns for leave-one-out and all of them for LDS). Sign convention: a positive
score says that ``j`` helps ``v``, i.e. predicts that removing ``j`` *raises* ``v``'s loss
(a positive leave-one-out effect ``loss_v(without j) - loss_v(full)``).

Attributors are registered by name (:func:`register_attributor`); peer-library adapters
register theirs the same way and are measured by the same code. Ours use the library as
a user would: stores captured at the trained weights (``graddot``, ``gradcos``, ``kfac``,
``ekfac``, ``less``; ``logra`` on a factor-projected store) scored with
``method_by_name``, and ``tracin`` from the training run itself (the engine attached to a
replay of it, :class:`~tda_plugins.influence.InfluenceLogger` summing each example's
learning-rate-weighted dot with the validation gradients at the weights of its step).

**Trajectory methods** (methods that need the training run, not only its end) read
``task.run``: the initial weights, each step's rows (indices into ``task.train``; their
library example ids are ``content_hash(task.train[rows])``), the AdamW settings and a
replay that calls a hook at every step. Two rows are meant to come this way:

* AdamW influence from a store recorded during training: attach the capture engine to
  ``task.run.replay`` (as ``tracin`` does), record each step's per-example gradients with
  that step's optimizer state, then score from that store;
* the exact metagradient (the ceiling reference): ``d L_val(v) / d w_z`` at ``w = 1``,
  where step ``s`` minimises ``task.step_loss(model, s, weights=w[rows_s])`` from
  ``task.run.initial_state`` with AdamW (``task.run.adamw``, fresh state), unrolled in
  reverse mode through all ``len(task.run.batches)`` steps. Its ``(M, N)`` scores are
  ``-d L_val(v) / d w_z``: removing ``z`` is ``w_z: 1 -> 0``, so the first-order change
  of the validation loss is ``-d L_val / d w_z``, and "raises the loss" is positive.

Each is one function ``(FidelityTask) -> Tensor`` under :func:`register_attributor`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from attribution import capture_store, micro_batches
from fidelity_training import AdamWSettings, StepHook
from torch import Tensor, nn

from tda_plugins import (
    CaptureEngine,
    LayerSelection,
    ProjectionConfig,
    causal_lm_example_losses,
    cross_gram,
)
from tda_plugins.api import capture_batch
from tda_plugins.capture.identity import content_hash
from tda_plugins.influence import InfluenceLogger
from tda_plugins.integrations.transformers.normalization import CausalLMNormalization
from tda_plugins.methods import Scores, method_by_name
from tda_plugins.store import StoreReader


class Replay(Protocol):
    """``replay(model, hook, after_update=..., optimizer=...)``: rerun the training run on
    ``model`` (fresh, holding the initial weights), calling ``hook(step, model)`` after
    each backward and ``after_update(step, model)`` after each optimizer step, with
    ``optimizer`` (a fresh AdamW of the run's settings over ``model``; default: its own);
    returns the trained optimizer."""

    def __call__(
        self,
        model: nn.Module,
        hook: StepHook | None,
        /,
        *,
        after_update: StepHook | None = None,
        optimizer: torch.optim.AdamW | None = None,
    ) -> torch.optim.Optimizer: ...


#: The layers our methods attribute with: GPT-2's Conv1D layers (``lm_head`` is tied to
#: ``wte`` and left out, as are the embeddings and norms).
LAYERS = LayerSelection(kind="linear")
#: Every layer K-FAC/EK-FAC support: the Conv1D layers, the token and position
#: embeddings, the norm scales and the tied head (its uses of ``wte`` counted once).
ALL_LAYERS = LayerSelection(kind="all")
#: LoGra's factor projection.
LOGRA_PROJECTION = ProjectionConfig(kind="factor", k_a=32, k_g=32)


@dataclass(frozen=True)
class TrainingRun:
    """The reference training run, for methods that need more than its end.

    Attributes:
        initial_state: the weights before the first step (the seeded random init, or the
            pre-trained weights of the pre-trained replica).
        batches: per optimizer step ``s``, the ``(B_s,)`` int64 indices into
            :attr:`FidelityTask.train` of its rows, in the order fed (the last batch may
            be short).
        adamw: the optimizer's settings; its state is fresh at the first step (constant
            learning rate, no schedule, no gradient clipping).
        replay: reruns the run exactly on a fresh model from ``initial_state``, calling
            ``hook(step, model)`` after each backward, before the update; it ends on
            :attr:`FidelityTask.state` bit for bit.

    Step ``s``'s loss is transformers' causal-LM loss of its rows, the mean over every
    predicted token of the batch: ``sum_{z in B_s} L_z / (|B_s| (T - 1))``, ``L_z`` the
    summed token loss of block ``z`` (:meth:`FidelityTask.step_loss`).
    """

    initial_state: dict[str, Tensor]
    batches: tuple[Tensor, ...]
    adamw: AdamWSettings
    replay: Replay


@dataclass(frozen=True)
class FidelityTask:
    """Everything an attributor may use.

    Attributes:
        model_factory: a fresh model holding the run's initial weights (fp32).
        state: the trained weights (``model.state_dict()`` after the epoch).
        optimizer_state: the AdamW ``state_dict()`` after the epoch.
        batch: examples per optimizer step.
        train: ``(N, T)`` int64 training blocks (byte ids), in dataset order.
        validation: ``(M, T)`` int64 validation blocks.
        run: the training run (initial weights, batches, AdamW settings, replay).
        work: a scratch directory for this attributor (stores and the like).

    Training loss: transformers' causal-LM loss, the mean over every predicted token of
    the batch. Validation loss of a block: the mean over its ``T - 1`` predicted tokens.
    """

    model_factory: Callable[[], nn.Module]
    state: dict[str, Tensor]
    optimizer_state: dict[str, Any]
    batch: int
    train: Tensor
    validation: Tensor
    run: TrainingRun
    work: Path

    def trained_model(self) -> nn.Module:
        """A fresh model holding the trained weights."""
        model = self.model_factory()
        model.load_state_dict(self.state)
        return model

    def trained_optimizer(self, model: nn.Module) -> torch.optim.AdamW:
        """AdamW over ``model``'s parameters with the trained optimizer state."""
        optimizer = self.run.adamw.optimizer(model)
        optimizer.load_state_dict(self.optimizer_state)
        return optimizer

    def step_loss(self, model: nn.Module, step: int, weights: Tensor | None = None) -> Tensor:
        """Scalar training loss of step ``step`` on ``model``, each row weighted:
        ``sum_z w_z L_z / (B_s (T - 1))`` over the step's ``B_s`` rows ``z`` (in
        ``run.batches[step]``'s order), ``L_z`` the row's summed token loss, ``weights``
        ``(B_s,)`` (default ones: the run's own loss, up to fp32 rounding).

        A weight of 0 drops the row's term but keeps the denominator; leave-one-out's
        retrain divides by ``(B_s - 1) (T - 1)`` instead (its batch is one row smaller),
        a rescale of that one step's gradient.
        """
        ids = self.train[self.run.batches[step]]
        losses = causal_lm_example_losses(model(input_ids=ids).logits, ids)
        weighted = losses.sum() if weights is None else (weights.to(losses) * losses).sum()
        return weighted / (ids.shape[0] * (ids.shape[1] - 1))

    def select(self, scores: Scores) -> Tensor:
        """``(M, N)`` from library :class:`Scores` keyed by content hash: the rows of the
        training blocks in dataset order, the columns of the validation blocks, transposed."""
        rows = positions(scores.train_ids, content_hash(self.train))
        cols = positions(scores.query_ids, content_hash(self.validation))
        return scores.values[rows][:, cols].T.double()


def positions(ids: Tensor, wanted: Tensor) -> Tensor:
    """``(K,)`` index of each of ``wanted``'s ids in ``ids``; an error when one is missing."""
    where = {int(x): i for i, x in enumerate(ids.tolist())}
    missing = [int(x) for x in wanted.tolist() if int(x) not in where]
    if missing:
        raise KeyError(f"{len(missing)} wanted example ids are not in the scores")
    return torch.tensor([where[int(x)] for x in wanted.tolist()])


#: ``attributor(task) -> (M, N)`` scores.
Attributor = Callable[[FidelityTask], Tensor]
ATTRIBUTORS: dict[str, Attributor] = {}


def register_attributor(name: str) -> Callable[[Attributor], Attributor]:
    """Decorator: make ``attributor`` available to the benchmark under ``name``."""

    def register(attributor: Attributor) -> Attributor:
        if name in ATTRIBUTORS:
            raise ValueError(f"an attributor named {name!r} is already registered")
        ATTRIBUTORS[name] = attributor
        return attributor

    return register


# -- ours: stores at the trained weights ------------------------------------------------


def trained_stores(
    task: FidelityTask,
    projection: ProjectionConfig | None,
    curvature: bool,
    layers: LayerSelection = LAYERS,
) -> tuple[StoreReader, StoreReader]:
    """Training store (with the AdamW moments, and inline K-FAC statistics with
    ``curvature``) and validation store captured at the trained weights from ``layers``,
    each example's own summed token loss; written once per task, projection, layers and
    ``curvature`` under ``task.work``."""
    kind = ("projected" if projection is not None else "full") + ("-kfac" if curvature else "")
    root = task.work / f"{kind}-{layers.kind}"
    if not root.exists():
        model = task.trained_model()
        optimizer = task.trained_optimizer(model)
        capture_store(
            model,
            micro_batches(task.train, task.batch),
            root / "train",
            projection,
            curvature=curvature,
            optimizer=optimizer,
            layers=layers,
        )
        capture_store(
            model,
            micro_batches(task.validation, task.batch),
            root / "val",
            projection,
            False,
            layers=layers,
        )
    return StoreReader(root / "train"), StoreReader(root / "val")


def store_method(
    method: str,
    projection: ProjectionConfig | None,
    task: FidelityTask,
    layers: LayerSelection = LAYERS,
    **options: Any,
) -> Tensor:
    """``(M, N)`` scores of a registered library method (``options``: its constructor's,
    such as ``damping``, ``exclude_params``, ``normalize_layers``) on stores captured at
    the trained weights from ``layers`` (with the K-FAC statistics only where the
    method's preconditioner needs them)."""
    attributor = method_by_name(method, **options)
    curvature = attributor.preconditioner.needs_curvature
    store, queries = trained_stores(task, projection, curvature, layers)
    return task.select(attributor.score(store, queries))


def per_layer_scores(task: FidelityTask, method: str) -> dict[str, Tensor]:
    """Layer name -> ``(M, N)`` scores of a registered library method from that layer
    alone (the method fitted on every layer, as in its full score; no cosine)."""
    attributor = method_by_name(method)
    store, queries = trained_stores(task, None, curvature=True)
    attributor.prepare(store, queries)
    train, query = store.load_all(), queries.load_all()
    out = {}
    for name in store.layer_names:
        values = cross_gram(
            attributor.train_side(name, train.layers[name]),
            attributor.query_side(name, query.layers[name]),
        )
        out[name] = task.select(Scores(train.example_ids, query.example_ids, values, method))
    return out


for _name in ("graddot", "gradcos", "kfac", "ekfac", "less"):
    register_attributor(_name)(partial(store_method, _name, None))
register_attributor("logra")(partial(store_method, "logra", LOGRA_PROJECTION))
for _name in ("kfac", "ekfac"):
    register_attributor(f"{_name}:all-layers")(
        partial(store_method, _name, None, layers=ALL_LAYERS)
    )
register_attributor("graddot:no-bias")(
    partial(store_method, "graddot", None, exclude_params=("bias",))
)
register_attributor("graddot:layer-norm")(
    partial(store_method, "graddot", None, normalize_layers=True)
)


# -- ours: TracIn from the training run -------------------------------------------------


def tracin(task: FidelityTask, **groups: Any) -> Tensor:
    """``sum_s lr <g_v(theta_s), g_j(theta_s)>`` over the step ``s`` that trained ``j``
    (``groups``: ``InfluenceLogger``'s ``exclude_params`` / ``normalize_layers``).

    The engine is attached to a replay of the training run; at each step, after the
    backward and before the update, the validation gradients are taken at the step's
    weights (``capture_batch``, which leaves the training ``.grad`` untouched) and the
    step's captured examples are scored against them (per-example summed token loss,
    converted from the training run's mean loss by ``CausalLMNormalization``).
    """
    logger = InfluenceLogger("graddot", **groups)
    model = task.model_factory()
    val = {"input_ids": task.validation, "labels": task.validation}

    with CaptureEngine(model, LAYERS, None, [logger], CausalLMNormalization()) as engine:

        def before_update(step: int, model: nn.Module) -> None:
            lr = task.run.adamw.learning_rate
            logger.set_queries(capture_batch(model, val, layers=LAYERS), lr)
            engine.optimizer_step()

        task.run.replay(model, before_update)
        engine.end()
    require_reference(task, model)
    return task.select(logger.cumulative_scores(content_hash(task.validation)))


register_attributor("tracin")(tracin)
register_attributor("tracin:no-bias")(partial(tracin, exclude_params=("bias",)))


def require_reference(task: FidelityTask, model: nn.Module) -> None:
    """Refuse a captured replay that did not end on the reference weights bit for bit
    (the capture would have changed the training run it attributes)."""
    trained = model.state_dict()
    drift = max(float((trained[k] - v).abs().max()) for k, v in task.state.items())
    if drift != 0.0:
        raise RuntimeError(
            f"the captured replay ended {drift:.3g} away from the reference weights: capture "
            "changed the training run"
        )
