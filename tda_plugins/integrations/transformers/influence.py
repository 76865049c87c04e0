"""``InfluenceLoggingCallback``: live influence of each step's examples on fixed queries."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from tda_plugins.capture import MicroBatchRecord
from tda_plugins.integrations.transformers.best_model import (
    RestoredCheckpoint,
    restored_checkpoint,
)
from tda_plugins.integrations.transformers.data import Examples
from tda_plugins.integrations.transformers.meeting import latest_selection, withdraw
from tda_plugins.integrations.transformers.pool import PoolCallback
from tda_plugins.integrations.transformers.setup import (
    TrainStart,
    checkpoint_folder,
    process_index,
    resumed_checkpoint,
)
from tda_plugins.live.influence import InfluenceLogger
from tda_plugins.live.resume import read_state, warn_not_restored, write_state
from tda_plugins.parallel.gather import OneProcess, rank_gather

logger = logging.getLogger(__name__)


class InfluenceLoggingCallback(PoolCallback):
    """Logs, during SFT, how each step's examples influence a fixed set of query examples.

    Every ``every_n_steps`` optimizer steps it computes the queries' gradients at the
    current weights (no training engine records that pass), scores the step's
    examples against them from the training backward itself, and adds
    ``influence/q<j>_mean`` and ``influence/q<j>_max`` to the trainer's logs (console,
    ``state.log_history``; for ``report_to`` integrations, add it with
    :meth:`add_to` so it runs before them). At the end it writes ``influence.json``,
    ``influence.html`` (running top-k helpful/harmful examples with their texts) and
    ``influence.png`` to ``report_dir`` (default ``<output_dir>/influence``). Each
    checkpoint holds the log so far (:mod:`tda_plugins.live.resume`), so a run resumed from
    it reports every step, as an uninterrupted run does.

    Data-parallel runs (DDP, FSDP2): every rank computes the queries' gradients itself
    (its own examples are scored on it, against every query), the ranks' scores are
    gathered at each scored step, so the logged metrics are those of the whole global
    batch and the same on every rank, and rank 0 alone writes one report covering every
    rank's examples.

    Args:
        queries: a JSONL path, a ``datasets.Dataset`` or a list of dicts, each with
            ``input_ids`` (and optional ``labels``, -100 = no loss), or ``text``,
            ``prompt`` + ``completion`` or ``messages`` (tokenized with the trainer's
            tokenizer and its loss switches when training starts); an integer ``id`` on
            every row names the queries in the report (else content hashes of their
            tokens: queries of the same tokens are then refused).
        method: ``"gradcos"`` or ``"graddot"``.
        every_n_steps: score every n-th optimizer step.
        top_k: examples per query in the report.
        report_dir: where the report goes.
        exclude_params: parameter name patterns left out of the scores (``("bias",)``:
            :class:`~tda_plugins.methods.groups.ParameterGroups`; a pattern that matches
            no captured parameter is refused at ``on_train_begin``).
        normalize_layers: each layer's gradient unit-normalized per example before the dot.
        **options: the layer and projection options of
            :func:`~tda_plugins.session.settings.layer_settings` (``layers``, ``include``,
            ``projection``, ``k_a``, ...).
    """

    def __init__(
        self,
        queries: Examples,
        *,
        method: Literal["graddot", "gradcos"] = "gradcos",
        every_n_steps: int = 1,
        top_k: int = 5,
        report_dir: str | None = None,
        exclude_params: str | Sequence[str] = (),
        normalize_layers: bool = False,
        **options: Any,
    ):
        super().__init__(queries, every_n_steps, options)
        self.method = method
        self.exclude_params = exclude_params
        self.normalize_layers = normalize_layers
        self.influence_log = InfluenceLogger(
            self.method,
            OneProcess(),
            exclude_params=self.exclude_params,
            normalize_layers=self.normalize_layers,
        )
        self.top_k = top_k
        self.report_dir = report_dir
        self.report: dict[str, Path] = {}
        #: ``(M,)`` the queries' ids (their ``id``s, else content hashes), at train begin.
        self.query_ids = torch.zeros(0, dtype=torch.long)

    def begin(self, start: TrainStart) -> None:
        self.influence_log = self.influence_log.over(rank_gather())
        self.attach(start).add_consumer(self.influence_log)
        self.query_ids = self.examples.ids(self.pool)
        duplicate = _first_duplicate(self.query_ids.tolist())
        if duplicate is not None:
            first, repeated = duplicate
            raise ValueError(
                f"queries q{first} and q{repeated} are the same tokens, so they would share "
                "one id and one column of the report: drop one, or give every query an 'id'"
            )
        checkpoint = resumed_checkpoint(start.args, start.state)
        if checkpoint is not None:
            saved = read_state(checkpoint, process_index(start.args))
            if saved is None:
                warn_not_restored(checkpoint, start.state.global_step)
            else:
                self.influence_log.restore(saved)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The trainer has just saved ``checkpoint-<global_step>``: save the influence log
        in it (one file per rank), so that a run resumed there reports every step."""
        if self.engine is not None:
            folder = checkpoint_folder(args, state.global_step)
            write_state(self.influence_log, folder, process_index(args))

    def use_pool(self, pooled: MicroBatchRecord | None, lr_scheduler: Any) -> None:
        rate = float(lr_scheduler.get_last_lr()[0]) if lr_scheduler is not None else 1.0
        self.influence_log.set_queries(pooled, rate)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Every callback has edited ``.grad`` by now: leave out of the step's influence
        the examples a ``DataSelectionCallback`` on the model dropped (they did not train)."""
        model = kwargs.get("model")
        outcome = None if model is None else latest_selection(model)
        if outcome is not None:
            self.influence_log.leave_out(outcome.step, outcome.example_ids, outcome.untrained())

    def step_metrics(self, step: int) -> dict[str, float]:
        return self.influence_log.metrics(step)

    def _end_at(self, restored: RestoredCheckpoint, rank: int, last_step: int) -> None:
        """End the report at the checkpoint the trainer restored: the log it saved there
        (the cumulative scores of the model the run ends with; the trainer's own logs keep
        the later steps' metrics)."""
        saved = read_state(restored.path, rank)
        if saved is None:
            logger.warning(
                "tda-plugins: load_best_model_at_end restored %s, which holds no influence log, "
                "so the influence report covers all %d steps, the %d after it included",
                restored.path.name,
                last_step,
                last_step - restored.step,
            )
            return
        self.influence_log.restore(saved)
        logger.warning(
            "tda-plugins: load_best_model_at_end restored %s: the influence report ends there, "
            "with the model the run ends with (steps 1..%d of %d; the trainer's logs keep the "
            "metrics of the later ones)",
            restored.path.name,
            restored.step,
            last_step,
        )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        withdraw(kwargs.get("model"), self.abort)
        if self.engine is None:
            return
        restored = restored_checkpoint(args, state)
        if restored is not None:  # load_best_model_at_end put earlier weights back
            self._end_at(restored, process_index(args), state.global_step)
        self.detach()  # every rank: the end gathers the report's token ids
        if self.influence_log.gather.rank != 0:
            return
        query_ids = self.query_ids
        query_tokens = [
            ids[m.bool()].tolist()
            for ids, m in zip(self.pool["input_ids"], self.pool["attention_mask"], strict=True)
        ]
        train_texts, query_texts = self.influence_log.report_texts(
            query_ids, query_tokens, getattr(kwargs.get("processing_class"), "decode", None)
        )
        directory = self.report_dir or str(Path(str(args.output_dir)) / "influence")
        self.report = self.influence_log.write_report(
            directory, query_ids, train_texts, query_texts, self.top_k
        )


def _first_duplicate(ids: list[int]) -> tuple[int, int] | None:
    """``(j, k)``: the first position ``k`` whose id an earlier position ``j`` has
    (``None``: every id differs)."""
    seen: dict[int, int] = {}
    for k, i in enumerate(ids):
        if i in seen:
            return seen[i], k
        seen[i] = k
    return None
