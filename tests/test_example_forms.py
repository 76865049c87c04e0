"""Every row form the callbacks, ``capture_examples`` and ``tda capture`` take is tokenized,
and its loss tokens chosen, as TRL's ``SFTTrainer`` prepares the same row for training: the
oracle is the trainer's own processed dataset (``input_ids``, ``labels``), with a real
``PreTrainedTokenizerFast`` and a chat template whose generation prompt opens the
assistant's turn."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from tda_plugins.integrations.transformers.data import (
    ExamplePool,
    LossTokens,
    jsonl_rows,
    tokenize_rows,
)
from tests.models import tiny_causal_lm
from tests.trainers import prompt_completion_pairs, training_args, word_tokenizer, words

#: Each message's words then ``</s>``; an assistant turn opens with ``w7``, which is also
#: the generation prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}w7 {% endif %}"
    "{{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}w7 {% endif %}"
)


def rows(form: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in prompt_completion_pairs(6):
        user = {"role": "user", "content": words(list(p.prompt))}
        assistant = {"role": "assistant", "content": words(list(p.completion))}
        if form == "text":
            out.append({"text": words([*p.prompt, *p.completion])})
        elif form == "prompt-completion":
            out.append(p.row())
        elif form == "messages":
            out.append({"messages": [user, assistant]})
        else:
            out.append({"prompt": [user], "completion": [assistant]})
    return out


#: :data:`CHAT_TEMPLATE` with the assistant's words and ``</s>`` in generation markers
#: (the same text), for ``assistant_only_loss``.
MARKED_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}w7 {% generation %}"
    "{{ m['content'] }} </s>{% endgeneration %} {% else %}{{ m['content'] }} </s> {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}w7 {% endif %}"
)

FORMS = ["text", "prompt-completion", "messages", "conversational prompt-completion"]

#: TRL's loss switches (``SFTConfig``); ``assistant_only_loss`` takes conversations only.
LOSSES = {
    "defaults": ({}, FORMS),
    "full loss": ({"completion_only_loss": False}, FORMS),
    "assistant only": ({"assistant_only_loss": True}, FORMS[2:]),
    "assistant only, full": (
        {"assistant_only_loss": True, "completion_only_loss": False},
        FORMS[3:],
    ),
}


@pytest.mark.parametrize(
    ("form", "loss"),
    [(form, loss) for loss, (_, forms) in LOSSES.items() for form in forms],
)
def test_rows_are_tokenized_as_trl_trains_them(tmp_path: Path, form: str, loss: str) -> None:
    """Our tokenization of each row form equals what TRL's ``SFTTrainer`` trains, tokens
    and labels, under each of its loss switches (read off its config)."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = MARKED_TEMPLATE if "assistant" in loss else CHAT_TEMPLATE
    given = rows(form)
    options = LOSSES[loss][0]
    trainer = SFTTrainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(tmp_path / "out", config_cls=SFTConfig, max_length=64, **options),
        train_dataset=Dataset.from_list(given),
        processing_class=tokenizer,
    )
    trained = list(trainer.train_dataset)
    switches = LossTokens.of_trainer(trainer.args)
    ours = tokenize_rows(list(enumerate(given, 1)), tokenizer, 64, loss=switches)
    for example, row in zip(ours, trained, strict=True):
        assert example.input_ids == row["input_ids"]
        assert example.labels == row.get("labels", row["input_ids"])


