"""Real ``transformers``/TRL training runs on tiny models, and the oracle for what they store.

* :func:`token_rows`, :func:`prompt_completion_pairs`, :func:`word_tokenizer`: training
  data and a tokenizer built locally (no hub access).
* :func:`training_args`: the arguments every callback test trains with (CPU, fp32, no
  reporting, no checkpoints unless asked).
* :class:`RecordingCollator`: builds right-padded causal-LM batches and keeps each one, so
  a test knows which examples every micro-batch held and which labels it trained on.
* :class:`WeightSnapshots`: the model's weights at the start of every optimizer step.
* :func:`assert_store_matches_oracle`: every stored gradient against one fp64 backward of
  that example's own summed token loss at its step's weights (``tests.oracle``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import Tensor, nn
from transformers import PreTrainedTokenizerFast, TrainerCallback, TrainingArguments

from tda_plugins.capture import content_hash
from tda_plugins.capture.adapters import DEFAULT_REGISTRY
from tda_plugins.integrations.transformers import pad_examples
from tda_plugins.store import StoreReader
from tests.models import VOCAB
from tests.oracle import loop_oracle
from tests.stores import rel_error, store_parameter_names

PAD_ID = 0
EOS_ID = 1
#: Token ids of ordinary words (0 and 1 are the tokenizer's pad and end-of-sequence).
FIRST_WORD = 2
ROW_LENGTHS = (12, 9, 7, 11)
#: fp32 training against an fp64 oracle at the same weights.
FP32_TOL = 1e-4


# -- data ----------------------------------------------------------------------------------


def token_rows(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` distinct random token sequences, ``ROW_LENGTHS`` long in turn."""
    gen = torch.Generator().manual_seed(seed)
    rows = [
        torch.randint(FIRST_WORD, VOCAB, (ROW_LENGTHS[i % len(ROW_LENGTHS)],), generator=gen)
        for i in range(count)
    ]
    out = [r.tolist() for r in rows]
    assert len({tuple(r) for r in out}) == count, "rows must be distinct: ids are content hashes"
    return out


def words(ids: list[int]) -> str:
    """Token ids as text for :func:`word_tokenizer` (``"w5 w17 ..."``)."""
    return " ".join(f"w{i}" for i in ids)


