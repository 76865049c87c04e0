"""``tda_plugins.attribute`` and what ``Scores`` hands a user: top-k lists by sign, and the
scores as a DataFrame or a ``datasets.Dataset``."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

import tda_plugins
from tda_plugins import LayerSelection
from tda_plugins.methods import Scores, method_by_name
from tda_plugins.report.html import render_html
from tda_plugins.store import GradientStore, StoreReader
from tda_plugins.store.writer import DURABILITY
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import capture_store, made_stores


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A training store of 6 examples and 2 queries, with texts."""
    root = tmp_path_factory.mktemp("api")
    model = tiny_causal_lm("llama")
    for name, batches in (
        ("train", [lm_batch(3, 8, seed=s) for s in (1, 2)]),
        ("q", [lm_batch(2, 8, seed=9)]),
    ):
        reader = capture_store(model, batches, root / name, LayerSelection("linear"))
        ids = reader.load_all().example_ids.tolist()
        GradientStore(root / name, append=True).write_examples({i: f"{name} {i}" for i in ids})
    return root / "train", root / "q"


def test_attribute_equals_the_method_and_carries_the_texts(stores: tuple[Path, Path]) -> None:
    train, queries = stores
    scores = tda_plugins.attribute(train, queries, "kfac", damping=0.2)
    expected = method_by_name("kfac", damping=0.2).score(StoreReader(train), StoreReader(queries))
    assert torch.equal(scores.values, expected.values)
    assert torch.equal(scores.train_ids, expected.train_ids)
    assert scores.train_texts == {i: f"train {i}" for i in scores.train_ids.tolist()}
    assert scores.query_texts == {i: f"q {i}" for i in scores.query_ids.tolist()}


