"""``tda capture --eos`` tokenizes text and prompt/completion rows exactly as TRL's
``SFTTrainer`` trains them (oracle: the trainer's own processed dataset), with a byte-level
BPE tokenizer whose tokens merge across the prompt/completion boundary."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from tda_plugins.integrations.transformers.data import (
    ExamplePool,
    LossTokens,
    numbered_rows,
    tokenize_rows,
)
from tda_plugins.integrations.transformers.setup import fused_head
from tests.trainers import training_args

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attribution asks which training examples explain a prediction.",
    "A gradient store keeps every example's exact gradient on disk.",
    "Selection drops the examples that hurt the target task.",
]
PAIRS = [
    {"prompt": "Question: what does the store keep?", "completion": " Exact gradients."},
    {"prompt": "Say hello:", "completion": "hello there"},
    {"prompt": "The quick bro", "completion": "wn fox jumps."},  # "brown" merges across
]


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        TEXTS * 4 + [p["prompt"] + p["completion"] for p in PAIRS],
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def sft_trainer(
    tmp_path: Path,
    rows: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerFast | None = None,
    **config: object,
) -> SFTTrainer:
    """An ``SFTTrainer`` of a one-block Llama over ``rows`` (default: the BPE tokenizer)."""
    tokenizer = tokenizer or bpe_tokenizer()
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    return SFTTrainer(
        model=model,
        args=training_args(tmp_path, config_cls=SFTConfig, **config),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize("rows", [[{"text": t} for t in TEXTS], PAIRS], ids=["text", "pairs"])
def test_eos_rows_tokenize_as_sft_trainer_trains_them(
    tmp_path: Path, rows: list[dict[str, str]]
) -> None:
    trainer = sft_trainer(tmp_path, rows)
    tokenizer = trainer.processing_class
    ours = tokenize_rows(numbered_rows(rows), tokenizer, 512, loss=LossTokens(eos=True))
    for trained, example in zip(trainer.train_dataset, ours, strict=True):
        assert example.input_ids == trained["input_ids"]
        assert example.labels == trained.get("labels", trained["input_ids"])


def test_a_callbacks_examples_are_cut_as_the_run_cuts_its_rows(tmp_path: Path) -> None:
    """Influence queries and a selection target (:class:`ExamplePool`) are tokenized with
    the run's ``max_length`` (oracle: the trainer's own processed rows, cut to 6 tokens),
    and under ``truncation_mode="keep_end"`` a longer row is refused, not cut the other
    way."""
    rows = [{"text": t} for t in TEXTS]
    trainer = sft_trainer(tmp_path / "start", rows, max_length=6)
    pool = ExamplePool(rows, "InfluenceLoggingCallback")
    batch = pool.batch(trainer.processing_class, LossTokens.of_trainer(trainer.args))
    assert batch["input_ids"].tolist() == [r["input_ids"] for r in trainer.train_dataset]
    kept_end = sft_trainer(tmp_path / "end", rows, max_length=6, truncation_mode="keep_end")
    with pytest.raises(ValueError, match=r"InfluenceLoggingCallback:1: \d+ tokens, longer"):
        pool.batch(kept_end.processing_class, LossTokens.of_trainer(kept_end.args))


@pytest.mark.parametrize("completion_only_loss", [True, False, None])
def test_tokenized_rows_get_trls_labels_and_cut(
    tmp_path: Path, completion_only_loss: bool | None
) -> None:
    """Rows of ``input_ids`` with TRL's mask columns: their labels are built as TRL builds
    them (``assistant_masks`` always, ``completion_mask`` where ``completion_only_loss``
    is set: unset, TRL leaves it off for rows that are not prompt-completion), and a pool
    cuts them at the run's ``max_length`` (oracle: the trainer's processed rows, with the
    -100 its collator puts under the masks)."""
    rows = [
        {
            "input_ids": [5, 6, 7, 8, 9, 10, 11, 12],
            "completion_mask": [0, 0, 0, 1, 1, 1, 1, 1],
            "assistant_masks": [1, 1, 1, 1, 0, 1, 1, 1],
        },
        {
            "input_ids": [13, 14, 15, 16, 17, 18],
            "completion_mask": [0, 0, 1, 1, 1, 1],
            "assistant_masks": [0, 1, 1, 0, 1, 1],
        },
    ]
    trainer = sft_trainer(tmp_path, rows, max_length=6, completion_only_loss=completion_only_loss)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    run = LossTokens.of_trainer(trainer.args)
    pool = ExamplePool(rows, "x").batch(trainer.processing_class, run)
    assert pool["input_ids"].tolist() == batch["input_ids"].tolist()
    assert pool["labels"].tolist() == batch["labels"].tolist()
    assert (batch["labels"] == -100).any(), "the masks took effect"


def test_an_sft_config_subclass_is_read_as_sft_config(tmp_path: Path) -> None:
    """A dataclass extending ``SFTConfig`` (as TRL's own ``GKDConfig`` does) trains its rows
    as ``SFTTrainer`` does: its end-of-sequence token, its cut and its fused head."""

    @dataclasses.dataclass
    class MyConfig(SFTConfig):
        note: str = "mine"

    args = training_args(tmp_path, config_cls=MyConfig, max_length=6)
    plain = training_args(tmp_path, config_cls=SFTConfig, max_length=6)
    assert LossTokens.of_trainer(args) == LossTokens.of_trainer(plain) != LossTokens()
    assert fused_head(args) == fused_head(plain) is not None


#: A chat template that renders a row's ``tools`` and, with ``enable_thinking=False``, an
#: empty thinking block in the assistant's turn and in the generation prompt (as Qwen3's).
TOOLS_AND_THINKING = (
    "{% if tools %}[tools: {{ tools | map(attribute='name') | join(',') }}]\n{% endif %}"
    "{% set quiet = enable_thinking is defined and not enable_thinking %}"
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' and quiet %}<think></think>{% endif %}"
    "{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% if quiet %}<think></think>{% endif %}{% endif %}"
)


def test_a_rows_tools_and_chat_template_kwargs_reach_its_chat_template(tmp_path: Path) -> None:
    """TRL renders a conversation with its row's ``tools`` and ``chat_template_kwargs``:
    the tokens and the completion-only labels are TRL's (oracle: its processed rows and
    collator), the empty thinking block of ``enable_thinking=False`` in the prompt."""
    rows = [
        {
            "prompt": [{"role": "user", "content": prompt}],
            "completion": [{"role": "assistant", "content": completion}],
            "tools": [{"name": tool}],
            "chat_template_kwargs": {"enable_thinking": thinking},
        }
        for prompt, completion, tool, thinking in (
            ("Say hello:", "hello there", "greet", False),
            ("The quick bro", "wn fox jumps.", "search", True),
        )
    ]
    tokenizer = bpe_tokenizer()
    tokenizer.chat_template = TOOLS_AND_THINKING
    trainer = sft_trainer(tmp_path, rows, tokenizer=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    pool = ExamplePool(rows, "x").batch(tokenizer, LossTokens.of_trainer(trainer.args))
    assert pool["input_ids"].tolist() == batch["input_ids"].tolist()
    assert pool["labels"].tolist() == batch["labels"].tolist()
    assert tokenizer.encode("[tools: greet]")[0] == batch["input_ids"][0, 0]


def test_a_runs_own_eos_token_and_text_field_are_recorded(tmp_path: Path) -> None:
    """``SFTConfig(eos_token=...)`` (which TRL sets on its tokenizer in place) and
    ``dataset_text_field``: rows tokenized with a tokenizer loaded again, as a capture of
    queries loads one, get the tokens the run trained on (oracle: its processed rows)."""

    def tokenizer() -> PreTrainedTokenizerFast:
        fresh = bpe_tokenizer()
        fresh.add_special_tokens({"additional_special_tokens": ["<|end_of_turn|>"]})
        return fresh

    rows = [{"formatted": t, "text": "not this column"} for t in TEXTS]
    trainer = sft_trainer(
        tmp_path,
        rows,
        tokenizer=tokenizer(),
        eos_token="<|end_of_turn|>",
        dataset_text_field="formatted",
    )
    run = LossTokens.of_trainer(trainer.args)
    assert (run.eos_token, run.text_field) == ("<|end_of_turn|>", "formatted")
    assert LossTokens.from_json(run.as_json()) == run  # as a store records it
    ours = tokenize_rows(numbered_rows(rows), tokenizer(), 512, loss=run)
    trained = [r["input_ids"] for r in trainer.train_dataset]
    assert [e.input_ids for e in ours] == trained
    assert trained[0][-1] == tokenizer().convert_tokens_to_ids("<|end_of_turn|>")


def test_the_runs_cut_is_taken_unless_a_length_is_given() -> None:
    """``SFTConfig(max_length=...)`` cuts rows to their first tokens, which a capture like
    the run reproduces; a run that kept their last tokens cannot be, so it is refused
    unless the caller gives the length (and rows within it)."""
    cut = LossTokens(eos=True, max_length=6)
    assert cut.truncation(None) == 6
    assert cut.truncation(32) == 32
    assert LossTokens().truncation(None) is None
    kept_end = LossTokens(eos=True, max_length=6, keep_end=True)
    with pytest.raises(ValueError, match=r"keep_end.*max_length \(--max-length\)"):
        kept_end.truncation(None)
    assert kept_end.truncation(6) == 6


def test_an_sft_config_records_its_cut(tmp_path: Path) -> None:
    """``SFTConfig``'s ``max_length`` and ``truncation_mode`` reach the recorded loss
    tokens; a run that kept the last tokens is refused by a capture like it."""
    kept_start = LossTokens.of_trainer(training_args(tmp_path, config_cls=SFTConfig, max_length=6))
    assert (kept_start.max_length, kept_start.keep_end) == (6, False)
    kept_end = LossTokens.of_trainer(
        training_args(tmp_path, config_cls=SFTConfig, max_length=6, truncation_mode="keep_end")
    )
    assert (kept_end.max_length, kept_end.keep_end) == (6, True)
    with pytest.raises(ValueError, match="keep_end"):
        kept_end.truncation(None)