@dataclass(frozen=True)
class PromptCompletion:
    """One prompt/completion text example and the tokens TRL should train it as."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]

    def row(self) -> dict[str, str]:
        """The dataset row TRL tokenizes (it appends ``</s>`` to the completion)."""
        return {
            "prompt": words(list(self.prompt)),
            "completion": " " + words(list(self.completion)),
        }

    def tokens(self) -> tuple[int, ...]:
        """The training sequence: prompt, completion, ``</s>``."""
        return (*self.prompt, *self.completion, EOS_ID)

    def labels(self) -> list[int]:
        """Completion-only loss: -100 on every prompt token."""
        return [-100] * len(self.prompt) + [*self.completion, EOS_ID]


def prompt_completion_pairs(count: int, seed: int = 0) -> list[PromptCompletion]:
    """``count`` examples: 3-5 prompt words, 2-5 completion words."""
    prompts = token_rows(count, seed)
    completions = token_rows(count, seed + 1)
    return [
        PromptCompletion(tuple(p[: 3 + i % 3]), tuple(c[: 2 + i % 4]))
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level ``PreTrainedTokenizerFast`` over ``VOCAB`` ids: ``"w<i>"`` is id ``i``,
    ``<pad>`` is 0 and ``</s>`` is 1 (what TRL appends to each completion)."""
    vocab = {"<pad>": PAD_ID, "</s>": EOS_ID, **{f"w{i}": i for i in range(FIRST_WORD, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")


#: Evaluate and checkpoint every step, and put the checkpoint of the lowest eval loss back
#: after the last step (``load_best_model_at_end``).
RESTORE_BEST: dict[str, Any] = dict(
    eval_strategy="steps",
    eval_steps=1,
    per_device_eval_batch_size=2,
    save_strategy="steps",
    save_steps=1,
    load_best_model_at_end=True,
    metric_for_best_model="eval_loss",
    greater_is_better=False,
)


def training_args(
    output_dir: str | Path,
    config_cls: type[TrainingArguments] = TrainingArguments,
    **overrides: Any,
) -> TrainingArguments:
    """CPU, fp32, seed 0, batch 2, 3 steps, lr 1e-2 (weights visibly change each step), no
    reporting and no checkpoints; ``overrides`` win."""
    options: dict[str, Any] = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=3,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_drop_last=True,
        remove_unused_columns=False,
        seed=0,
    )
    options.update(overrides)
    return config_cls(**options)


def pad_rows(features: list[Mapping[str, Any]]) -> dict[str, Tensor]:
    """Right-pad ``input_ids`` (and ``labels``, default: a copy) into a causal-LM batch:
    pad id 0, mask 0 and label -100 at padding (the library's collator)."""
    return pad_examples([dict(f) for f in features], PAD_ID)


class RecordingCollator:
    """Wraps a collator (default :func:`pad_rows`) and keeps a copy of every batch it builds,
    in the order the trainer asked for them."""

    def __init__(self, collate: Callable[[list[Any]], Mapping[str, Any]] | None = None):
        self.collate = collate or pad_rows
        self.batches: list[dict[str, Tensor]] = []

    def __call__(self, features: list[Any]) -> Mapping[str, Any]:
        batch = self.collate(features)
        self.batches.append({k: v.clone() for k, v in batch.items() if isinstance(v, Tensor)})
        return batch

    def examples(self) -> dict[int, tuple[Tensor, Tensor]]:
        """Example id (content hash of the unpadded ids) -> unpadded ``(input_ids, labels)``."""
        out = {}
        for batch in self.batches:
            mask = batch["attention_mask"].bool()
            ids = content_hash(batch["input_ids"], mask).tolist()
            for row, example_id in enumerate(ids):
                keep = mask[row]
                out[example_id] = (batch["input_ids"][row][keep], batch["labels"][row][keep])
        return out

    def ids_per_step(self, accumulation: int, steps: int) -> dict[int, list[int]]:
        """Optimizer step -> sorted ids of its ``accumulation`` micro-batches (batches are
        consumed in order; any batch built beyond ``steps`` was never trained on)."""
        assert len(self.batches) >= accumulation * steps, "fewer batches than steps"
        out = {}
        for step in range(steps):
            window = self.batches[step * accumulation : (step + 1) * accumulation]
            ids = [content_hash(b["input_ids"], b["attention_mask"]).tolist() for b in window]
            out[step] = sorted(i for part in ids for i in part)
        return out


class WeightSnapshots(TrainerCallback):
    """Copies the model's ``state_dict`` at the start of each optimizer step (the weights
    that step's gradients are taken at), keyed by ``state.global_step``."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, Tensor]] = {}
        self.steps_begun = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps_begun += 1
        model = kwargs["model"]
        self.weights[state.global_step] = {
            k: v.detach().clone() for k, v in model.state_dict().items()
        }


class FirstWeights(TrainerCallback):
    """Keeps the model and a copy of its weights at ``on_train_begin``: a run refused
    before its first update must leave them as they were (:meth:`assert_unchanged`)."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.weights: dict[str, Tensor] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.model = kwargs["model"]
        self.weights = {k: v.clone() for k, v in self.model.state_dict().items()}

    def assert_unchanged(self) -> None:
        assert self.model is not None and self.weights, "the run never began"
        for name, value in self.model.state_dict().items():
            assert torch.equal(value, self.weights[name]), f"{name} changed"


# -- what a store holds --------------------------------------------------------------------


def stored_ids_per_step(store: StoreReader) -> dict[int, list[int]]:
    """Step -> sorted example ids stored for it."""
    out: dict[int, list[int]] = {}
    for chunk in store.iter_chunks():
        for example_id, step in zip(chunk.example_ids.tolist(), chunk.steps.tolist(), strict=True):
            out.setdefault(step, []).append(example_id)
    return {step: sorted(ids) for step, ids in out.items()}


def assert_steps_hold_their_micro_batches(
    store: StoreReader, collator: RecordingCollator, accumulation: int, steps: int
) -> None:
    """Steps ``0..steps-1`` exactly; each holds exactly its micro-batches' examples; no
    example is stored twice."""
    stored = stored_ids_per_step(store)
    assert store.steps == list(range(steps))
    assert stored == collator.ids_per_step(accumulation, steps)
    all_ids = [i for ids in stored.values() for i in ids]
    duplicated = [i for i, n in Counter(all_ids).items() if n > 1]
    assert not duplicated, f"examples stored twice: {duplicated}"


@dataclass
class OracleReport:
    """How many (example, layer) gradients were compared, and the worst relative error."""

    compared: int
    worst: float
    where: str


def assert_store_matches_oracle(
    store_dir: str | Path,
    snapshots: WeightSnapshots,
    examples: Mapping[int, tuple[Tensor, Tensor]],
    build_model: Callable[[], nn.Module],
    tol: float = FP32_TOL,
) -> OracleReport:
    """Every stored gradient of every layer equals the oracle within ``tol`` (relative).

    The oracle: ``build_model()`` (fp64, the trained model's architecture) loaded with the
    weights of the example's step, one backward of the example's own summed token loss on
    its unpadded tokens with the labels the trainer used (``examples[id]``). Its
    per-parameter gradients are laid out like the store's by the layer adapter's
    ``flatten`` (``[weight | bias]`` rows for linear layers).
    """
    store = StoreReader(store_dir)
    models: dict[int, nn.Module] = {}
    compared, worst, where = 0, 0.0, ""
    for chunk in store.iter_chunks(max_examples=64):
        stored = {layer: grads.materialize() for layer, grads in chunk.layers.items()}
        for row, (example_id, step) in enumerate(
            zip(chunk.example_ids.tolist(), chunk.steps.tolist(), strict=True)
        ):
            if step not in models:
                models[step] = build_model()
                models[step].load_state_dict(snapshots.weights[step])
            model = models[step]
            ids, labels = examples[example_id]
            batch = {"input_ids": ids[None], "attention_mask": torch.ones_like(ids[None])}
            ref = loop_oracle(
                model, {**batch, "labels": labels[None]}, store_parameter_names(model, store)
            )
            for layer, got in stored.items():
                module = model.get_submodule(layer)
                adapter = DEFAULT_REGISTRY.lookup(module)
                assert adapter is not None, layer
                local = {n: ref[f"{layer}.{n}"][0] for n in adapter.captured_parameters(module)}
                error = rel_error(got[row], adapter.flatten(module, local))
                compared += 1
                if error > worst:
                    worst, where = error, f"layer {layer}, example {example_id}, step {step}"
    assert compared > 0, "the store holds nothing to compare"
    assert worst <= tol, f"relative error {worst:.2e} > {tol:.0e} at {where}"
    return OracleReport(compared, worst, where)
