"""A capture session: engine + gradient store + inline curvature for one training run.

The trainer integrations (transformers/TRL, OLMo-core) are thin adapters over this class:
they translate their trainer's events into :meth:`CaptureSession.step`,
:meth:`CaptureSession.save_checkpoint` and :meth:`CaptureSession.end`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tda_plugins.capture import CaptureConsumer, CaptureEngine
from tda_plugins.capture.config import CaptureConfig
from tda_plugins.capture.layers import warn_uncaptured
from tda_plugins.capture.normalization import LossNormalization
from tda_plugins.parallel.dtensor import is_dtensor
from tda_plugins.parallel.gather import rank_gather
from tda_plugins.precondition.adam import AdamMoments, adam_state_refusal, save_adam_state
from tda_plugins.precondition.plan import (
    CapturePlan,
    PlanInputs,
    plan_capture,
    require_within_budget,
)
from tda_plugins.precondition.snapshots import discard_after, drop_checkpoints, latest_set
from tda_plugins.precondition.statistics import CurvatureAccumulator
from tda_plugins.session.dropout import warn_dropout
from tda_plugins.session.settings import CaptureSettings
from tda_plugins.store import GradientStore, StoreError
from tda_plugins.store.layout import TRAINED, rank_dir
from tda_plugins.store.reader import committed_steps
from tda_plugins.store.texts import TextRecorder
from tda_plugins.trajectory.layout import read_step_index, trajectory_dir
from tda_plugins.trajectory.optimizer import optimizer_refusal
from tda_plugins.trajectory.recorder import TrajectoryRecorder, uncovered_parameters
from tda_plugins.trajectory.writer import TrajectoryWriter

logger = logging.getLogger(__name__)


class UnsupportedTrainingSetup(ValueError):
    """The trainer is configured in a way that per-example capture cannot follow."""


def has_adam_moments(optimizer: AdamMoments | None) -> bool:
    """Adam-family optimizers (Adam, AdamW, OLMo-core's SkipStepAdamW...): betas and eps
    in every parameter group."""
    if optimizer is None or not optimizer.param_groups:
        return False
    return all("betas" in g and "eps" in g for g in optimizer.param_groups)


#: ``curvature="auto"`` accumulates K-FAC statistics up to this many bytes per rank in
#: memory (twice that on disk, in fp64). SmolLM2-135M with LoRA on q/v needs 118 MiB, on
#: every linear layer 1.1 GiB; with ``projection="factor"`` under 1 MiB.
AUTO_CURVATURE_BYTES = 64 * 2**20


def capture_plan(settings: CaptureSettings, model: nn.Module, rank: int = 0) -> CapturePlan:
    """The memory plan of ``settings`` on ``model`` in this process's data-parallel world
    (sharded when the parameters are DTensors, as under FSDP2); ``curvature="auto"`` is
    planned as on."""
    initialized = dist.is_available() and dist.is_initialized()
    inputs = PlanInputs(
        selection=settings.layers.selection,
        projection=settings.layers.projection,
        curvature=settings.curvature is not False,
        curvature_head=settings.curvature_head,
        budget_gb=settings.curvature_budget_gb,
        world_size=dist.get_world_size() if initialized else 1,
        rank=rank,
        sharded=any(is_dtensor(p) for p in model.parameters()),
    )
    return plan_capture(model, inputs)


def resolve_curvature(
    settings: CaptureSettings, model: nn.Module, rank: int = 0
) -> tuple[CaptureSettings, CapturePlan]:
    """``settings`` with ``curvature`` decided (``"auto"``: on up to
    :data:`AUTO_CURVATURE_BYTES` per rank), and their plan; their size is logged, as a
    warning where it is over that (``"auto"`` turns them off; ``True`` keeps them, and
    the store grows by twice that); statistics over ``curvature_budget_gb`` are refused
    here, before anything is read or written."""
    plan = capture_plan(settings, model, rank)
    wanted = settings.curvature
    need = plan.statistics_bytes() if wanted else 0
    large = need > AUTO_CURVATURE_BYTES
    if wanted == "auto":
        wanted = not large
        decision = f"curvature='auto' turns them {'off' if large else 'on'}"
    else:
        decision = "curvature=True keeps them"
    if need:
        logger.log(
            logging.WARNING if large else logging.INFO,
            "tda-plugins: K-FAC statistics take %.1f MiB per rank in memory (%.1f MiB on "
            "disk): %s (curvature='auto' keeps them up to %d MiB). K-FAC, EK-FAC and LoGra "
            "need them: curvature=True (tda capture --curvature) keeps them, "
            "projection='factor' makes them small",
            need / 2**20,
            2 * need / 2**20 * 4 / plan.itemsize,
            decision,
            AUTO_CURVATURE_BYTES // 2**20,
        )
    if wanted:
        require_within_budget(model, plan)
    else:
        plan = capture_plan(dataclasses.replace(settings, curvature=False), model, rank)
    return dataclasses.replace(settings, curvature=bool(wanted)), plan


class CaptureSession:
    """Records one training run into a gradient store.

    Args:
        settings: what to record.
        model: the (unwrapped) model whose forward marks micro-batches.
        normalization: how the trainer normalizes its loss (see ``capture.normalization``).
        rank: this process's rank.
        start_step: the optimizer step the run starts at (non-zero when resuming).
        consumers: further consumers (influence logging, data selection).
        tokenizer: the run's tokenizer, recorded in the store's fingerprint and decoding
            the stored texts (optional).
        optimizer: the run's optimizer (the torch one), for ``record_trajectory``.
        max_grad_norm: the trainer's gradient clipping threshold (``None``/0: none), for
            ``record_trajectory``.
        metadata: free-form JSON facts for the store's ``store.json`` (which tokens the
            trainer's rows carry their loss on).

    A fresh run (``start_step == 0``) refuses a store that already holds steps; a resumed
    run drops the store's steps from ``start_step`` on, so the store continues with no
    duplicated or missing step, and restores the K-FAC statistics that
    :meth:`save_checkpoint` kept for that step, so no step is counted twice. Every check
    (the store's config and model, its steps, the saved statistics) runs before anything
    on disk changes: a refused resume leaves the store as it was.

    The memory plan (:attr:`plan`) is computed and logged first; K-FAC statistics over
    ``settings.curvature_budget_gb`` per rank are refused there, before anything is read
    or written.
    """

    def __init__(
        self,
        settings: CaptureSettings,
        *,
        model: nn.Module,
        normalization: LossNormalization,
        rank: int = 0,
        start_step: int = 0,
        consumers: tuple[CaptureConsumer, ...] = (),
        tokenizer: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        max_grad_norm: float | None = None,
        metadata: dict[str, Any] | None = None,
    ):
        self.rank = rank
        if settings.curvature_save_steps < 0:
            raise ValueError(
                f"curvature_save_steps must be >= 0, got {settings.curvature_save_steps}"
            )
        settings, self.plan = resolve_curvature(settings, model, rank)
        self.settings = settings
        self.plan.log()
        # a selection that matches nothing fails here, before anything is written
        resolved = settings.layers.selection.resolve(model)
        layers = tuple(resolved)
        if settings.record_trajectory:
            _refuse_trajectory(settings, self.plan, optimizer, resolved)
        self.store = GradientStore(
            settings.store.directory,
            rank=rank,
            keep_tokens=settings.store.keep_tokens,
            append=start_step > 0,
            model=model,
            tokenizer=tokenizer,
            metadata={**(metadata or {}), TRAINED: True},
        )
        try:
            self._agree_on_resume(CaptureConfig(layers, settings.layers.projection), start_step)
        except BaseException:
            self.store.close_unwritten()
            raise
        committed = self.store.committed_steps
        if committed and committed[-1] >= start_step:
            self.store.truncate(from_step=start_step)
        trajectory = self._open_trajectory(start_step)
        self.curvature = (
            CurvatureAccumulator(
                settings.store.directory,
                rank,
                shapes=self.plan.curvature_shapes,
                excluded=self.plan.excluded,
                world_size=self.plan.inputs.world_size,
                schedule=self.plan.schedule,
            )
            if settings.curvature
            else None
        )
        if self.curvature is not None:
            if committed:
                self.curvature.restore(start_step)
            # the previous run's statistics of the steps this one (re)does
            discard_after(rank_dir(Path(settings.store.directory), rank), start_step)
        own: tuple[CaptureConsumer, ...] = (self.store,)
        if self.curvature is not None:
            own = (*own, self.curvature)
        if settings.store.store_texts and callable(getattr(tokenizer, "decode", None)):
            own = (
                *own,
                TextRecorder(
                    settings.store.directory, rank, tokenizer, tokens=settings.store.keep_tokens
                ),
            )
        self.engine = CaptureEngine(
            model,
            layers=settings.layers.selection,
            projection=settings.layers.projection,
            consumers=(*own, *consumers),
            normalization=normalization,
        )
        self.engine.attach()
        warn_uncaptured(
            model,
            self.engine.captured_layers,
            "the store and its scores",
            settings.layers.uncaptured_fix,
        )
        warn_dropout(model, "the store and its scores")
        self.engine.resume_at_step(start_step)
        self.trajectory: TrajectoryRecorder | None = None
        #: The checkpoints this run saved and the trainer may still hold: step -> folder.
        self._checkpoints: dict[int, Path] = {}
        if trajectory is not None and optimizer is not None:
            self.trajectory = TrajectoryRecorder(
                trajectory,
                layers=self.engine.captured_layers,
                optimizer=optimizer,
                model=model,
                max_grad_norm=max_grad_norm,
            )
            self.engine.add_consumer(self.trajectory)

    def _open_trajectory(self, start_step: int) -> TrajectoryWriter | None:
        """The trajectory folder, without steps from ``start_step`` on (so that it never
        holds a step the store does not), when this run records one or an earlier run did;
        ``None`` when this run records none."""
        root = Path(self.settings.store.directory)
        if not self.settings.record_trajectory and not trajectory_dir(root, self.rank).exists():
            return None
        writer = TrajectoryWriter(root, self.rank)
        writer.truncate(from_step=start_step)
        if self.settings.record_trajectory:
            return writer
        writer.close()
        return None

    def _agree_on_resume(self, config: CaptureConfig, start_step: int) -> None:
        """:meth:`_check_resume` on every rank, and its refusal on all of them if any rank
        refuses, before any rank removes a step (a rank that went on alone would truncate
        its folder, then wait for the others in the first collective)."""
        try:
            self._check_resume(config, start_step)
            refusal = None
        except StoreError as error:
            refusal = error
        refusals = rank_gather().objects(None if refusal is None else str(refusal))
        if refusal is not None:
            raise refusal
        for rank, message in enumerate(refusals):
            if message is not None:
                raise StoreError(f"rank {rank} refused this start: {message}")

    def _check_resume(self, config: CaptureConfig, start_step: int) -> None:
        """Every check a start or resume needs, before anything is removed."""
        settings, committed = self.settings, self.store.committed_steps
        world = self.plan.inputs.world_size
        writers = committed_steps(self.store.root)
        if writers and (max(writers) >= world or (start_step > 0 and self.rank not in writers)):
            held = ", ".join(f"rank-{r} steps {s[0]}..{s[-1]}" for r, s in sorted(writers.items()))
            raise StoreError(
                f"{settings.store.directory} was written by other processes than this run's "
                f"{world} ({held}): resumed by another number of processes, the store would "
                "keep steps a rank outside this run wrote beside the new ones, or miss a "
                "rank's; resume with as many processes as the run that wrote it, or write to a "
                "new store_dir. Nothing in the store was changed"
            )
        if start_step == 0 and committed:
            raise StoreError(
                f"{settings.store.directory} already holds steps {committed[0]}..{committed[-1]} "
                "of another run; write to a new store_dir, or resume_from_checkpoint to continue it"
            )
        if start_step > self.store.next_step:
            raise StoreError(
                f"resuming at step {start_step}, but {settings.store.directory} (rank {self.rank}) "
                f"ends at step {self.store.next_step - 1}: steps would be missing; use a new "
                "store_dir"
            )
        self.store.check_compatible(config)
        if (
            settings.curvature
            and committed
            and latest_set(self.store.root, at_step=start_step) is None
        ):
            raise StoreError(
                f"{settings.store.directory} has no K-FAC statistics saved at step {start_step} "
                f"(curvature-before-step{start_step}.safetensors from every rank), so resuming "
                "there would count later steps twice; resume from a checkpoint saved while this "
                "capture ran, or use curvature=False. Nothing in the store was changed"
            )
        if settings.record_trajectory:
            recorded = {e.step for e in read_step_index(trajectory_dir(self.store.root, self.rank))}
            missing = sorted({s for s in committed if s < start_step} - recorded)
            if missing:
                raise StoreError(
                    f"{settings.store.directory} holds steps {missing[:5]} without a recorded "
                    "trajectory (captured without record_trajectory, or lost in a crash), so the "
                    f"resumed run's trajectory would have gaps; resume from an earlier checkpoint, "
                    "or use record_trajectory=False. Nothing in the store was changed"
                )

    def step(self) -> None:
        """An optimizer step is about to happen: commit its micro-batches (the disk waits
        run in the background, beside the optimizer update)."""
        self.engine.optimizer_step()

    def after_optimizer_step(self) -> None:
        """The optimizer has updated the weights, and the learning rate is still the one it
        used: record the step's trajectory (``record_trajectory``; else nothing)."""
        if self.trajectory is not None:
            self.trajectory.after_update()

    def finish_step(self) -> None:
        """The step is over: wait until its commit (and trajectory step) is on disk, so
        that an exception later in the run (which ends no capture) leaves every finished
        step readable; every ``curvature_save_steps`` steps, commit the K-FAC statistics
        too."""
        self.store.flush()
        if self.trajectory is not None:
            self.trajectory.writer.flush()
        every, next_step = self.settings.curvature_save_steps, self.engine.step
        if self.curvature is not None and every and next_step % every == 0:
            self.curvature.commit(next_step)

    def save_checkpoint(self, next_step: int, folder: Path | None = None) -> None:
        """The trainer checkpoints after ``next_step`` optimizer steps (into ``folder``,
        where it is known): keep what a run resumed from that checkpoint needs (every
        committed step on disk, and the K-FAC statistics so far, in the store). Call it
        before the trainer writes its checkpoint where the trainer allows (then a crash
        between the two leaves the checkpoint resumable); calling it again for the same
        step writes nothing."""
        self.store.flush()
        if self.trajectory is not None:
            self.trajectory.writer.flush()
        if self.curvature is not None:
            self.curvature.commit(next_step, "checkpoint")
        if folder is not None:
            self._checkpoints[next_step] = folder

    def drop_deleted_checkpoints(self) -> None:
        """Drop the K-FAC statistics kept for the checkpoints this run saved that the
        trainer has deleted since (a ``save_total_limit`` rotation, OLMo-core's ephemeral
        checkpoints): their folders are gone while a later one's is there (checkpoints
        are written in order, so an earlier one missing then was written and removed). No
        run resumes there, and each copy is the size of all the statistics. Nothing is
        dropped where this process sees none of the folders (another node's disk)."""
        present = {step for step, folder in self._checkpoints.items() if folder.is_dir()}
        if not present:
            return
        gone = {step for step in self._checkpoints if step < max(present)} - present
        for step in gone:
            del self._checkpoints[step]
        if gone and self.curvature is not None:
            drop_checkpoints(rank_dir(Path(self.settings.store.directory), self.rank), gone)

    def roll_back(self, next_step: int) -> None:
        """The run ends on the weights it checkpointed after ``next_step`` optimizer steps
        (transformers' ``load_best_model_at_end``): drop the later steps from the store
        and the trajectory and take the K-FAC statistics saved with that checkpoint, so
        that the store holds what a run stopped there would (call before :meth:`end`,
        which then digests the restored weights). Refused, changing nothing, when those
        statistics are missing."""
        root = Path(self.settings.store.directory)
        if self.curvature is not None and latest_set(root, at_step=next_step) is None:
            raise StoreError(
                f"{root} has no K-FAC statistics saved at step {next_step} (the checkpoint the "
                "trainer restored), so they cannot be rolled back with the store's steps"
            )
        self.store.truncate(from_step=next_step)
        if self.trajectory is not None:
            self.trajectory.writer.truncate(from_step=next_step)
        if self.curvature is not None:
            self.curvature.restore(next_step)
            discard_after(rank_dir(root, self.rank), next_step)

    def end(self, optimizer: AdamMoments | None = None) -> None:
        """Finish: commit, save statistics and (for Adam) the optimizer moments; detach.

        Every rank of a distributed run calls this: moments sharded by FSDP2/HSDP are
        gathered collectively (each rank passes its own optimizer), and rank 0 writes them.
        """
        self.engine.end()
        saves_moments = self.settings.save_optimizer_state and has_adam_moments(optimizer)
        if saves_moments and optimizer is not None:
            refusal = adam_state_refusal(self.engine, optimizer)
            if refusal is None:
                save_adam_state(
                    self.settings.store.directory, self.engine, optimizer, write=self.rank == 0
                )
            else:  # the run is over: say so, but never fail it here
                logger.warning(
                    "tda-plugins: %s, so the store gets none and LESS cannot score it; the "
                    "other methods are unaffected",
                    refusal,
                )
        self.engine.detach()


def _refuse_trajectory(
    settings: CaptureSettings,
    plan: CapturePlan,
    optimizer: torch.optim.Optimizer | None,
    layers: dict[str, Any],
) -> None:
    """Refuse, before anything is written, a ``record_trajectory`` capture the recorded
    steps could not describe exactly."""
    reasons = []
    if settings.layers.projection is not None:
        reasons.append(
            "trajectory methods divide each gradient entry by Adam's per-parameter "
            "denominator, which projected gradients no longer have: use projection='none'"
        )
    if plan.inputs.world_size > 1:
        reasons.append("it is recorded in one process: train without data parallelism")
    refusal = optimizer_refusal(optimizer)
    if refusal is not None:
        reasons.append(refusal)
    elif optimizer is not None:
        missing = uncovered_parameters(optimizer, layers)
        if missing:
            reasons.append(
                f"the optimizer does not update the captured parameters {missing[:3]}; "
                "capture only trained layers"
            )
    if reasons:
        raise UnsupportedTrainingSetup(f"record_trajectory: {'; '.join(reasons)}")
