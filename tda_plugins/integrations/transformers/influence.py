"""``InfluenceLoggingCallback``: live influence of each step's examples on fixed queries."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from torch import nn
from transformers import TrainerControl, TrainerState, TrainingArguments

from tda_plugins.capture import MicroBatchRecord, content_hash
from tda_plugins.distributed import OneProcess, RankGather, rank_gather
from tda_plugins.influence import InfluenceLogger
from tda_plugins.integrations.transformers.data import Examples
from tda_plugins.integrations.transformers.pool import PoolCallback
from tda_plugins.integrations.transformers.setup import check_trainer_setup


class InfluenceLoggingCallback(PoolCallback):
    """Logs, during SFT, how each step's examples influence a fixed set of query examples.

    Every ``every_n_steps`` optimizer steps it computes the queries' gradients at the
    current weights (no training engine records that pass), scores the step's
    examples against them from the training backward itself, and adds
    ``influence/q<j>_mean`` and ``influence/q<j>_max`` to the trainer's logs (console,
    ``state.log_history``; for ``report_to`` integrations, add it with
    :meth:`add_to` so it runs before them). At the end it writes ``influence.json``,
    ``influence.html`` (running top-k helpful/harmful examples with their texts) and
    ``influence.png`` to ``report_dir`` (default ``<output_dir>/influence``).

    Data-parallel runs (DDP, FSDP2): every rank computes the queries' gradients itself
    (its own examples are scored on it, against every query), the ranks' scores are
    gathered at each scored step, so the logged metrics are those of the whole global
    batch and the same on every rank, and rank 0 alone writes one report covering every
    rank's examples.

    Args:
        queries: a JSONL path, a ``datasets.Dataset`` or a list of dicts, each with
            ``input_ids`` (and optional ``labels``, -100 = no loss), or ``text``,
            ``prompt`` + ``completion`` or ``messages`` (tokenized with the trainer's
            tokenizer when training starts).
        method: ``"gradcos"`` or ``"graddot"``.
        every_n_steps: score every n-th optimizer step.
        top_k: examples per query in the report.
        report_dir: where the report goes.
        exclude_params: parameter name patterns left out of the scores (``("bias",)``:
            :class:`~tda_plugins.methods.groups.ParameterGroups`; a pattern that matches
            no captured parameter is refused at ``on_train_begin``).
        normalize_layers: each layer's gradient unit-normalized per example before the dot.
        **options: layer/projection fields of :class:`CaptureSettings` (``layers``,
            ``include``, ``projection``, ``k_a``, ...); ``store_dir`` is not used.
    """

    def __init__(
        self,
        queries: Examples,
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
        self.influence_log = self._logger(OneProcess())
        self.top_k = top_k
        self.report_dir = report_dir
        self.report: dict[str, Path] = {}

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        model = check_trainer_setup(args, model)
        self.influence_log = self._logger(rank_gather())
        self.attach(args, model, state, processing_class).add_consumer(self.influence_log)

    def _logger(self, gather: RankGather) -> InfluenceLogger:
        return InfluenceLogger(
            self.method,
            gather,
            exclude_params=self.exclude_params,
            normalize_layers=self.normalize_layers,
        )

    def use_pool(self, pooled: MicroBatchRecord | None, lr_scheduler: Any) -> None:
        rate = float(lr_scheduler.get_last_lr()[0]) if lr_scheduler is not None else 1.0
        self.influence_log.set_queries(pooled, rate)

    def step_metrics(self) -> dict[str, float]:
        return self.influence_log.metrics()

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.engine is None:
            return
        self.detach()  # every rank: the end gathers the report's token ids
        if self.influence_log.gather.rank != 0:
            return
        query_ids = content_hash(self.pool["input_ids"], self.pool["attention_mask"])
        query_tokens = [
            ids[m.bool()].tolist()
            for ids, m in zip(self.pool["input_ids"], self.pool["attention_mask"], strict=True)
        ]
        train_texts, query_texts = self.influence_log.report_texts(
            query_ids, query_tokens, getattr(processing_class, "decode", None)
        )
        directory = self.report_dir or str(Path(str(args.output_dir)) / "influence")
        self.report = self.influence_log.write_report(
            directory, query_ids, train_texts, query_texts, self.top_k
        )
