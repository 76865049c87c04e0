"""Per-example gradients of a dataset outside training: what ``tda capture`` runs.

    from tda_plugins import capture_examples

    capture_examples(model, "queries.jsonl", "run/queries", tokenizer=tokenizer)
    capture_examples(trainer.model, Dataset.from_list(rows), "run/queries", tokenizer=tok)

One forward and backward per batch of each example's own summed token loss (the store
convention), through a capture engine whose consumers write the store (and the K-FAC
statistics); autograd builds no weight gradient of the model's own. Under ``torchrun``
(``ranks``), every rank reads and checks all the data and captures the batches
``rank, rank + N, ...`` (a full model replica each) into its ``rank-<r>`` directory, one
store step per round of N batches: the merged store equals one process's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor
from tqdm.auto import tqdm

from tda_plugins.capture import CaptureEngine, content_hash
from tda_plugins.capture.layers import (
    LayerSelectionError,
    lora_adapter_names,
    warn_uncaptured,
    with_adapters_trainable,
)
from tda_plugins.capture.names import named_modules
from tda_plugins.parallel.ranks import Ranks
from tda_plugins.precondition import CurvatureAccumulator
from tda_plugins.precondition.snapshots import latest_set
from tda_plugins.session.batch import causal_lm_example_losses
from tda_plugins.session.capture import resolve_curvature
from tda_plugins.session.settings import (
    LAYER_OPTION_NAMES,
    PROJECTION_OPTION_NAMES,
    CaptureSettings,
    LayerSettings,
    settings_from,
)
from tda_plugins.store import GradientStore, StoreReader
from tda_plugins.store.layout import LOSS_TOKENS
from tda_plugins.store.texts import TokenTexts, token_texts

if TYPE_CHECKING:
    from tda_plugins.integrations.transformers.data import LossTokens

logger = logging.getLogger(__name__)

#: Shard bytes a one-pass capture lets wait for the disk before it waits itself.
IN_FLIGHT_BYTES = 256 * 2**20


@with_adapters_trainable
def capture_examples(
    model: Any,
    examples: Any,
    out: str | Path,
    *,
    tokenizer: Any = None,
    settings: CaptureSettings | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    append: bool = False,
    metadata: dict[str, Any] | None = None,
    ranks: Ranks | None = None,
    progress: bool = True,
    eos: bool | None = None,
    durability: str = "end",
    wait_durable: bool = False,
    like: str | Path | StoreReader | None = None,
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool | None = None,
    **options: Any,
) -> StoreReader:
    """Write every example's exact gradient (its own summed token loss) to the store ``out``.

    Args:
        model: a transformers causal LM (a PEFT model: its adapters are captured by
            default, the layers a LoRA training store holds).
        examples: a JSONL path, a ``datasets.Dataset`` or a list of dicts; each row
            ``text``, ``prompt`` + ``completion``, ``messages`` or ``input_ids`` (optional
            ``labels``), with an optional integer ``id`` (else a content hash of its tokens).
        out: the store directory to create (or, with ``append``, to add to).
        tokenizer: tokenizes text rows and decodes the stored texts.
        settings: what to record (its store's directory is replaced by ``out``); or give its flat
            options as ``options`` (``layers``, ``projection``, ``curvature``, ...).
        batch_size: examples per forward/backward.
        max_length: truncate examples to this many tokens (default: with ``like``, the
            run's ``max_length`` where it cut rows; the model's positions, and at most
            those; 512 for a model without a positions limit).
        append: add to an existing store of the same model and options.
        metadata: free-form entries for ``store.json``.
        ranks: the ranks of a ``torchrun`` launch (``None``: this process alone).
        progress: show a progress bar (rank 0).
        eos: end text and completion rows in the tokenizer's end-of-sequence token, as
            TRL's ``SFTTrainer`` does: a row copied from an SFT training set then gets the
            tokens (and the content-hash id) it was trained with (default: as the store
            ``like`` records its run, an ``SFTTrainer``'s on; else off).
        durability: when the store reaches the disk (:class:`GradientStore`'s modes).
            ``"end"`` (default): no fsync while capturing; when the capture returns, one
            pass on a thread of its own makes every file durable while the caller goes on
            (scoring the new store reads the page cache), and the process waits for it
            at exit. ``"step"``: each step durable before the next is captured (a
            capture whose machine may crash midway, resumed with ``append``). ``"none"``:
            never fsynced (a scratch store scored and thrown away).
        wait_durable: return only once the ``"end"`` pass is done, raising its failure
            (``StoreError``), for a caller whose success must mean the store is on disk
            (``tda capture``'s exit status); else a failure of it is logged.
        like: a gradient store (the training store, for its queries) whose layers, by
            name, and projection to capture with, in place of the layer and projection
            settings (which are then refused); the model must have every one of those
            layers, trainable. K-FAC statistics are then off unless ``curvature=True``.
            Rows are then scored on the tokens the store's run trained on (the switches
            below, as the store records them) unless the switches are given.
        completion_only_loss: a prompt-completion row's loss on its completion alone
            (default, as TRL's ``SFTConfig``); ``False``: on every token.
        assistant_only_loss: a conversation's loss on the assistant's tokens alone (TRL's
            ``SFTConfig.assistant_only_loss``; default off: every token). The store records
            both (``loss_tokens`` in its metadata).

    Returns:
        A reader of the written store.

    Raises:
        ValueError: a bad row (named by its line), a repeated id, or K-FAC statistics over
            ``settings.curvature_budget_gb``; nothing is written then.
        TypeError: a model that is not a transformers causal LM (an OLMo-core
            ``Transformer``), before anything is written.
    """
    require_causal_lm(model, "capture_examples")
    ranks = ranks or Ranks(next(model.parameters()).device)
    if settings is None:
        settings = settings_from(None, {**options, "store_dir": str(out)})
    else:
        settings = settings_from(settings, options)
        written = dataclasses.replace(settings.store, directory=str(out))
        settings = dataclasses.replace(settings, store=written)
    if like is not None:
        settings = settings_like(settings, options, like, model)
    loss = loss_tokens(completion_only_loss, assistant_only_loss, like, eos, max_length)
    # every batch and its ids first: bad rows and ids are refused before any write
    planned = plan_batches(model, examples, tokenizer, batch_size, max_length, loss)
    all_ids = [i for batch in planned for i in batch.ids.tolist()]
    settings, plan = resolve_curvature(settings, model, ranks.rank)
    if settings.curvature and ranks.size > 1 and plan.schedule != "local":
        raise ValueError(
            "the K-FAC statistics do not fit one process's budget, and a data-parallel "
            "capture reduces them only at its end: raise curvature_budget_gb "
            "(--curvature-budget-gb), capture fewer layers, or turn curvature off"
        )
    store = GradientStore(
        out,
        ranks.rank,
        keep_tokens=settings.store.keep_tokens,
        metadata={**(metadata or {}), LOSS_TOKENS: loss.as_json()},
        append=append,
        unique_ids=True,
        model=model,
        tokenizer=tokenizer,
        in_flight_bytes=IN_FLIGHT_BYTES,  # a slow disk stalls the capture only when full
        durability=durability,
    )
    if settings.curvature and append:
        _refuse_uncovered_steps(Path(out), store)
    curvature = (
        CurvatureAccumulator(
            out,
            ranks.rank,
            shapes=plan.curvature_shapes,
            excluded=plan.excluded,
            world_size=plan.inputs.world_size,
            schedule=plan.schedule,
            durability=durability,
        )
        if settings.curvature
        else None
    )
    consumers: list[Any] = [store] if curvature is None else [store, curvature]
    # capture only attributes: autograd need not build the model's own weight gradients
    engine = CaptureEngine(
        model,
        layers=settings.layers.selection,
        projection=settings.layers.projection,
        consumers=consumers,
        parameter_grads=False,
    )
    mine = planned[ranks.rank :: ranks.size]
    if ranks.rank != 0:
        ranks.barrier()  # rank 0 attaches first: it writes the store's header
    shown = progress and ranks.rank == 0
    examples_count = sum(len(batch.examples) for batch in planned)
    with (
        engine,
        tqdm(total=examples_count, desc="capture", unit="ex", disable=not shown) as bar,
    ):
        if ranks.rank == 0:
            ranks.barrier()
            if like is None:  # like= captures the store's layers, whatever else trains
                warn_uncaptured(
                    model,
                    engine.captured_layers,
                    "the store's rows",
                    settings.layers.uncaptured_fix,
                )
        store.check_new_ids(all_ids)  # against the examples an appended store holds
        # appending continues the numbering after every rank's last step
        engine.resume_at_step(max(ranks.objects(store.next_step)))
        texts_due = ranks.rank == 0
        for batch in mine:
            backward_each_example(model, engine, batch)
            engine.optimizer_step()  # one committed store step per batch (per round)
            if texts_due:  # once the capture has begun: a killed one keeps every text
                _write_texts(store, planned, tokenizer, settings.store.keep_tokens)
                texts_due = False
            bar.update(len(batch.examples) * ranks.size)
        engine.end()
    ranks.barrier()  # every rank's steps are committed
    if texts_due:
        _write_texts(store, planned, tokenizer, settings.store.keep_tokens)
    if wait_durable:
        store.flush()
        if curvature is not None:
            curvature.flush()
    return StoreReader(out)


def _write_texts(
    store: GradientStore, planned: list[PlannedBatch], tokenizer: Any, keep_tokens: bool
) -> None:
    """Every planned example's text (and tokens, ``keep_tokens``) into the store."""
    store.write_examples(
        example_texts(planned), _tokens(planned, tokenizer) if keep_tokens else None
    )


@dataclass
class PlannedBatch:
    """One padded batch of examples and their ids, ready for a captured backward.

    Attributes:
        inputs: ``input_ids``, ``attention_mask``, ``labels`` (``(B, T)``, on the CPU).
        ids: ``(B,)`` example ids: the rows' ``id``, else content hashes of the tokens.
        examples: the tokenized rows (their texts).
    """

    inputs: dict[str, Tensor]
    ids: Tensor
    examples: list[Any]


def plan_batches(
    model: Any,
    examples: Any,
    tokenizer: Any,
    batch_size: int,
    max_length: int | None,
    loss: LossTokens | None = None,
) -> list[PlannedBatch]:
    """Every row of ``examples`` tokenized and batched, with its id, its loss on the tokens
    ``loss`` says (default: TRL's defaults); a bad row (named by its line) or an id met
    twice is refused before any forward runs."""
    from tda_plugins.integrations.transformers.data import batches, numbered_rows, tokenize_rows

    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"batch_size must be an integer of 1 or more, got {batch_size!r}")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    source = str(examples) if isinstance(examples, str | Path) else "examples"
    loss = loss or loss_tokens(None, None)
    numbered = list(numbered_rows(examples))
    rows = tokenize_rows(
        numbered,
        tokenizer,
        truncation_length(model, loss.truncation(max_length)),
        vocab,
        source,
        loss,
    )
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    planned = []
    for inputs, given, group in batches(rows, batch_size, pad_id):
        mask = inputs["attention_mask"]
        ids = content_hash(inputs["input_ids"], mask) if given is None else given
        planned.append(PlannedBatch(inputs, ids, group))
    all_ids = [i for batch in planned for i in batch.ids.tolist()]
    repeated = next((i for i, n in Counter(all_ids).items() if n > 1), None)
    if repeated is not None:
        lines = [numbered[k][0] for k, i in enumerate(all_ids) if i == repeated]
        raise ValueError(
            f"{source}: rows {lines[0]} and {lines[1]} have the same example id {repeated}: give "
            "each example its own 'id' (without ids, rows whose tokens are the same get the "
            "same content hash)"
        )
    return planned


def loss_tokens(
    completion_only_loss: bool | None,
    assistant_only_loss: bool | None,
    like: str | Path | StoreReader | None = None,
    eos: bool | None = None,
    max_length: int | None = None,
) -> LossTokens:
    """Which tokens a row has and which carry its loss: the switches (and the cut) given,
    the others as the store ``like`` records them (its run's), else TRL's defaults
    (``eos`` off, no cut)."""
    from tda_plugins.integrations.transformers.data import LossTokens

    base = LossTokens()
    if like is not None:
        store = like if isinstance(like, StoreReader) else StoreReader(like)
        base = LossTokens.from_json(store.metadata.get(LOSS_TOKENS))
    return dataclasses.replace(
        base,
        completion_only_loss=(
            base.completion_only_loss if completion_only_loss is None else completion_only_loss
        ),
        assistant_only_loss=(
            base.assistant_only_loss if assistant_only_loss is None else assistant_only_loss
        ),
        completion_mask=(
            base.completion_mask if completion_only_loss is None else completion_only_loss
        ),
        eos=base.eos if eos is None else eos,
        max_length=base.max_length if max_length is None else max_length,
        keep_end=base.keep_end if max_length is None else False,
    )


def require_causal_lm(model: Any, call: str) -> None:
    """Refuse, before anything is read or written, a model that is not a transformers
    causal LM (``call``: the function refusing, for the message)."""
    if not callable(getattr(model, "get_input_embeddings", None)):
        raise TypeError(
            f"{call} takes a transformers causal LM (get_input_embeddings, a forward that "
            f"returns .logits), not {type(model).__name__}; for an OLMo-core Transformer, "
            "capture with CaptureEngine around its own forward and loss, as "
            "recipes/olmo_core_capture.py does for its queries"
        )


def backward_each_example(model: Any, engine: CaptureEngine, batch: PlannedBatch) -> None:
    """One forward and backward of the batch's summed per-example token losses (each
    example's own summed loss: the store convention) under ``engine``'s hooks; the
    model's own gradients are cleared after."""
    device = model.get_input_embeddings().weight.device
    inputs = {k: v.to(device) for k, v in batch.inputs.items()}
    engine.set_example_ids(batch.ids.to(device))
    labels = inputs.pop("labels")
    causal_lm_example_losses(model(**inputs).logits, labels).sum().backward()
    model.zero_grad(set_to_none=True)


def example_texts(planned: list[PlannedBatch]) -> dict[int, str]:
    """Example id -> its text."""
    return {
        i: e.text
        for batch in planned
        for i, e in zip(batch.ids.tolist(), batch.examples, strict=True)
    }


def _tokens(planned: list[PlannedBatch], tokenizer: Any) -> dict[int, TokenTexts] | None:
    """Each example's tokens (for token-level scores), where a tokenizer can decode them."""
    if not callable(getattr(tokenizer, "decode", None)):
        return None
    return {
        i: pieces
        for batch in planned
        for i, pieces in zip(
            batch.ids.tolist(),
            token_texts(tokenizer, batch.inputs["input_ids"], batch.inputs["attention_mask"]),
            strict=True,
        )
    }


def _refuse_uncovered_steps(root: Path, store: GradientStore) -> None:
    """Refuse, closing ``store``, to append K-FAC statistics to a store whose statistics
    do not cover the steps it holds (a capture stopped before it saved them at its end):
    the appended ones would cover the new examples alone, as if the others did not exist."""
    found = latest_set(root)
    covered = 0 if found is None else found.next_step
    if covered is None or covered >= store.next_step:
        return
    store.close()
    raise ValueError(
        f"{root} holds steps 0..{store.next_step - 1} but K-FAC statistics of "
        f"{'none of them' if covered == 0 else f'steps 0..{covered - 1} only'} (its capture "
        "stopped before it saved them at its end), so statistics appended now would leave "
        "those examples out: capture all the data again with curvature, or append with it "
        "off (--no-curvature; kfac, ekfac and logra then refuse the store)"
    )


def settings_like(
    settings: CaptureSettings, options: dict[str, Any], like: str | Path | StoreReader, model: Any
) -> CaptureSettings:
    """``settings`` with the layers and projection of the store ``like``
    (:meth:`LayerSettings.like`), and no K-FAC statistics unless asked for (queries need
    none); refused, before any work, when layer or projection options were given too or
    the model lacks (or freezes) one of those layers."""
    given = sorted(set(options) & (LAYER_OPTION_NAMES | PROJECTION_OPTION_NAMES))
    if given or settings.layers != LayerSettings():
        named = given or ["settings.layers"]
        raise ValueError(f"like= takes the layers and projection of its store; leave out {named}")
    store = like if isinstance(like, StoreReader) else StoreReader(like)
    layers = LayerSettings.like(store.config)
    try:
        found = layers.selection.resolve(model)
    except LayerSelectionError:  # not one of them
        found = {}
    missing = [name for name in store.config.layers if name not in found]
    stored, loaded = (
        lora_adapter_names(store.config.layers),
        lora_adapter_names(n for n, _ in named_modules(model)),
    )
    if missing and stored and loaded and not stored & loaded:
        name = sorted(stored)[0]
        raise ValueError(
            f"the store {store.root} holds the LoRA layers of the PEFT adapter {name!r}, the "
            f"model those of {sorted(loaded)}: load the adapter under its name "
            f"(PeftModel.from_pretrained(base, adapter_dir, adapter_name={name!r}, "
            "is_trainable=True); tda capture --like does)"
        )
    if missing:
        raise ValueError(
            f"the model has no trainable layer {missing[:3]} of the store {store.root} "
            f"({len(missing)} of its {len(store.config.layers)} missing): load the model the "
            "store was captured from (with its adapter, trainable), or capture without like="
        )
    # queries need no K-FAC statistics: "auto" does not weigh them up (or warn about them)
    curvature = False if settings.curvature == "auto" else settings.curvature
    return dataclasses.replace(settings, layers=layers, curvature=curvature)


def truncation_length(model: Any, max_length: int | None) -> int:
    """The truncation length: ``max_length``, at most the model's positions (warned)."""
    if max_length is not None and (type(max_length) is not int or max_length < 1):
        raise ValueError(f"max_length must be None or an integer of 1 or more, got {max_length!r}")
    positions = model_positions(model)
    length = max_length or positions or 512
    if positions is not None and length > positions:
        logger.warning(
            "tda-plugins: max length %d is more than the model's %d positions; examples are "
            "truncated to %d tokens",
            length,
            positions,
            positions,
        )
        length = positions
    return length


def model_positions(model: Any) -> int | None:
    """How many positions the model embeds (``None``: not bounded by its config)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
