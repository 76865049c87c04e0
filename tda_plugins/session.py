"""A capture session: engine + gradient store + inline curvature for one training run.

The trainer integrations (transformers/TRL, OLMo-core) are thin adapters over this class:
they translate their trainer's events into :meth:`CaptureSession.step`,
:meth:`CaptureSession.save_checkpoint` and :meth:`CaptureSession.end`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from tda_plugins.capture import CaptureConsumer, CaptureEngine, LayerSelection
from tda_plugins.capture.config import CaptureConfig
from tda_plugins.capture.layers import SelectionKind
from tda_plugins.capture.normalization import LossNormalization
from tda_plugins.grads.projection import MapKind, ProjectionConfig
from tda_plugins.precondition.adam import save_adam_state
from tda_plugins.precondition.statistics import CurvatureAccumulator
from tda_plugins.store import GradientStore, StoreError
from tda_plugins.store.layout import rank_dir


@dataclass
class CaptureSettings:
    """What a training run records. Every field has a default except the store directory.

    Attributes:
        store_dir: where the gradient store is written (one ``rank-<r>/`` per process).
        layers: ``"auto"`` (LoRA adapters on PEFT models, else linear layers), ``"linear"``,
            ``"lora"`` or ``"all"`` (linear, embedding and norm scales).
        include: regex; keep only layers whose module name matches.
        exclude: regex; drop layers whose module name matches.
        last_n_blocks: keep only layers in the last N transformer blocks.
        projection: ``"none"`` (exact gradients), ``"factor"`` (LoGra, ``k_g x k_a`` per
            layer) or ``"dense"`` (``k`` per layer).
        k_a: factor projection rows for layer inputs.
        k_g: factor projection rows for output gradients.
        k: dense projection dimension.
        projection_map: ``"gaussian"``, ``"rademacher"`` or ``"sparse_jl"``.
        seed: projection seed (maps are deterministic from seed and layer name).
        curvature: accumulate K-FAC statistics in the same pass (K-FAC, EK-FAC, LoGra).
        keep_tokens: keep per-token factors in the store (token-level scores).
        save_optimizer_state: at the end, save Adam moments of the captured layers (LESS).
        curvature_every: also write the K-FAC statistics so far every this many optimizer
            steps (beside the snapshots kept for trainer checkpoints), so that a run that
            crashes is attributable with the statistics of all but its last few steps.
    """

    store_dir: str
    layers: SelectionKind = "auto"
    include: str | None = None
    exclude: str | None = None
    last_n_blocks: int | None = None
    projection: Literal["none", "factor", "dense"] = "none"
    k_a: int = 16
    k_g: int = 16
    k: int = 256
    projection_map: MapKind = "gaussian"
    seed: int = 0
    curvature: bool = True
    keep_tokens: bool = False
    save_optimizer_state: bool = True
    curvature_every: int = 50

    def __post_init__(self) -> None:
        if self.curvature_every < 1:
            raise ValueError(f"curvature_every must be >= 1, got {self.curvature_every}")

    def selection(self) -> LayerSelection:
        return LayerSelection(
            kind=self.layers,
            include=self.include,
            exclude=self.exclude,
            last_n_blocks=self.last_n_blocks,
        )

    def projection_config(self) -> ProjectionConfig | None:
        if self.projection == "none":
            return None
        return ProjectionConfig(
            kind=self.projection,
            k_a=self.k_a,
            k_g=self.k_g,
            k=self.k,
            map=self.projection_map,
            seed=self.seed,
        )


class UnsupportedTrainingSetup(ValueError):
    """The trainer is configured in a way that per-example capture cannot follow."""


def has_adam_moments(optimizer: torch.optim.Optimizer | None) -> bool:
    """Adam-family optimizers (Adam, AdamW, OLMo-core's SkipStepAdamW...): betas and eps
    in every parameter group."""
    if optimizer is None or not optimizer.param_groups:
        return False
    return all("betas" in g and "eps" in g for g in optimizer.param_groups)


def _curvature_snapshot(store_dir: str | Path, rank: int, next_step: int) -> Path:
    """The K-FAC statistics of the steps before ``next_step``, kept in the store."""
    return rank_dir(Path(store_dir), rank) / f"curvature-before-step{next_step}.safetensors"


class CaptureSession:
    """Records one training run into a gradient store.

    Args:
        settings: what to record.
        model: the (unwrapped) model whose forward marks micro-batches.
        normalization: how the trainer normalizes its loss (see ``capture.normalization``).
        rank: this process's rank.
        start_step: the optimizer step the run starts at (non-zero when resuming).
        consumers: further consumers (influence logging, data selection).
        tokenizer: the run's tokenizer, recorded in the store's fingerprint (optional).

    A fresh run (``start_step == 0``) refuses a store that already holds steps; a resumed
    run drops the store's steps from ``start_step`` on, so the store continues with no
    duplicated or missing step, and restores the K-FAC statistics that
    :meth:`save_checkpoint` kept for that step, so no step is counted twice. Every check
    (the store's config and model, its steps, the saved statistics) runs before anything
    on disk changes: a refused resume leaves the store as it was.
    """

    def __init__(
        self,
        settings: CaptureSettings,
        model: nn.Module,
        normalization: LossNormalization,
        rank: int = 0,
        start_step: int = 0,
        consumers: tuple[CaptureConsumer, ...] = (),
        tokenizer: Any = None,
    ):
        self.settings = settings
        self.rank = rank
        # a selection that matches nothing fails here, before anything is written
        layers = tuple(settings.selection().resolve(model))
        self.store = GradientStore(
            settings.store_dir,
            rank=rank,
            keep_tokens=settings.keep_tokens,
            append=start_step > 0,
            model=model,
            tokenizer=tokenizer,
        )
        try:
            snapshot = self._check_resume(
                CaptureConfig(layers, settings.projection_config()), start_step
            )
        except BaseException:
            self.store.close()
            raise
        if self.store.committed_steps and self.store.committed_steps[-1] >= start_step:
            self.store.truncate(from_step=start_step)
        self.curvature = (
            CurvatureAccumulator(settings.store_dir, rank) if settings.curvature else None
        )
        if self.curvature is not None and snapshot is not None:
            self.curvature.restore(snapshot)
        own: tuple[CaptureConsumer, ...] = (self.store,)
        if self.curvature is not None:
            own = (*own, self.curvature)
        self.engine = CaptureEngine(
            model,
            settings.selection(),
            settings.projection_config(),
            (*own, *consumers),
            normalization,
        )
        self.engine.attach()
        self.engine.resume_at_step(start_step)

    def _check_resume(self, config: CaptureConfig, start_step: int) -> Path | None:
        """Every check a start or resume needs, before anything is removed; the K-FAC
        snapshot to restore (``None``: none needed)."""
        settings, committed = self.settings, self.store.committed_steps
        if start_step == 0 and committed:
            raise StoreError(
                f"{settings.store_dir} already holds steps {committed[0]}..{committed[-1]} of "
                "another run; write to a new store_dir, or resume_from_checkpoint to continue it"
            )
        if start_step > self.store.next_step:
            raise StoreError(
                f"resuming at step {start_step}, but {settings.store_dir} (rank {self.rank}) "
                f"ends at step {self.store.next_step - 1}: steps would be missing; use a new "
                "store_dir"
            )
        self.store.check_compatible(config)
        if not settings.curvature or not committed:
            return None
        saved = _curvature_snapshot(settings.store_dir, self.rank, start_step)
        if not saved.exists():
            raise StoreError(
                f"{settings.store_dir} has no K-FAC statistics saved at step {start_step} "
                f"({saved.name}), so resuming there would count later steps twice; resume "
                "from a checkpoint saved while this capture ran, or use curvature=False. "
                "Nothing in the store was changed"
            )
        return saved

    def step(self) -> None:
        """An optimizer step is about to happen: commit its micro-batches (the disk waits
        run in the background, beside the optimizer update)."""
        self.engine.optimizer_step()

    def finish_step(self, next_step: int) -> None:
        """Optimizer step ``next_step - 1`` is over: wait until its commit is on disk, so
        that an exception later in the run (which ends no capture) leaves every finished
        step readable; every ``curvature_every`` steps, write the statistics so far."""
        self.store.flush()
        if self.curvature is not None and next_step % self.settings.curvature_every == 0:
            self.curvature.save()

    def save_checkpoint(self, next_step: int) -> None:
        """The trainer is about to checkpoint after ``next_step`` optimizer steps (or has
        just done so): keep what a run resumed from that checkpoint needs (every committed
        step on disk, and the K-FAC statistics so far, in the store). Called before the
        trainer writes its checkpoint, a crash between the two leaves the checkpoint
        resumable. Idempotent for one step."""
        self.store.flush()
        if self.curvature is None:
            return
        snapshot = _curvature_snapshot(self.settings.store_dir, self.rank, next_step)
        if not snapshot.exists():
            self.curvature.save(snapshot)
            self.curvature.save()

    def end(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Finish: commit, save statistics and (for Adam) the optimizer moments; detach.
        Under FSDP every rank must call it: sharded moments are gathered collectively."""
        self.engine.end()
        wanted = optimizer is not None and self.settings.save_optimizer_state
        if optimizer is not None and wanted and has_adam_moments(optimizer):
            save_adam_state(self.settings.store_dir, self.engine, optimizer, write=self.rank == 0)
        self.engine.detach()
