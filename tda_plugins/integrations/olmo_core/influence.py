"""Live influence for OLMo-core: how each step's instances influence fixed query sequences.

    config = trainer_config.with_callback(
        "influence", InfluenceLoggingCallback(queries=query_token_ids, every_n_steps=10)
    )

The OLMo-core counterpart of the transformers ``InfluenceLoggingCallback``, over the same
:class:`~tda_plugins.live.influence.InfluenceLogger`. Per scored step: ``pre_step`` takes the
queries' per-example gradients at the step's weights, in a pass that no training engine
records (the queries' batch and loss are the selection target's, from
:mod:`~tda_plugins.integrations.olmo_core.pool`); the train module runs its
micro-batches, whose backward a capture engine hands to the logger (example ids from the
batch's ``index``, as :class:`~tda_plugins.integrations.olmo_core.GradientCaptureCallback`
reads them; loss scale from
:class:`~tda_plugins.integrations.olmo_core.OLMoCoreLossNormalization`);
``pre_optim_step`` scores them and records the step's metrics; ``post_train`` writes the
report.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from olmo_core.io import is_url
from olmo_core.train.callbacks import Callback
from olmo_core.train.train_module import TransformerTrainModule
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from tda_plugins.capture import CaptureEngine, MicroBatchRecord
from tda_plugins.capture.layers import warn_uncaptured
from tda_plugins.data_selection.parallel import is_sharded
from tda_plugins.integrations.olmo_core.callbacks import (
    before_each_forward,
    check_train_module,
    give_example_ids,
)
from tda_plugins.integrations.olmo_core.normalization import OLMoCoreLossNormalization
from tda_plugins.integrations.olmo_core.pool import (
    PoolTokens,
    pool_batch,
    pool_rows,
    summed_token_losses,
)
from tda_plugins.integrations.olmo_core.selection import DataSelectionCallback
from tda_plugins.live.influence import InfluenceLogger
from tda_plugins.parallel.gather import OneProcess, rank_gather, without_gradient_sync
from tda_plugins.session.batch import capture_batch, evaluating
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tda_plugins.session.dropout import warn_dropout
from tda_plugins.session.settings import LayerOptions, LayerSettings, ProjectionOptions

Decode = Callable[[list[int]], str]


@dataclass
class InfluenceLoggingCallback(Callback, LayerOptions, ProjectionOptions):
    """Logs, during training, how each step's instances influence fixed query sequences.

    On OLMo-core steps ``1, 1 + n, 1 + 2n, ...`` (``n = every_n_steps``; the trainer's
    ``global_step`` numbering) it takes the ``M`` queries' gradients at the step's weights
    (no training engine records that pass), scores the step's ``N`` instances (every
    micro-batch, every rank) against them from the training backward itself:

        score(z, q) = <g_q, g_z>   (graddot)   or its cosine   (gradcos)

    and records ``influence/q<j>_mean`` and ``influence/q<j>_max`` (over the ``N``
    instances, for query ``j``) with ``trainer.record_metric`` under that step. ``g`` is
    an example's own *summed* token loss gradient over the captured layers: for a training
    instance its summed cross-entropy plus the z-loss term when the train module uses one
    (whatever ``loss_div_factor``, micro-batch or data-parallel size, see
    :mod:`~tda_plugins.integrations.olmo_core.normalization`), for a query its summed
    next-token cross-entropy. Scores are ``(N, M)`` fp32 per step; the query gradients,
    ``(M, D)`` per captured layer of ``D`` parameters (or their factors), are held from a
    scored step's ``pre_step`` to the next step's; cost per scored step: one forward and
    backward over the queries, and the scores.

    At ``post_train`` rank 0 writes ``influence.json`` (the per-step history, each
    instance's cumulative learning-rate-weighted score, the top-k), ``influence.html``
    (top-k helpful and harmful instances with their texts) and ``influence.png`` to
    ``report_dir`` (default ``<save_folder>/influence``). Instances are named by their
    OLMo-core instance index (the batch's ``index``; a content hash of the tokens without
    one), queries by their position ``j``, as in the metric names; the report's steps are
    the trainer's. The learning rate of a step is the one the train module's scheduler
    sets for it (first parameter group). Each checkpoint holds the log so far (in the
    per-rank trainer state), so a run resumed from it reports every step.

    Data parallelism (``dp_config`` DDP, FSDP or HSDP): every rank takes the queries'
    gradients itself (its own instances are scored on it, against every query) and the
    ranks' scores are gathered at each scored step, so the metrics cover the whole global
    batch and are the same on every rank; rank 0 alone writes one report covering every
    rank's instances. Setups whose gradients would be wrong (see
    :func:`~tda_plugins.integrations.olmo_core.check_train_module`) are refused at
    ``pre_train``, before any step.

    Args:
        queries: the queries: a ``(M, T)`` tensor of token ids, or ``M`` token-id lists
            (any lengths).
        method: ``"gradcos"`` (default; comparable across steps) or ``"graddot"``.
        every_n_steps: score every n-th optimizer step, from the first.
        top_k: instances per query and side in the report.
        report_dir: where the report goes (a local folder).
        tokenizer: how the report writes token ids as text: an object with ``decode``
            (a Hugging Face tokenizer) or a callable ``list[int] -> str``; ``None``:
            token ids separated by spaces.
        exclude_params: parameter name patterns left out of the scores (``("bias",)``:
            :class:`~tda_plugins.methods.groups.ParameterGroups`; a pattern that matches
            no captured parameter is refused when the engine attaches, before the first
            step's forward).
        normalize_layers: each layer's gradient unit-normalized per example before the dot.
        layers, include, exclude, last_n_blocks, projection, k_a, k_g, k,
            projection_map, seed: keyword-only, the layer and projection options of
            :class:`~tda_plugins.session.settings.LayerOptions` and
            :class:`~tda_plugins.session.settings.ProjectionOptions` (default layers,
            ``"auto"``: the linear layers of a full model).
    """

    queries: PoolTokens
    method: Literal["graddot", "gradcos"] = "gradcos"
    every_n_steps: int = 1
    top_k: int = 5
    report_dir: str | None = None
    tokenizer: Any = None
    exclude_params: tuple[str, ...] = ()
    normalize_layers: bool = False

    def __post_init__(self) -> None:
        if self.every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {self.every_n_steps}")
        self._layers = LayerSettings(self.layer_selection(), projection=self.projection_config())
        self._decode = _decoder(self.tokenizer)
        pool_batch(self.queries)  # refuses bad queries now, before any training
        #: The scores so far (replaced at the first step by one that gathers over ranks).
        self.influence_log = InfluenceLogger(
            self.method,
            OneProcess(),
            exclude_params=self.exclude_params,
            normalize_layers=self.normalize_layers,
        )
        #: The report's files, by kind (``json``, ``html``, ``png``), once written.
        self.report: dict[str, Path] = {}
        self._engine: CaptureEngine | None = None
        self._train_module: TransformerTrainModule | None = None
        self._query_batch: dict[str, Tensor] = {}
        self._query_losses = partial(summed_token_losses, ignore_index=-100)
        self._ids_hook: RemovableHandle | None = None
        self._batch_has_index = False
        #: The log a loaded checkpoint held, given to the logger at the first step.
        self._loaded: dict[str, Tensor] | None = None

    # -- OLMo-core events --------------------------------------------------------------

    def pre_train(self) -> None:
        self._check_setup()
        self._report_directory()

    def pre_step(self, batch: dict[str, Any]) -> None:
        if self._engine is None:
            # Attached here, after OLMo-core's dry-run batch (random tokens, no step).
            self._engine = self._attach()
        self._batch_has_index = "index" in batch
        step = self.trainer.global_step
        # the store's 0-based numbering, as every engine; reports show step + 1, the trainer's
        self._engine.resume_at_step(step - 1)
        if (step - 1) % self.every_n_steps:
            self.influence_log.set_queries(None)
            return
        self.influence_log.set_queries(self._query_gradients(), self._learning_rate())

    def pre_optim_step(self) -> None:
        if self._engine is not None:
            self._engine.optimizer_step()

    def post_step(self) -> None:
        """Every callback has edited ``.grad`` by now: leave out of the step's influence the
        instances a ``DataSelectionCallback`` dropped (they did not train), then credit the
        step and record its metrics."""
        if self._engine is None:
            return
        self._leave_out_dropped()
        # credits the step, unless a checkpoint did; none if not scored or none trained
        for name, value in self.influence_log.metrics(self.trainer.global_step - 1).items():
            # gathered over the ranks already: the same value on every rank
            self.trainer.record_metric(name, value, reduce_type=None)

    def post_train(self) -> None:
        if self._engine is None:
            return
        self._engine.end()  # every rank: the end gathers the report's token ids
        self._release()
        if self.influence_log.gather.rank == 0:
            self._write_report()

    def state_dict(self) -> dict[str, Any]:
        """Called as OLMo-core takes a checkpoint (saved in its per-rank trainer state): the
        influence log so far (:meth:`~tda_plugins.live.influence.InfluenceLogger.state`),
        so that a run resumed from it reports every step; empty before the first step."""
        if self._engine is None:
            return {}
        self._leave_out_dropped()  # OLMo-core checkpoints before post_step
        return {"influence_log": self.influence_log.state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint was loaded: keep its log for the logger (made at the first step)."""
        self._loaded = state_dict.get("influence_log")

    def close(self) -> None:
        """Always runs as ``fit`` exits: after an error, unhook without a report."""
        self._release()

    # -- helpers -----------------------------------------------------------------------

    def _leave_out_dropped(self) -> None:
        """Leave out of the latest scored step the instances a ``DataSelectionCallback``
        in this trainer dropped from ``.grad`` (decided at its ``pre_optim_step``)."""
        for callback in self.trainer.callbacks.values():
            if isinstance(callback, DataSelectionCallback) and callback.history:
                outcome = callback.history[-1]
                self.influence_log.leave_out(outcome.step, outcome.example_ids, outcome.untrained())

    def _check_setup(self) -> nn.Module:
        train_module = self.trainer.train_module
        model = check_train_module(train_module, self._layers.selection)
        assert isinstance(train_module, TransformerTrainModule)  # checked above
        self._train_module = train_module
        return model

    def _attach(self) -> CaptureEngine:
        model = self._check_setup()
        assert self._train_module is not None  # set by the check
        ignore_index = int(self._train_module.label_ignore_index)
        self._query_batch = pool_batch(self.queries, ignore_index)
        self._query_losses = partial(summed_token_losses, ignore_index=ignore_index)
        self.influence_log = self.influence_log.over(rank_gather())
        if self._loaded is not None:
            self.influence_log.restore(self._loaded)
        engine = CaptureEngine(
            model,
            layers=self._layers.selection,
            projection=self._layers.projection,
            consumers=[self.influence_log],
            normalization=OLMoCoreLossNormalization(),
        ).attach()
        warn_uncaptured(model, engine.captured_layers, "the logged influence scores")
        warn_dropout(model, "the logged influence scores")
        self._ids_hook = before_each_forward(model, self._give_example_ids)
        return engine

    def _query_gradients(self) -> MicroBatchRecord:
        """The ``M`` queries' own gradients at the current weights, in eval mode, recorded
        by no training engine, with the step's ``.grad`` set aside and restored. Replicated
        parameters (DDP) keep it out of the gradient all-reduce; sharded ones (FSDP, HSDP)
        join FSDP's collectives, as every rank runs the same pass."""
        assert self._engine is not None  # attached at the first step
        model = self._engine.model
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in self._query_batch.items()}
        sharded = is_sharded(self._engine.captured_layers)
        with evaluating(model), nullcontext() if sharded else without_gradient_sync(model):
            return capture_batch(
                model,
                batch,
                self._query_losses,
                self._layers.selection,
                self._layers.projection,
            )

    def _learning_rate(self) -> float:
        """The coming step's learning rate (first parameter group): what the train module's
        scheduler sets in ``optim_step``, after this event (computed on a copy of the
        group; the trainer has counted the step and its tokens already), or the group's."""
        assert self._train_module is not None
        optim = self._train_module.optim
        assert optim is not None  # only an eval-only train module has none; it never steps
        group = optim.param_groups[0]
        scheduler = self._train_module.scheduler
        if scheduler is None:
            return float(group["lr"])
        return float(scheduler.set_lr(dict(group), self.trainer))

    def _give_example_ids(self, module: nn.Module, kwargs: dict[str, Any]) -> None:
        if self._engine is not None and torch.is_grad_enabled():
            give_example_ids(self._engine, module, kwargs, self._batch_has_index)

    def _report_directory(self) -> Path:
        if self.report_dir is not None:
            return Path(self.report_dir)
        save_folder = str(self.trainer.save_folder)
        if is_url(save_folder):
            raise UnsupportedTrainingSetup(
                f"the influence report is written to local files, but save_folder "
                f"{save_folder!r} is remote; set report_dir to a local folder"
            )
        return Path(save_folder) / "influence"

    def _write_report(self) -> None:
        rows = pool_rows(self.queries)
        query_ids = torch.arange(len(rows))
        train_texts, query_texts = self.influence_log.report_texts(query_ids, rows, self._decode)
        self.report = self.influence_log.write_report(
            self._report_directory(), query_ids, train_texts, query_texts, self.top_k
        )

    def _release(self) -> None:
        if self._engine is not None:
            self._engine.detach()
        if self._ids_hook is not None:
            self._ids_hook.remove()
        self._engine = None
        self._ids_hook = None


def _decoder(tokenizer: Any) -> Decode | None:
    """The report's ``token ids -> text``: a tokenizer's ``decode``, or the callable itself."""
    if tokenizer is None:
        return None
    decode = getattr(tokenizer, "decode", None)
    if callable(decode):
        return decode
    if callable(tokenizer):
        return tokenizer
    raise TypeError(
        f"tokenizer must have a decode method (a Hugging Face tokenizer) or be a callable "
        f"from token ids to text, got {type(tokenizer).__name__}"
    )