def test_a_conversational_query_pool_batches_its_completion_loss() -> None:
    """The callbacks' queries and targets in TRL's conversational prompt-completion form
    (a list of messages each): the batch's labels are the completion's tokens, after the
    generation prompt (``w7``) that the prompt's template ends with."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    given = rows("conversational prompt-completion")[:2]
    batch = ExamplePool(given, "InfluenceLoggingCallback").batch(tokenizer)
    for row, ids, labels in zip(given, batch["input_ids"], batch["labels"], strict=True):
        completion = tokenizer(f"{row['completion'][0]['content']} </s>")["input_ids"]
        start = int((labels != -100).nonzero()[0])
        assert ids[start - 1] == 7 and labels[labels != -100].tolist() == completion


def test_jsonl_from_windows_tools_reads_as_written(tmp_path: Path) -> None:
    """A byte-order mark and CRLF line ends (what Windows editors and spreadsheets write)
    give the same rows; a file that is not UTF-8 is refused naming its line."""
    given = [{"id": 1, "text": "w5 w6 ünï"}, {"id": 2, "text": "w8"}]
    lines = [json.dumps(r, ensure_ascii=False) for r in given]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    assert jsonl_rows(path) == [(1, given[0]), (2, given[1])]
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(lines[1].encode() + b"\n" + lines[0].encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=r"latin\.jsonl:2: not UTF-8"):
        jsonl_rows(latin)


def test_rows_without_a_loss_token_are_refused_naming_the_row() -> None:
    """An empty completion, or one cut off by the length, leaves no loss token: the row's
    gradient would be zero and every score with it 0, so it is refused by its line."""
    tokenizer = word_tokenizer()
    good = {"prompt": "w5 w6 w7", "completion": " w8 w9"}
    empty = {"prompt": "w5 w6 w7", "completion": ""}
    with pytest.raises(ValueError, match=r"queries:2: has no loss token"):
        tokenize_rows([(1, good), (2, empty)], tokenizer, 64, source="queries")
    with pytest.raises(ValueError, match=r"queries:1: has no loss token .*max_length=3"):
        tokenize_rows([(1, good)], tokenizer, 3, source="queries")
    assert len(tokenize_rows([(1, good)], tokenizer, 4, source="queries")) == 1


@pytest.mark.parametrize("rows_in_a_batch", [1, 2, 8])
def test_ids_given_to_some_rows_only_are_refused_whatever_the_batching(
    rows_in_a_batch: int,
) -> None:
    """Every row an 'id' or none: the mix is refused naming a row of each kind, before
    any batch is made (so not only when both kinds meet in one batch)."""
    from tda_plugins.session.dataset import plan_batches

    rows = [{"text": "w5 w6", "id": 5}, {"text": "w7 w8", "id": 6}, {"text": "w9 w10"}]
    model = tiny_causal_lm("llama")
    with pytest.raises(ValueError, match=r"examples:3 has no 'id' while examples:1 has one"):
        plan_batches(model, rows, word_tokenizer(), rows_in_a_batch, 64)


@pytest.mark.parametrize(
    ("form", "switches", "without"),
    [
        ("messages", {"assistant_only_loss": True}, {"assistant_only_loss": False}),
        ("prompt-completion", {"completion_only_loss": False}, {"completion_only_loss": True}),
        ("text", {"max_length": 5}, {"max_length": 64}),
    ],
)
def test_rows_captured_like_a_store_carry_the_loss_its_run_trained(
    tmp_path: Path, form: str, switches: dict[str, Any], without: dict[str, Any]
) -> None:
    """An SFT run under a loss switch or a ``max_length`` that cuts its rows (weights
    fixed: learning rate 0) records it in its store; its rows captured again like that
    store (``like=``, as ``tda capture --like``) are scored on the tokens the run trained:
    the same ids (content hashes of the tokens) and gradients, example by example.
    ``without`` the store's setting the copy's gradients differ."""
    from tda_plugins import GradientCaptureCallback, capture_examples
    from tda_plugins.store import StoreReader

    tokenizer = word_tokenizer()
    tokenizer.chat_template = MARKED_TEMPLATE
    given = rows(form)[:4]
    model = tiny_causal_lm("llama", torch.float32)
    SFTTrainer(
        model=model,
        args=training_args(
            tmp_path / "out",
            config_cls=SFTConfig,
            learning_rate=0.0,
            max_steps=2,
            gradient_checkpointing=False,
            **switches,
        ),
        train_dataset=Dataset.from_list(given),
        processing_class=tokenizer,
        callbacks=[
            GradientCaptureCallback(
                store_dir=str(tmp_path / "run"),
                layers="linear",
                exclude=r"^lm_head$",
            )
        ],
    ).train()
    trained = StoreReader(tmp_path / "run")
    length = next(f.default for f in dataclasses.fields(SFTConfig) if f.name == "max_length")
    run = {"eos": True, "max_length": length}  # SFTTrainer's defaults
    recorded = {**LossTokens().as_json(), **run, **switches}
    assert trained.metadata["loss_tokens"] == recorded

    def gradients(store: StoreReader) -> dict[int, torch.Tensor]:
        chunk = store.load_all()
        flat = torch.cat([chunk.layers[n].materialize() for n in store.layer_names], dim=1)
        return dict(zip(chunk.example_ids.tolist(), flat, strict=True))

    def copy(out: str, **options: Any) -> dict[int, torch.Tensor]:
        return gradients(
            capture_examples(
                model,
                given,
                tmp_path / out,
                tokenizer=tokenizer,
                like=trained,
                progress=False,
                **options,
            )
        )

    expected = gradients(trained)
    like = copy("like")
    assert like.keys() == expected.keys()
    for example_id, grad in expected.items():
        torch.testing.assert_close(like[example_id], grad, rtol=1e-4, atol=1e-6)
    defaults = copy("defaults", **without)
    assert any(
        i not in defaults or not torch.allclose(defaults[i], grad, rtol=1e-4, atol=1e-6)
        for i, grad in expected.items()
    )


@pytest.mark.parametrize("beside", ["prompt-completion", "messages"])
def test_a_row_holding_two_forms_is_read_as_trl_reads_it(tmp_path: Path, beside: str) -> None:
    """A row with a ``text`` beside its ``prompt``/``completion`` or ``messages`` (a
    dataset that kept both columns): TRL trains the other form, and so the row is scored
    (it used to be scored as its text). Oracle: the trainer's processed dataset."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    given = [{**row, "text": words([3, 4, 5, 6])} for row in rows(beside)]
    trainer = SFTTrainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(tmp_path / "out", config_cls=SFTConfig, max_length=64),
        train_dataset=Dataset.from_list(given),
        processing_class=tokenizer,
    )
    switches = LossTokens.of_trainer(trainer.args)
    ours = tokenize_rows(list(enumerate(given, 1)), tokenizer, 64, loss=switches)
    for example, row in zip(ours, trainer.train_dataset, strict=True):
        assert example.input_ids == row["input_ids"]
        assert example.labels == row.get("labels", row["input_ids"])


