"""GradDot and GradCos of a dataset against queries in one call, with no store.

    from tda_plugins import score_examples

    scores = score_examples(model, train_rows, query_rows, tokenizer=tokenizer)
    scores.top_k(5)

The queries are captured first and prepared once (:class:`~tda_plugins.live.queries.
QueryCollector`); each training batch is then scored against all of them as its own
backward finishes (:func:`~tda_plugins.live.queries.score_record`), and its per-example
gradients are dropped. Nothing is written and no training gradient outlives its batch:
the cheapest exact path when the queries are known before the training rows are read
(the store is for scoring queries that come later, and for the methods that need the
whole training set first: K-FAC, EK-FAC, LoGra, TracIn over checkpoints). Scores follow
the store's convention (each example's own summed token loss) and equal ``attribute``'s
on stores captured from the same rows. It runs in one process: under ``torchrun``, where
every rank would score every row, ``capture_examples`` deals the batches over the ranks
and ``attribute`` splits the scoring.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tda_plugins.capture import CaptureConsumer, CaptureEngine, MicroBatchRecord
from tda_plugins.capture.layers import warn_uncaptured, with_adapters_trainable
from tda_plugins.live.queries import (
    QueryCollector,
    QueryGradients,
    refuse_tied_cosine,
    score_record,
)
from tda_plugins.methods.scores import Scores
from tda_plugins.session.dataset import (
    PlannedBatch,
    backward_each_example,
    example_texts,
    loss_tokens,
    plan_batches,
    require_causal_lm,
    truncation_length,
)
from tda_plugins.session.settings import LayerSettings, layer_settings

#: The methods scored this way, and whether each is a cosine.
LIVE_METHODS = {"graddot": False, "gradcos": True}


class _Scored(CaptureConsumer):
    """Scores each finished training batch against the prepared queries."""

    def __init__(self, queries: QueryGradients, cosine: bool):
        self.queries = queries
        self.cosine = cosine
        self.blocks: list[Tensor] = []

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        self.blocks.append(score_record(record, self.queries, self.cosine).cpu())


@with_adapters_trainable
def score_examples(
    model: Any,
    train: Any,
    queries: Any,
    *,
    tokenizer: Any = None,
    method: str = "graddot",
    batch_size: int = 8,
    max_length: int | None = None,
    eos: bool | None = None,
    progress: bool = True,
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool | None = None,
    **options: Any,
) -> Scores:
    """Score every training example against every query, exactly, without a store.

    Args:
        model: a transformers causal LM (a PEFT model: its adapters by default); its
            weights are the ones both sides are taken at.
        train: the training examples: a JSONL path, a ``datasets.Dataset`` or a list of
            dicts, in any row form ``capture_examples`` takes (optional integer ``id``,
            else a content hash of the tokens).
        queries: the query examples, likewise.
        tokenizer: tokenizes text rows; the scores keep both sides' texts.
        method: ``"graddot"`` (``<g_query, g_train>``) or ``"gradcos"`` (its cosine).
        batch_size: examples per forward/backward.
        max_length: truncate examples to this many tokens (default: the model's
            positions).
        eos: end text and completion rows in the end-of-sequence token, as TRL's
            ``SFTTrainer`` trains them (default off).
        progress: show a progress bar.
        completion_only_loss: a prompt-completion row's loss on its completion alone
            (default, as TRL's ``SFTConfig``); ``False``: on every token.
        assistant_only_loss: a conversation's loss on the assistant's tokens alone (TRL's
            ``SFTConfig.assistant_only_loss``; default off).
        options: the layer and projection options (``layers``, ``include``, ``exclude``,
            ``last_n_blocks``, ``projection``, ``k_a``, ...), as ``capture_examples``.

    Returns:
        ``Scores`` of shape ``(N_train, N_queries)``: ``top_k``, ``to_pandas``, ``save``.

    Raises:
        ValueError: an unknown method, a bad row (named by its line), a repeated id, or
            ``gradcos`` over layers that share a weight (a head tied to the input
            embedding with ``layers="all"``; ``graddot`` counts it once), before any
            forward runs; a score that is not finite (a NaN or inf in the model's forward
            or gradients), naming its pair.
        TypeError: a model that is not a transformers causal LM (an OLMo-core
            ``Transformer``), before any forward.
    """
    require_causal_lm(model, "score_examples")
    if method not in LIVE_METHODS:
        raise ValueError(
            f"score_examples scores {sorted(LIVE_METHODS)}, not {method!r}; for the others "
            "capture a store (capture_examples) and call attribute"
        )
    settings = layer_settings(**options)
    warn_uncaptured(model, settings.selection.resolve(model), "the scores", settings.uncaptured_fix)
    loss = loss_tokens(completion_only_loss, assistant_only_loss, eos=eos)
    plan = (batch_size, truncation_length(model, max_length), loss)  # warned once
    query_batches = plan_batches(model, queries, tokenizer, *plan)
    train_batches = plan_batches(model, train, tokenizer, *plan)
    total = sum(len(b.examples) for b in query_batches + train_batches)
    with tqdm(total=total, desc=f"{method} scores", unit="ex", disable=not progress) as bar:
        cosine = LIVE_METHODS[method]
        collector = QueryCollector(sum(len(b.examples) for b in query_batches))
        _captured(model, settings, query_batches, collector, bar, cosine)
        scored = _Scored(collector.gradients(), cosine)
        del collector
        _captured(model, settings, train_batches, scored, bar, cosine)
    scores = Scores(
        torch.cat([b.ids for b in train_batches]),
        torch.cat([b.ids for b in query_batches]),
        torch.cat(scored.blocks).float(),  # fp32, as attribute's
        method,
        train_texts=example_texts(train_batches),
        query_texts=example_texts(query_batches),
    )
    scores.require_finite()
    return scores


def _captured(
    model: Any,
    settings: LayerSettings,
    planned: list[PlannedBatch],
    consumer: CaptureConsumer,
    bar: tqdm,
    cosine: bool,
) -> None:
    """Each batch's captured backward into ``consumer``, one engine step per batch
    (autograd builds no weight gradient of the model's own). A tied weight among the
    layers is scored once by the queries' :class:`QueryCollector`, and refused by a
    ``cosine`` before any forward."""
    engine = CaptureEngine(
        model,
        layers=settings.selection,
        projection=settings.projection,
        consumers=[consumer],
        parameter_grads=False,
    )
    with engine:
        if cosine:
            refuse_tied_cosine(engine.config.tied, "score")
        for batch in planned:
            backward_each_example(model, engine, batch)
            engine.optimizer_step()
            bar.update(len(batch.examples))
        engine.end()