def test_a_report_reads_only_the_texts_it_shows(tmp_path: Path) -> None:
    """``attribute``'s training texts are read when used: the report page reads its
    shown examples' texts alone (the Python memory traced over scoring and the page is a
    small share of the store's texts), and every text is there when the whole mapping is
    used (``to_pandas``)."""
    model = tiny_causal_lm("llama")
    train = capture_store(
        model, [lm_batch(8, 8, seed=s) for s in range(8)], tmp_path / "train", None
    )
    queries = capture_store(model, [lm_batch(2, 8, seed=99)], tmp_path / "q", None)
    ids = train.load_all().example_ids.tolist()
    texts = {i: f"text of {i}: " + "w" * 40_000 for i in ids}
    GradientStore(tmp_path / "train", append=True).write_examples(texts)
    tracemalloc.start()
    try:
        scores = tda_plugins.attribute(train, queries, "graddot", progress=False)
        page = render_html(scores, scores.train_texts, scores.query_texts, k=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < sum(map(len, texts.values())) / 4
    shown = {r["id"] for q in scores.top_k(2) for side in ("helpful", "harmful") for r in q[side]}
    assert shown and all(f"text of {i}: www" in page for i in shown)
    assert dict(scores.train_texts) == texts


@pytest.mark.parametrize(
    ("method", "bar"),
    [
        ("tracin", "tracin scores, checkpoint 1 of 1:"),
        ("ekfac", "EK-FAC eigenvalue correction:"),
    ],
)
def test_progress_bars_name_their_pass_and_count_to_the_store(
    stores: tuple[Path, Path], capsys: pytest.CaptureFixture[str], method: str, bar: str
) -> None:
    """A user sees what runs and how far it is: TracIn's bar names itself, not GradDot,
    and EK-FAC's correction pass counts to the store's examples (not an open count)."""
    tda_plugins.attribute(*stores, method, progress=True)
    examples = StoreReader(stores[0]).num_examples
    shown = [line for line in capsys.readouterr().err.split("\r") if line.startswith(bar)]
    assert shown, f"no bar {bar!r}"
    assert all(f"/{examples} [" in line for line in shown), shown


def test_top_k_lists_hold_only_their_sign() -> None:
    """Helpful lists only positive scores, best first; harmful only negative, worst first;
    a zero is in neither."""
    values = torch.tensor([[3.0, -1.0], [-2.0, -4.0], [0.0, -0.5], [1.0, -3.0]])
    scores = Scores(torch.tensor([10, 11, 12, 13]), torch.tensor([7, 8]), values, "graddot")
    first, second = scores.top_k(3)
    assert [(e["id"], e["score"]) for e in first["helpful"]] == [(10, 3.0), (13, 1.0)]
    assert [(e["id"], e["score"]) for e in first["harmful"]] == [(11, -2.0)]
    assert second["helpful"] == []
    assert [e["id"] for e in second["harmful"]] == [11, 13, 10]


def test_scores_round_trip_through_pandas_and_datasets(stores: tuple[Path, Path]) -> None:
    scores = tda_plugins.attribute(*stores)
    frame = scores.to_pandas()
    assert list(frame.columns) == ["train_id", "query_id", "score", "train_text", "query_text"]
    assert len(frame) == scores.values.numel()
    for row in frame.itertuples():
        i = scores.train_ids.tolist().index(row.train_id)
        j = scores.query_ids.tolist().index(row.query_id)
        assert row.score == pytest.approx(float(scores.values[i, j]))
        assert row.train_text == f"train {row.train_id}" and row.query_text == f"q {row.query_id}"
    dataset = scores.to_dataset()
    assert dataset.column_names == list(frame.columns) and len(dataset) == len(frame)
    assert dataset["score"] == pytest.approx(frame["score"].tolist())


def test_capture_examples_takes_a_dataset_a_list_or_jsonl(tmp_path: Path) -> None:
    """The same rows as a ``datasets.Dataset``, a list of dicts and a JSONL file (text rows,
    tokenized by the tokenizer; ids from the rows) give the same store and texts."""
    from datasets import Dataset

    from tests.trainers import token_rows, word_tokenizer, words

    rows = [{"text": words(r), "id": 40 + n} for n, r in enumerate(token_rows(5))]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = tiny_causal_lm("llama")
    stores = [
        tda_plugins.capture_examples(
            model, given, tmp_path / name, tokenizer=word_tokenizer(), batch_size=2
        )
        for name, given in (("ds", Dataset.from_list(rows)), ("list", rows), ("jsonl", jsonl))
    ]
    reference = stores[0].load_all()
    assert reference.example_ids.tolist() == [r["id"] for r in rows]
    for store in stores[1:]:
        chunk = store.load_all()
        assert torch.equal(chunk.example_ids, reference.example_ids)
        for name, grads in chunk.layers.items():
            assert torch.equal(grads.materialize(), reference.layers[name].materialize())
        assert store.texts() == {r["id"]: r["text"] for r in rows}


def test_callback_pools_take_texts_tokenized_by_the_trainers_tokenizer() -> None:
    """Queries and targets given as a Dataset of texts become the batch of their tokens."""
    from datasets import Dataset

    from tda_plugins.integrations.transformers import (
        DataSelectionCallback,
        InfluenceLoggingCallback,
        pad_examples,
    )
    from tests.trainers import token_rows, word_tokenizer, words

    tokens = token_rows(3)
    texts = Dataset.from_list([{"text": words(r)} for r in tokens])
    expected = pad_examples([{"input_ids": r} for r in tokens])
    pools = (
        InfluenceLoggingCallback(queries=texts).examples,
        DataSelectionCallback(target=texts).target,
    )
    for pool in pools:
        batch = pool.batch(word_tokenizer())
        assert all(torch.equal(batch[k], expected[k]) for k in expected)


def test_the_package_exports_exactly_its_lazy_names() -> None:
    """``__all__`` (what ``from tda_plugins import *`` and the docs list) names every lazily
    loaded export and nothing else, so that neither can drift from the other."""
    assert sorted(tda_plugins.__all__) == sorted([*tda_plugins._EXPORTS, "__version__"])
    assert set(tda_plugins._EXPORTS) <= set(dir(tda_plugins))


#: Run in a fresh interpreter: prints the torch/transformers modules loaded by ``import
#: tda_plugins`` with ``tda --help``, a subcommand's help and a usage error; whether the
#: exports other than the transformers callbacks load ``torch.distributed.tensor``; then
#: checks that the callbacks load from transformers' integration.
_IMPORTS_SCRIPT = """
import sys
import tda_plugins
from tda_plugins.cli import main

for argv in (["--help"], ["attribute", "--help"], ["capture", "--help"], ["attribute"]):
    try:
        main(argv)
    except SystemExit:
        pass
print("parser:", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")))
for name, module in tda_plugins._EXPORTS.items():
    if module != "tda_plugins.integrations.transformers":
        getattr(tda_plugins, name)
print("dtensor:", "torch.distributed.tensor" in sys.modules, "transformers" in sys.modules)
from tda_plugins import GradientCaptureCallback, use_id_column
from tda_plugins.integrations import transformers
assert GradientCaptureCallback is transformers.GradientCaptureCallback
assert use_id_column is transformers.use_id_column
"""


@pytest.mark.slow
def test_the_package_and_the_cli_parser_import_what_they_use_when_they_use_it() -> None:
    """``import tda_plugins``, ``tda --help``, a subcommand's help and a usage error import
    neither torch nor transformers (seconds of start, more on a slow disk); the exports but
    the transformers callbacks import no ``torch.distributed.tensor`` (FSDP2's DTensors are
    recognized without it: :mod:`tda_plugins.parallel.dtensor`); the callbacks load from
    the transformers integration on first use."""
    shown = subprocess.run([sys.executable, "-c", _IMPORTS_SCRIPT], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "parser: []" in lines, shown.stdout
    assert lines[-1] == "dtensor: False False", shown.stdout


def test_capture_examples_queues_its_shards_for_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-pass capture lets shards queue for the disk and makes them durable once it
    has ended (``"end"``), or as asked; a store made directly (a training store) waits for
    each shard and keeps ``"step"``."""
    from tda_plugins.session import dataset as dataset_capture

    made = made_stores(monkeypatch, dataset_capture)
    rows = [{"input_ids": [2, 3, 4, 5]}, {"input_ids": [6, 7, 8]}]
    model = tiny_causal_lm("llama")
    tda_plugins.capture_examples(model, rows, tmp_path / "q", progress=False)
    tda_plugins.capture_examples(model, rows, tmp_path / "s", progress=False, durability="step")
    assert [s.in_flight_bytes for s in made] == [dataset_capture.IN_FLIGHT_BYTES] * 2
    assert [s.durability for s in made] == [DURABILITY["end"], DURABILITY["step"]]
    other = GradientStore(tmp_path / "other")
    assert other.in_flight_bytes is None
    assert other.durability == DURABILITY["step"]


def test_capture_options_are_checked_by_name(tmp_path: Path) -> None:
    """A misspelt option is refused, naming the known ones, before anything is written."""
    with pytest.raises(TypeError, match=r"unknown capture options \['layerz'\].*'layers'"):
        tda_plugins.capture_examples(
            tiny_causal_lm("llama"), [{"input_ids": [2, 3, 4]}], tmp_path / "q", layerz="all"
        )
    assert not (tmp_path / "q").exists()


def test_capture_examples_like_a_store_refuses_what_would_not_match(tmp_path: Path) -> None:
    """``like=``: the store's layers by name (no head here, as TRL's fused head leaves a
    training store), refused with layer options beside it, or on a model without one of
    those layers, before anything is written."""
    rows = [{"input_ids": [5, 9, 14, 3, 22]}, {"input_ids": [7, 30, 12]}]
    llama = tiny_causal_lm("llama")
    store = tda_plugins.capture_examples(
        llama, rows, tmp_path / "train", layers="linear", exclude="lm_head", progress=False
    )
    queries = tda_plugins.capture_examples(
        llama, rows[:1], tmp_path / "q", like=store, progress=False
    )
    assert queries.config.layers == store.config.layers
    assert not (tmp_path / "q" / "rank-0" / "curvature.safetensors").exists()  # queries need none
    with pytest.raises(ValueError, match=r"leave out \['layers'\]"):
        tda_plugins.capture_examples(llama, rows, tmp_path / "a", like=store, layers="all")
    with pytest.raises(ValueError, match="the model has no trainable layer"):
        tda_plugins.capture_examples(tiny_causal_lm("gpt2"), rows, tmp_path / "b", like=store)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
