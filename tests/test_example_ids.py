"""The user's own example ids (``use_id_column``) and texts through real Trainer/SFTTrainer runs.

The oracle for the ids: the same run without ``use_id_column`` names each example by the
content hash of its tokens, so hash -> the row's id maps one run onto the other; every
stored gradient must be the same under either name (ids change nothing else).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import Trainer
from trl import SFTConfig, SFTTrainer

from tda_plugins.capture import content_hash
from tda_plugins.integrations.transformers import (
    DataSelectionCallback,
    GradientCaptureCallback,
    use_id_column,
)
from tda_plugins.methods import method_by_name
from tda_plugins.store import StoreReader
from tda_plugins.store.texts import TokenTexts
from tests.models import tiny_causal_lm, with_lora
from tests.selection_helpers import PINNED
from tests.trainers import (
    pad_rows,
    prompt_completion_pairs,
    token_rows,
    training_args,
    word_tokenizer,
    words,
)

#: User ids: far from any content hash, not in row order.
IDS = [1000 + 7 * i for i in range(8)]


def stored_grads_by_id(store: StoreReader) -> dict[int, dict[str, torch.Tensor]]:
    """Example id -> layer -> its ``(D,)`` stored gradient (each id stored once)."""
    chunk = store.load_all()
    flat = {name: g.materialize() for name, g in chunk.layers.items()}
    ids = chunk.example_ids.tolist()
    assert len(set(ids)) == len(ids)
    return {i: {name: flat[name][row] for name in flat} for row, i in enumerate(ids)}


def _llama() -> torch.nn.Module:
    return tiny_causal_lm("llama", torch.float32)


def _tokenized_rows(duplicate: bool) -> list[dict[str, Any]]:
    """Pre-tokenized rows with ids; ``duplicate``: rows 1 and 5 hold the same tokens."""
    rows = token_rows(len(IDS))
    if duplicate:
        rows[5] = list(rows[1])
    return [{"input_ids": r, "id": i} for r, i in zip(rows, IDS, strict=True)]


def _train(tmp_path: Path, rows: list[dict[str, Any]], ids: bool, **callback: Any) -> Path:
    store = tmp_path / ("ids" if ids else "hash") / "store"
    trainer = Trainer(
        model=_llama(),
        args=training_args(
            tmp_path / "out", max_steps=4, remove_unused_columns=True, **callback.pop("args", {})
        ),
        train_dataset=Dataset.from_list(rows),
        data_collator=pad_rows,
        processing_class=word_tokenizer(),
        callbacks=[GradientCaptureCallback(store_dir=str(store), curvature=False, **callback)],
    )
    if ids:
        use_id_column(trainer)
    trainer.train()
    return store


def test_trainer_stores_the_id_column_with_the_same_gradients_as_content_hashes(
    tmp_path: Path,
) -> None:
    rows = _tokenized_rows(duplicate=False)
    by_id = stored_grads_by_id(StoreReader(_train(tmp_path, rows, ids=True)))
    by_hash = stored_grads_by_id(StoreReader(_train(tmp_path, rows, ids=False)))
    hash_to_id = {int(content_hash(torch.tensor([r["input_ids"]]))[0]): r["id"] for r in rows}
    assert sorted(by_id) == sorted(IDS)  # 4 steps x 2 rows: every row once
    assert {hash_to_id[h] for h in by_hash} == set(by_id)
    for h, grads in by_hash.items():
        for name, g in grads.items():
            torch.testing.assert_close(by_id[hash_to_id[h]][name], g, rtol=0, atol=0)


def test_duplicate_texts_with_distinct_ids_stay_two_examples(tmp_path: Path) -> None:
    rows = _tokenized_rows(duplicate=True)
    store = StoreReader(_train(tmp_path, rows, ids=True))
    assert sorted(stored_grads_by_id(store)) == sorted(IDS)
    texts = store.texts()
    assert texts[IDS[1]] == texts[IDS[5]] == words(rows[1]["input_ids"])


def test_duplicate_rows_without_ids_train_together_and_score_as_one_example(
    tmp_path: Path,
) -> None:
    """Without ids a duplicated row is one content hash; both copies in one step are that
    example trained twice: stored twice, scored once (the sum of its rows)."""
    rows = _tokenized_rows(duplicate=True)
    batch = {"per_device_train_batch_size": len(rows)}  # every row in every step
    store = StoreReader(_train(tmp_path, rows, ids=False, args=batch))
    twice = int(content_hash(torch.tensor([rows[1]["input_ids"]]))[0])
    for step, ids in store.step_example_ids().items():
        assert len(ids) == len(rows) and ids.count(twice) == 2, step
    scores = method_by_name("graddot").score(store.at_step(0), store.at_step(0))
    assert sorted(scores.train_ids.tolist()) == sorted(set(store.step_example_ids()[0]))


def test_texts_are_stored_unless_turned_off(tmp_path: Path) -> None:
    rows = _tokenized_rows(duplicate=False)
    store = StoreReader(_train(tmp_path, rows, ids=True))
    assert store.texts() == {r["id"]: words(r["input_ids"]) for r in rows}
    private = StoreReader(_train(tmp_path / "private", rows, ids=True, store_texts=False))
    assert private.texts() == {}
    assert store.token_texts() == {}  # tokens only where per-token factors are kept


def test_a_keep_tokens_run_stores_each_examples_tokens(tmp_path: Path) -> None:
    """With ``keep_tokens`` each example's tokens are saved one by one, at their positions
    in the padded batch row (the token axis of its token scores)."""
    rows = _tokenized_rows(duplicate=False)
    store = StoreReader(_train(tmp_path, rows, ids=True, keep_tokens=True))
    assert store.token_texts() == {
        r["id"]: TokenTexts([f"w{t}" for t in r["input_ids"]], list(range(len(r["input_ids"]))))
        for r in rows
    }


def _sft_rows(form: str) -> list[dict[str, Any]]:
    pairs = prompt_completion_pairs(len(IDS))
    if form == "text":
        rows = [{"text": words([*p.prompt, *p.completion])} for p in pairs]
    elif form == "prompt-completion":
        rows = [p.row() for p in pairs]
    else:
        rows = [
            {
                "messages": [
                    {"role": "user", "content": words(list(p.prompt))},
                    {"role": "assistant", "content": words(list(p.completion))},
                ]
            }
            for p in pairs
        ]
    return [{**row, "id": i} for row, i in zip(rows, IDS, strict=True)]


#: A chat template for the word tokenizer: each message's words, then </s>.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"


@pytest.mark.parametrize("form", ["text", "prompt-completion", "messages"])
def test_sft_trainer_stores_the_id_column(tmp_path: Path, form: str) -> None:
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    store_dir = tmp_path / "store"
    trainer = SFTTrainer(
        model=with_lora(_llama()),
        args=training_args(
            tmp_path / "out", config_cls=SFTConfig, max_steps=4, remove_unused_columns=True
        ),
        train_dataset=Dataset.from_list(_sft_rows(form)),
        processing_class=tokenizer,
        callbacks=[GradientCaptureCallback(store_dir=str(store_dir), curvature=False)],
    )
    use_id_column(trainer)
    trainer.train()
    store = StoreReader(store_dir)
    assert sorted(stored_grads_by_id(store)) == sorted(IDS)
    texts = store.texts()
    assert set(texts) == set(IDS)
    assert all(text.endswith("</s>") for text in texts.values())  # TRL's EOS, as trained


def test_selection_log_names_the_id_column(tmp_path: Path) -> None:
    rows = _tokenized_rows(duplicate=False)
    target = [{"input_ids": r} for r in token_rows(2, seed=5)]
    selection = DataSelectionCallback(target=target, fraction=0.5, layers="all", **PINNED)
    trainer = Trainer(
        model=_llama(),
        args=training_args(tmp_path / "out", max_steps=4, remove_unused_columns=True),
        train_dataset=Dataset.from_list(rows),
        data_collator=pad_rows,
        callbacks=[selection],
    )
    use_id_column(trainer)
    trainer.train()
    dropped = [i for e in selection.history for i in e.example_ids[e.dropped].tolist()]
    assert len(dropped) == 4 and set(dropped) <= set(IDS)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"input_ids": [2, 3, 4]}] * 2, "has no column 'id'"),
        ([{"input_ids": [2, 3, 4], "id": "a"}, {"input_ids": [2, 3], "id": "b"}], "integers"),
        ([{"input_ids": [2, 3, 4], "id": 3}, {"input_ids": [2, 3], "id": 3}], "occurs twice"),
    ],
)
def test_a_bad_id_column_is_refused_before_training(
    tmp_path: Path, rows: list[dict[str, Any]], message: str
) -> None:
    trainer = Trainer(
        model=_llama(),
        args=training_args(tmp_path / "out"),
        train_dataset=Dataset.from_list(rows),
        data_collator=pad_rows,
    )
    with pytest.raises(ValueError, match=message):
        use_id_column(trainer)


def test_a_plain_list_dataset_carries_its_ids_through_the_column_removal(tmp_path: Path) -> None:
    """A dataset that is not a ``datasets.Dataset`` has its unused columns removed by the
    trainer's collator wrapper, around ours: the id column is kept there too."""
    rows = _tokenized_rows(duplicate=False)
    store = tmp_path / "store"
    trainer = Trainer(
        model=_llama(),
        args=training_args(tmp_path / "out", max_steps=4, remove_unused_columns=True),
        train_dataset=rows,  # type: ignore[arg-type]
        data_collator=pad_rows,
        callbacks=[GradientCaptureCallback(store_dir=str(store), curvature=False)],
    )
    use_id_column(trainer)
    trainer.train()
    assert sorted(stored_grads_by_id(StoreReader(store))) == sorted(IDS)
