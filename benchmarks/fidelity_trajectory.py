"""Trajectory-aware rows of the fidelity benchmark: AdamW influence from a store recorded
during the training run, and the exact metagradient (the ceiling reference).

* ``adamw_influence`` / ``adamw_own_step``: the capture session (``record_trajectory``)
  attached to a replay of the training run (``task.run.replay``; the replay must end on
  the reference weights bit for bit), so the store holds each step's per-example
  gradients with that step's AdamW state; the queries are captured at the final weights.
* ``metagradient`` / ``metagradient:fixed-denominator``: ``tda_plugins.metagradient``
  on the run rebuilt from ``task.run`` (initial weights, each step's rows, AdamW
  settings). The run's loss is transformers' mean token loss of each step's one batch:
  the ``micro_batch_mean`` convention with one micro-batch per step; the trained weights
  are passed as ``trained_state``, so a replay that does not end on them is refused (the
  row is then listed as one that could not run, with the library's reason).
  Its cost grows with the queries (about 2.5 training runs each), so it is measured on
  :data:`META_QUERIES` validation blocks drawn with a fixed seed; the other blocks' rows
  are NaN, and the metric leaves them out (the paired comparisons use the same blocks).
"""

from __future__ import annotations

from functools import partial

import torch
from attribution import capture_store, micro_batches
from fidelity_methods import (
    LAYERS,
    FidelityTask,
    positions,
    register_attributor,
    require_reference,
)
from peers.base import Unsupported
from torch import Tensor, nn

from tda_plugins.capture.identity import content_hash
from tda_plugins.integrations.transformers.normalization import CausalLMNormalization
from tda_plugins.methods import MicroBatch, TrainingStep, TrainingTrajectory, method_by_name
from tda_plugins.methods import training_run as replayed
from tda_plugins.methods.metagradient import loss_weight_derivatives
from tda_plugins.session import CaptureSession, CaptureSettings
from tda_plugins.store import StoreReader

#: Validation blocks the metagradient is measured on (its cost is per query).
META_QUERIES = 16
#: Seed of their draw.
META_SEED = 0
#: Queries per micro-batch of the metagradient's final-weights pass.
META_QUERY_BATCH = 8


def recorded_stores(task: FidelityTask) -> tuple[StoreReader, StoreReader]:
    """Training store recorded during a replay of the run (per-step gradients of the
    Conv1D layers, each example's own summed token loss, and the AdamW trajectory) and
    validation store at the final weights; written once under ``task.work``."""
    root = task.work / "trajectory"
    if not root.exists():
        model = task.model_factory()
        optimizer = task.run.adamw.optimizer(model)
        settings = CaptureSettings(
            store_dir=str(root / "train"),
            layers=LAYERS.kind,
            curvature=False,
            store_texts=False,
            save_optimizer_state=False,
            record_trajectory=True,
        )
        session = CaptureSession(settings, model, CausalLMNormalization(), optimizer=optimizer)

        def before_update(step: int, model: nn.Module) -> None:
            session.step()

        def after_update(step: int, model: nn.Module) -> None:
            session.after_optimizer_step()
            session.finish_step()

        task.run.replay(model, before_update, after_update=after_update, optimizer=optimizer)
        session.end(optimizer)
        require_reference(task, model)
        capture_store(model, micro_batches(task.validation, task.batch), root / "val", None, False)
    return StoreReader(root / "train"), StoreReader(root / "val")


def trajectory_method(method: str, task: FidelityTask) -> Tensor:
    """``(M, N)`` scores of a registered trajectory method on :func:`recorded_stores`."""
    store, queries = recorded_stores(task)
    return task.select(method_by_name(method).score(store, queries))


for _name in ("adamw_influence", "adamw_own_step"):
    register_attributor(_name)(partial(trajectory_method, _name))


def rebuilt_trajectory(task: FidelityTask) -> TrainingTrajectory:
    """The run as the metagradient replays it: per step its one micro-batch (the rows in
    the order fed, ids by content hash, labels = inputs) and the constant learning rate."""
    steps = []
    for rows in task.run.batches:
        ids = task.train[rows]
        batch = MicroBatch(content_hash(ids), {"input_ids": ids, "labels": ids})
        steps.append(TrainingStep([batch], task.run.adamw.learning_rate))
    return TrainingTrajectory(steps)


def meta_queries(task: FidelityTask) -> Tensor:
    """``(Q,)`` sorted indices of the validation blocks the metagradient is measured on."""
    count = task.validation.shape[0]
    gen = torch.Generator().manual_seed(META_SEED)
    return torch.randperm(count, generator=gen)[: min(META_QUERIES, count)].sort().values


def metagradient_scores(task: FidelityTask, denominator: str = "exact") -> Tensor:
    """``(M, N)`` exact metagradient scores ``-d L_v / d w_j`` on :func:`meta_queries`'
    rows (NaN elsewhere); ``denominator``: ``"exact"`` or ``"fixed"`` (Adam's
    ``sqrt(v) + eps`` held at each step's value)."""
    adamw = task.run.adamw
    settings = replayed.AdamWSettings(
        weight_decay=adamw.weight_decay, max_grad_norm=None, betas=adamw.betas, eps=adamw.eps
    )
    chosen = meta_queries(task)
    blocks = task.validation[chosen]
    queries = [
        MicroBatch(content_hash(part), {"input_ids": part, "labels": part})
        for part in blocks.split(META_QUERY_BATCH)
    ]
    try:
        derivatives = loss_weight_derivatives(
            task.model_factory(),
            rebuilt_trajectory(task),
            queries,
            optimizer=settings,
            loss_convention="micro_batch_mean",
            adam_denominator=denominator,
            initial_state=task.run.initial_state,
            trained_state=task.state,
        )
    except ValueError as refused:
        if "does not reproduce the run" not in str(refused):
            raise
        # listed under "could not run" with the library's reason, the other rows kept
        raise Unsupported(f"tda_plugins.metagradient refused the rebuilt run: {refused}") from None
    scores = derivatives.scores()
    rows = positions(scores.train_ids, content_hash(task.train))
    cols = positions(scores.query_ids, content_hash(blocks))
    out = torch.full((task.validation.shape[0], task.train.shape[0]), float("nan"))
    out[chosen] = scores.values[rows][:, cols].T
    return out.double()


register_attributor("metagradient")(metagradient_scores)
register_attributor("metagradient:fixed-denominator")(
    partial(metagradient_scores, denominator="fixed")
)