def test_a_cut_rows_text_is_the_text_of_its_kept_tokens() -> None:
    """A row cut at ``max_length`` is scored on its first tokens; its stored text (what the
    report shows) is theirs, not the whole row's."""
    tokenizer = word_tokenizer()
    whole = words(list(range(3, 15)))
    (cut,) = tokenize_rows([(1, {"text": whole})], tokenizer, 5)
    assert len(cut.input_ids) == 5
    assert cut.text == tokenizer.decode(cut.input_ids) != whole
    (kept,) = tokenize_rows([(1, {"text": whole})], tokenizer, 64)
    assert kept.text == whole


def test_row_keys_and_ids_as_datasets_and_numpy_give_them() -> None:
    """``Dataset.from_list`` fills a key a row lacks with None (mixed forms), and numpy or
    tensor columns give numpy / 0-d tensor ids: read as the rows and ids they are. An id
    outside int64 and a padded ``attention_mask`` are refused naming the row; a callback's
    pool reads ids the same way."""
    import numpy as np

    tokenizer = word_tokenizer()
    pair = rows("prompt-completion")[0]
    mixed = Dataset.from_dict(
        {"text": [words([3, 4, 5]), None], **{k: [None, v] for k, v in pair.items()}}
    )
    ours = tokenize_rows(list(enumerate(mixed, 1)), tokenizer, 64, loss=LossTokens())
    alone = tokenize_rows([(1, pair)], tokenizer, 64, loss=LossTokens())
    assert ours[1] == alone[0]
    ids = [{"input_ids": [3, 4], "id": np.int64(7)}, {"input_ids": [5, 6], "id": torch.tensor(9)}]
    assert [e.example_id for e in tokenize_rows(list(enumerate(ids, 1)), tokenizer, 64)] == [7, 9]
    with pytest.raises(ValueError, match="line 1: 'id' 18446744073709551617 is outside"):
        tokenize_rows([(1, {"input_ids": [3, 4], "id": 2**64 + 1})], tokenizer, 64)
    padded = {"input_ids": [3, 4, 0, 0], "attention_mask": [1, 1, 0, 0]}
    with pytest.raises(ValueError, match="line 1: 'attention_mask' masks 2 of its 4 tokens"):
        tokenize_rows([(1, padded)], tokenizer, 64)
    unpadded = {"input_ids": [3, 4], "attention_mask": [1, 1]}
    assert tokenize_rows([(1, unpadded)], tokenizer, 64)[0].input_ids == [3, 4]
    # a callback's pool (queries, a selection target) reads them as tokenize_rows does
    assert ExamplePool(ids, "InfluenceLoggingCallback").given_ids == [7, 9]
    with pytest.raises(ValueError, match="InfluenceLoggingCallback: line 2: 'id' must be an"):
        ExamplePool([ids[0], {"input_ids": [5], "id": 1.5}], "InfluenceLoggingCallback")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_size": -1}, "batch_size must be an integer of 1 or more, got -1"),
        ({"batch_size": 0}, "batch_size must be an integer of 1 or more, got 0"),
        ({"max_length": 0}, "max_length must be None or an integer of 1 or more, got 0"),
        ({"max_length": -5}, "max_length must be None or an integer of 1 or more, got -5"),
    ],
)
def test_batch_size_and_max_length_are_checked_in_python_too(
    tmp_path: Path, options: dict[str, int], message: str
) -> None:
    """The CLI refuses these; through Python a negative batch size wrote an empty store
    and ``max_length=0`` was taken as the default, without a word."""
    from tda_plugins import capture_examples, score_examples

    model, given = tiny_causal_lm("llama", torch.float32), rows("text")[:2]
    with pytest.raises(ValueError, match=message):
        capture_examples(model, given, tmp_path / "store", tokenizer=word_tokenizer(), **options)
    assert not (tmp_path / "store").exists()
    with pytest.raises(ValueError, match=message):
        score_examples(model, given, given, tokenizer=word_tokenizer(), **options)
