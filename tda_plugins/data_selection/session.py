"""A selection session: engine + target pool + selector for one training run.

The trainer integrations (transformers/TRL, OLMo-core) are thin adapters over this class,
as the capture callbacks are over :class:`~tda_plugins.session.capture.CaptureSession`: they
translate their trainer's events into :meth:`SelectionSession.refresh_target` (before a
step's first forward), :meth:`SelectionSession.step` (after its last backward, before
clipping and the optimizer) and :meth:`SelectionSession.end`.

Under data parallelism (DDP, or FSDP2/HSDP ``fully_shard``) the session computes the
target once per refresh over the ranks (each its share of the pool, summed by one
collective), gathers each step's scores, applies the rule once to the global batch, and
each rank edits only its own rows of ``.grad``. Memory per rank, beyond training's own:

* DDP: the target, one ``(D,)`` vector per captured layer (the size of the captured
  parameters), kept between refreshes.
* FSDP/HSDP: the target as ``.grad``-like shards (``1/S`` of the captured parameters),
  plus, transiently during a step, one layer's gathered target (its ``D`` values) while
  that layer is scored, then one layer's gathered side gradients or full-size sum while
  its rows are corrected (:mod:`~tda_plugins.data_selection.surgery`): at most the
  largest layer's size each, never the whole model, under the cost model's routes (it
  gathers a layer's examples only when they are fewer bytes than the layer). Measured
  (``tests/selection_ddp_worker.py``, the tiny Llama of the tests fully sharded over 2
  ranks, fp32, 8 examples a step): 39 KiB of target shards per rank (half of the 77 KiB
  of parameters), 8 KiB of gathered target and 8 KiB held by the surgery at once (the
  largest layers, the 64 x 32 embedding and LM head); a gather forced on every layer
  held 27 KiB (the LM head's side examples), which is why the cost model reduces it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from tda_plugins.capture import CaptureEngine, LayerSelection
from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.capture.engine import capture_suspended
from tda_plugins.capture.layers import uncovered_fix, uncovered_trainable
from tda_plugins.capture.normalization import LossNormalization
from tda_plugins.data_selection.losses import ForwardLosses, OutputLosses
from tda_plugins.data_selection.outcome import StepSelection, start_log
from tda_plugins.data_selection.parallel import Ranks, check_layout, divide_factor, is_sharded
from tda_plugins.data_selection.resume import ScheduleState, ScheduleStateError
from tda_plugins.data_selection.selector import DataSelector, TokenCounter
from tda_plugins.data_selection.settings import SelectionSettings
from tda_plugins.data_selection.target import (
    ExampleLosses,
    ShardedTarget,
    TargetPool,
    nonfinite,
    shared_target,
)
from tda_plugins.data_selection.token_mean import GENERIC_FIX
from tda_plugins.session.batch import evaluating
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tda_plugins.session.dropout import warn_dropout

Batch = Mapping[str, Tensor]
#: ``batch -> (P,)`` loss tokens of each target example.
TargetTokens = Callable[[Batch], Tensor]

#: How to cover every trainable parameter, for the refusal's message.
DEFAULT_FIX = "use layers='all' for full fine-tuning, or freeze them"


class SelectionError(ValueError):
    """The selection target cannot be used (no loss tokens, non-finite gradient)."""


def check_coverage(
    model: nn.Module, layers: dict[str, tuple[nn.Module, LayerAdapter]], fix: str = DEFAULT_FIX
) -> None:
    """Refuse a run in which some trainable parameter is not captured: its ``.grad``
    could not be corrected."""
    missing = uncovered_trainable(model, layers)
    if missing:
        raise UnsupportedTrainingSetup(
            f"{len(missing)} trainable parameters are not captured ({missing[:3]}), so "
            f"their .grad could not be corrected; {uncovered_fix(model, missing, fix)}"
        )


class SelectionSession:
    """Online data selection for one training run.

    Args:
        settings: what to select.
        model: the model the trainer calls (``fully_shard``-ed or not; for DDP the
            module inside the wrapper or the one ``replicate`` was applied to).
        target: the target pool, tensors with the example axis first (``labels`` in the
            convention of ``losses``); ``None`` for ``score="loss"``, which needs none.
        losses: ``(model, batch) -> (B,)`` each target example's summed loss.
        target_tokens: ``batch -> (P,)`` loss tokens of each target example.
        normalization: how the trainer normalizes its loss (see ``capture.normalization``).
        token_counts: ``record -> (B,)`` loss tokens of each training example.
        optimizer: the torch optimizer (``score="adam"``).
        log_path: the JSONL log (written by rank 0).
        layers: the layers to capture (default: ``settings.layers``).
        parameter_grads: as :class:`~tda_plugins.capture.engine.CaptureEngine` takes it
            (``False``: one process only, ``.grad`` built from the kept examples).
        chunk_size: target examples per forward/backward (default: all at once).
        start_step: the optimizer step the run starts at (a resumed run).
        fix: how to cover every trainable parameter (the refusal's way out).
        output_losses: ``(output, forward kwargs) -> (B,)`` each training example's summed
            loss from the training forward's output (``score="loss"``).
        token_mean_fix: the way out when the trainer's loss is not the token mean over a
            step's global batch (checked at every selected step, before ``.grad`` is
            edited).

    Raises:
        UnsupportedTrainingSetup: before any step, for uncovered trainable parameters or a
            parameter layout selection cannot edit exactly.
    """

    def __init__(
        self,
        settings: SelectionSettings,
        model: nn.Module,
        *,
        target: Batch | None,
        losses: ExampleLosses,
        target_tokens: TargetTokens,
        normalization: LossNormalization,
        token_counts: TokenCounter,
        optimizer: torch.optim.Optimizer | None = None,
        log_path: str | Path | None = None,
        layers: LayerSelection | None = None,
        parameter_grads: bool = True,
        chunk_size: int | None = None,
        start_step: int = 0,
        fix: str = DEFAULT_FIX,
        output_losses: OutputLosses | None = None,
        token_mean_fix: str = GENERIC_FIX,
    ):
        if settings.needs_target and target is None:
            raise ValueError(f"score={settings.score!r} needs a target pool; give target=...")
        if settings.score == "loss" and output_losses is None:
            raise UnsupportedTrainingSetup(
                "score='loss' needs the training examples' losses from the forward, which "
                "this integration does not provide; use a gradient score"
            )
        self.settings = settings
        # score="loss" reads no target: a pool given anyway is never run
        self.pool = (
            TargetPool(target, settings.target_examples)
            if target is not None and settings.needs_target
            else None
        )
        self.losses = losses
        self.target_tokens = target_tokens
        self.chunk_size = chunk_size
        self.ranks = Ranks.current()
        self.engine = CaptureEngine(
            model,
            layers=layers or settings.layers,
            normalization=normalization,
            parameter_grads=parameter_grads,
        ).attach()
        self.forward_losses: ForwardLosses | None = None
        try:
            if settings.score == "loss" and output_losses is not None:
                self.forward_losses = ForwardLosses(model, output_losses)
            captured = self.engine.captured_layers
            check_coverage(model, captured, fix)
            check_layout(model, captured)
            if settings.needs_target:
                warn_dropout(model, "the selection's scores")
            self.divide = divide_factor(model, self.ranks)
            self.selector = DataSelector(
                captured,
                rule=settings.drop_rule(),
                token_counts=token_counts,
                score=settings.score,
                granularity=settings.granularity,
                optimizer=optimizer,
                log_path=log_path if self.ranks.rank == 0 else None,
                score_projection=settings.projection(),
                ranks=self.ranks,
                divide=self.divide,
                example_losses=self.forward_losses.of if self.forward_losses else None,
                drop_counts=settings.drop_counts,
                token_mean_fix=token_mean_fix,
            )
        except Exception:
            self.close()
            raise
        self.engine.add_consumer(self.selector)
        self.engine.resume_at_step(start_step)
        if log_path is not None and self.ranks.rank == 0:
            start_log(Path(log_path), start_step)
        self._target_step: int | None = None
        #: The last selected step's global batch size, as restored (before any step here).
        self._restored_step_examples: int | None = None

    @property
    def model(self) -> nn.Module:
        return self.engine.model

    @property
    def history(self) -> list[StepSelection]:
        """One :class:`StepSelection` per optimizer step so far (the global outcome)."""
        return self.selector.history

    @property
    def sharded(self) -> bool:
        return is_sharded(self.engine.captured_layers)

    def refresh_target(self, step: int) -> bool:
        """Before optimizer step ``step``'s first forward: recompute the target if due
        (every ``refresh_every`` steps from the run's first step, a resumed run going on
        from the schedule :meth:`restore_schedule` gave it; ``None``:
        :meth:`SelectionSettings.refresh_interval` of the last step's batch). The model
        runs in eval mode, unrecorded by any engine. Returns whether it was recomputed
        (never for a score without a target).

        Raises:
            SelectionError: the refresh's examples have no loss token, or their gradient
                is not finite (naming them by their position in the pool).
        """
        self.engine.resume_at_step(step)
        if self.pool is None:  # score="loss": no target
            return False
        due = self._target_step is None or step - self._target_step >= self._refresh_interval()
        if not due:
            return False
        model = self.model
        batch = self.pool.next_batch(next(model.parameters()).device)
        rows = self.pool.last_rows
        if int(self.target_tokens(batch).sum()) == 0:
            raise SelectionError(
                f"the selection target's examples {rows} (pool positions) have no loss token, "
                "so every training example would score 0; give target rows with labels that "
                "are not all -100"
            )
        with evaluating(model), self.engine.paused(), capture_suspended():
            target = shared_target(
                model,
                self.engine.captured_layers,
                batch,
                self.losses,
                ranks=self.ranks,
                divide=self.divide,
                chunk_size=self.chunk_size,
            )
        if nonfinite(target, self.ranks):
            raise SelectionError(
                f"the selection target's examples {rows} (pool positions) have a non-finite "
                f"gradient at step {step}'s weights, so every score would be NaN; remove "
                "them from the target pool (or fix the weights)"
            )
        self.selector.set_target(target)
        self._target_step = step
        return True

    def _refresh_interval(self) -> int:
        """Steps between refreshes (``refresh_every=None``: from the last step's global
        batch size and the pool's examples per refresh)."""
        assert self.pool is not None  # a target is refreshed only with a pool
        return self.settings.refresh_interval(self.pool.per_refresh, self._step_examples() or 1)

    def _step_examples(self) -> int | None:
        """Examples of the last selected step's global batch (``None``: none yet)."""
        history = self.selector.history
        if history:
            return int(history[-1].example_ids.numel())
        return self._restored_step_examples

    def schedule_state(self, step: int) -> ScheduleState | None:
        """What a run resumed at optimizer step ``step`` (the checkpoint's: the next to
        run) needs to select as this one goes on to (:mod:`.resume`); ``None`` for a
        ``fully_shard``-ed target, which is not saved."""
        target = self.selector.target
        if isinstance(target, ShardedTarget):
            return None
        return ScheduleState(
            step=step,
            target_step=self._target_step,
            step_examples=self._step_examples(),
            pool_next=self.pool.next if self.pool is not None else 0,
            summed_share=self.selector.surgery.summed_share,
            rule=self.selector.rule.state(),
            target=target,
        )

    def restore_schedule(self, state: ScheduleState, *, step: int) -> None:
        """Go on from ``state``, saved by :meth:`schedule_state` at the checkpoint this run
        resumes at optimizer step ``step``; before the run's first step.

        Raises:
            ScheduleStateError: ``state`` is of another step, its target of other layers
                or sizes than this session captures, its pool cursor past this pool or its
                rule state not this rule's; nothing is restored then.
        """
        if state.step != step:
            raise ScheduleStateError(f"it was saved at step {state.step}, not {step}")
        target = state.target
        if target is not None:
            captured = self.engine.captured_layers
            if set(target) != set(captured):
                raise ScheduleStateError("its target is of other layers than this run captures")
            for name, vector in target.vectors.items():
                module, adapter = captured[name]
                size = sum(p.numel() for p in adapter.captured_parameters(module).values())
                if vector.numel() != size:
                    raise ScheduleStateError(f"its target of layer {name} has another size")
        if self.pool is not None and not 0 <= state.pool_next < self.pool.size:
            raise ScheduleStateError(f"its pool cursor {state.pool_next} is past this pool")
        try:
            self.selector.rule.load_state(state.rule)
        except (KeyError, ValueError) as error:
            raise ScheduleStateError(f"its rule state does not fit this rule: {error}") from error
        if target is not None:
            self.selector.set_target(target)
        self._target_step = state.target_step
        self._restored_step_examples = state.step_examples
        if self.pool is not None:
            self.pool.next = state.pool_next
        self.selector.surgery.summed_share = state.summed_share

    def step(self) -> StepSelection | None:
        """After the step's last backward: select and edit ``.grad``. Returns the step's
        outcome (``None`` when there was nothing to select: no micro-batch, or no target
        yet). On a skipped step (no finite example) every captured parameter's ``.grad``
        is dropped (``None``), so the torch optimizer leaves it and its state unchanged."""
        done = len(self.selector.history)
        self.engine.optimizer_step()
        if self.forward_losses is not None:
            self.forward_losses.clear()
        if len(self.selector.history) == done:
            return None
        outcome = self.selector.history[-1]
        if outcome.skipped:
            for module, adapter in self.engine.captured_layers.values():
                for p in adapter.captured_parameters(module).values():
                    p.grad = None
        return outcome

    def end(self) -> None:
        """Training finished: deliver pending micro-batches and unhook."""
        self.engine.end()
        self.close()

    def close(self) -> None:
        """Unhook without finishing (after an error)."""
        self.engine.detach()
        if self.forward_losses is not None:
            self.forward_losses.remove()
