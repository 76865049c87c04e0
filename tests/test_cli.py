"""The ``tda`` command line, end to end on tiny saved models and tokenizer-free JSONL.

``tda capture`` and ``tda attribute`` run through :func:`tda_plugins.cli.main` in this
process, since every process start costs seconds of imports, and their scores are checked
against the ``torch.func`` oracle, keyed by the JSONL ids; so do help texts, input errors
and appending. The console script is ``sys.exit(main())``, and one test runs it as a
process to pin the exit codes there.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from tda_plugins.cli import build_parser, main
from tda_plugins.methods import Scores
from tda_plugins.store import StoreReader
from tests.models import VOCAB, tiny_causal_lm
from tests.oracle import func_oracle
from tests.stores import (
    flat_oracle_grads,
    linear_parameter_names,
    made_stores,
    rel_error,
    scores_by_id,
    store_parameter_names,
)

REL_TOL = 1e-5
ARCHS = ("llama", "gpt2")


# -- data and processes --------------------------------------------------------------------


def random_sequences(ids: range, seed: int) -> dict[int, list[int]]:
    """Example id -> 3..12 random token ids (no padding token)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 13, (len(ids),), generator=gen).tolist()
    return {
        i: torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        for i, n in zip(ids, lengths, strict=True)
    }


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_examples(path: Path, sequences: dict[int, list[int]]) -> Path:
    return write_jsonl(path, [{"input_ids": s, "id": i} for i, s in sequences.items()])


def text_of(sequence: list[int]) -> str:
    """How a tokenizer-free capture stores an example's text: its ids joined by spaces."""
    return " ".join(map(str, sequence))


def right_padded(sequences: list[list[int]]) -> dict[str, Tensor]:
    """One right-padded causal-LM batch (pad 0, label -100), written here for the oracle."""
    length = max(map(len, sequences))
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run_tda(*args: object) -> None:
    """``tda args`` through the entry point's ``main`` in this process; it must exit 0."""
    assert main([str(a) for a in args]) == 0, args


def run_main(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``tda args`` run in this process."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # argparse: --help and usage errors
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, command: str, *fragments: str) -> str:
    """Exit 2, no traceback, and a last stderr line ``tda <command>: error: ...`` that
    contains every fragment (progress bars may come before it). Returns that line."""
    assert code == 2, err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"tda {command}: error: "), err
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


@dataclass
class CliRun:
    """One model's ``tda capture`` (train and queries) and ``tda attribute --method graddot``."""

    model: nn.Module
    model_dir: Path
    train: dict[int, list[int]]
    queries: dict[int, list[int]]
    train_file: Path
    store: Path
    query_store: Path
    out: Path


def capture_args(model_dir: Path, data: Path, out: Path, *extra: object) -> list[object]:
    """``tda capture`` of a JSONL file with an fp64 model, plus ``extra`` options."""
    options = ["--model", model_dir, "--data", data, "--out", out, "--dtype", "float64"]
    return ["capture", *options, *extra]


def attribute_args(
    store: Path, queries: Path, out: Path, *extra: object, method: str = "graddot"
) -> list[object]:
    """``tda attribute --method <method>``, plus ``extra`` options."""
    options = ["--store", store, "--queries", queries, "--method", method, "--out", out]
    return ["attribute", *options, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CliRun]:
    """fp64 tiny Llama and GPT-2 saved with ``save_pretrained`` (no tokenizer); 8 training
    examples (ids 100-107, batches of 3) and 3 queries (ids 900-902) of 3-12 tokens.

    Every command runs through ``main`` in this process (the console script itself is
    checked by ``test_console_script_help_and_error_exit_codes``)."""
    root = tmp_path_factory.mktemp("cli")
    train, queries = random_sequences(range(100, 108), 1), random_sequences(range(900, 903), 2)
    train_file = write_examples(root / "train.jsonl", train)
    query_file = write_examples(root / "queries.jsonl", queries)
    out: dict[str, CliRun] = {}
    for arch in ARCHS:
        directory = root / arch
        model = tiny_causal_lm(arch)
        model.save_pretrained(directory / "model")
        out[arch] = CliRun(
            model,
            directory / "model",
            train,
            queries,
            train_file,
            directory / "store",
            directory / "queries",
            directory / "out",
        )
    for r in out.values():
        run_tda(*capture_args(r.model_dir, train_file, r.store, "--batch-size", 3))
        run_tda(*capture_args(r.model_dir, query_file, r.query_store))
        run_tda(*attribute_args(r.store, r.query_store, r.out, "--top-k", 3))
    return out


@pytest.fixture(params=ARCHS)
def run(request: pytest.FixtureRequest, runs: dict[str, CliRun]) -> CliRun:
    return runs[request.param]


def oracle_dots(run: CliRun) -> Tensor:
    """``(N, M)`` exact dot products of the linear layers' per-example gradients, rows and
    columns in JSONL order."""
    names = linear_parameter_names(run.model)
    grads = [
        flat_oracle_grads(run.model, [right_padded(list(s.values()))], names, func_oracle)
        for s in (run.train, run.queries)
    ]
    return grads[0] @ grads[1].T


def saved_scores(run: CliRun) -> Scores:
    """The scores file read with safetensors directly (not through ``Scores.load``)."""
    tensors = load_file(run.out / "scores.safetensors")
    return Scores(tensors["train_ids"], tensors["query_ids"], tensors["values"], "graddot")


# -- 7: capture + attribute ----------------------------------------------------------------


@pytest.mark.slow
def test_cli_graddot_equals_oracle_dot_matrix(run: CliRun) -> None:
    """``tda capture`` + ``tda attribute --method graddot`` (fp64) give the exact dot
    products of the linear layers' per-example gradients, keyed by the JSONL ids."""
    store = StoreReader(run.store)
    assert sorted(store_parameter_names(run.model, store)) == sorted(
        linear_parameter_names(run.model)
    )
    got = scores_by_id(
        saved_scores(run), torch.tensor(list(run.train)), torch.tensor(list(run.queries))
    )
    assert rel_error(got, oracle_dots(run)) <= REL_TOL


@pytest.mark.slow
def test_cli_topk_and_report_name_real_examples(run: CliRun) -> None:
    """``topk.json`` lists the JSONL ids, the oracle's best example first; ``report.html``
    shows each query's text and the text of its most helpful example."""
    topk = json.loads((run.out / "topk.json").read_text())
    assert topk["method"] == "graddot"
    assert [q["query_id"] for q in topk["queries"]] == list(run.queries)
    best = oracle_dots(run).argmax(dim=0).tolist()
    train_ids = list(run.train)
    html = (run.out / "report.html").read_text()
    for entry, row in zip(topk["queries"], best, strict=True):
        listed = [r["id"] for r in entry["helpful"] + entry["harmful"]]
        assert len(listed) == 6 and set(listed) <= set(train_ids)
        assert entry["helpful"][0]["id"] == train_ids[row]
        assert f"<pre>{text_of(run.queries[entry['query_id']])}</pre>" in html
        assert f"<pre>{text_of(run.train[train_ids[row]])}</pre>" in html


@pytest.mark.slow
def test_tda_score_equals_capture_then_attribute(run: CliRun, tmp_path: Path) -> None:
    """``tda score`` (no store) writes the same scores, ids, top-k and report texts as
    ``tda capture`` of both files then ``tda attribute --method graddot``, and so the
    oracle's dot products."""
    out = tmp_path / "scored"
    queries = run.train_file.parent / "queries.jsonl"
    options = ["--data", run.train_file, "--queries", queries, "--out", out, "--top-k", 3]
    run_tda("score", "--model", run.model_dir, *options, "--dtype", "float64", "--batch-size", 3)
    got, expected = Scores.load(out), Scores.load(run.out)
    assert torch.equal(got.train_ids, expected.train_ids)
    assert torch.equal(got.query_ids, expected.query_ids)
    assert rel_error(got.values, expected.values) <= REL_TOL
    got_topk = json.loads((out / "topk.json").read_text())
    expected_topk = json.loads((run.out / "topk.json").read_text())
    ranked = [
        [[r["id"] for r in q[side]] for side in ("helpful", "harmful")] for q in got_topk["queries"]
    ]
    assert ranked == [
        [[r["id"] for r in q[side]] for side in ("helpful", "harmful")]
        for q in expected_topk["queries"]
    ]
    assert (out / "report.html").read_text() == (run.out / "report.html").read_text()


def test_tda_score_under_torchrun_names_capture_and_attribute(
    capsys: pytest.CaptureFixture[str],
    runs: dict[str, CliRun],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Launched on several ranks (``WORLD_SIZE``, as torchrun sets it), every rank would
    score every row: refused with the commands that split the work, nothing written."""
    run = runs["llama"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "scored"
    queries = run.train_file.parent / "queries.jsonl"
    args = ["--data", run.train_file, "--queries", queries, "--out", out]
    code, _, err = run_main(capsys, "score", "--model", run.model_dir, *args)
    assert_one_line_error(
        code, err, "score", "runs in one process", "tda capture and tda attribute"
    )
    assert not out.exists()


def test_tda_report_under_torchrun_is_refused_before_writing(
    capsys: pytest.CaptureFixture[str],
    runs: dict[str, CliRun],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every rank would write the same page, and the second would fail on the first's
    file: refused under torchrun, naming the way (without it), nothing written."""
    run = runs["llama"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    page = tmp_path / "page.html"
    argv = ["report", "--scores", run.out, "--store", run.store, "--queries", run.query_store]
    code, _, err = run_main(capsys, *argv, "--out", page)
    assert_one_line_error(code, err, "report", "runs in one process", "without torchrun")
    assert not page.exists()


def test_tda_capture_refuses_projection_sizes_without_a_projection(
    capsys: pytest.CaptureFixture[str], runs: dict[str, CliRun], tmp_path: Path
) -> None:
    """``--k`` without ``--projection`` used to write an exact store, and ``--k`` with a
    factor projection one of the default sizes, each exiting 0: refused, nothing written."""
    run = runs["llama"]
    out = tmp_path / "projected"
    capture = ["capture", "--model", run.model_dir, "--data", run.train_file, "--out", out]
    code, _, err = run_main(capsys, *capture, "--k", 4)
    assert_one_line_error(code, err, "capture", "k (--k) given", "projection='none'")
    code, _, err = run_main(capsys, *capture, "--projection", "factor", "--k", 4)
    assert_one_line_error(code, err, "capture", "k (--k) given", "k_a (--k-a), k_g (--k-g)")
    assert not out.exists()


def test_tda_attribute_refuses_a_learning_rate_its_method_ignores(
    capsys: pytest.CaptureFixture[str], runs: dict[str, CliRun], tmp_path: Path
) -> None:
    """Only TracIn weighs by a learning rate; any other method used to accept and ignore
    it."""
    run = runs["llama"]
    out = tmp_path / "scores"
    argv = [*attribute_args(run.store, run.query_store, out), "--learning-rate", "0.001"]
    code, _, err = run_main(capsys, *argv)
    assert_one_line_error(code, err, "attribute", "--learning-rate applies to --method tracin")
    assert not out.exists()


def test_report_rerenders_the_attribute_report(
    capsys: pytest.CaptureFixture[str], runs: dict[str, CliRun], tmp_path: Path
) -> None:
    """``tda report`` from the saved scores and stores writes the same page ``tda attribute``
    wrote, at the top-k it was saved with unless given; it replaces that page only with
    ``--force``."""
    run = runs["llama"]
    page = tmp_path / "page.html"
    argv = ["report", "--scores", run.out, "--store", run.store, "--queries", run.query_store]
    code, _, err = run_main(capsys, *argv, "--out", page)
    assert code == 0, err
    assert page.read_text() == (run.out / "report.html").read_text()
    wider = tmp_path / "wider.html"
    code, _, err = run_main(capsys, *argv, "--top-k", 4, "--out", wider)
    assert code == 0, err
    assert wider.read_text() != page.read_text()
    before = (run.out / "report.html").read_text()
    code, _, err = run_main(capsys, *argv, "--top-k", 4)
    assert_one_line_error(code, err, "report", "exists", "--force")
    assert (run.out / "report.html").read_text() == before


# -- 8: help and bad input -----------------------------------------------------------------


@pytest.mark.slow
def test_console_script_help_and_error_exit_codes(tmp_path: Path) -> None:
    """The installed ``tda`` script (and ``python -m tda_plugins``): ``--help`` exits 0 and
    names the subcommands; a missing store exits 2 with one ``tda attribute: error:``
    line."""
    script = Path(sys.executable).with_name("tda")
    assert script.exists(), f"no console script at {script}; pip install -e ."
    for launcher in ([script], [sys.executable, "-m", "tda_plugins"]):
        shown = subprocess.run([*launcher, "--help"], capture_output=True, text=True)
        assert shown.returncode == 0, launcher
        for command in ("capture", "attribute", "report"):
            assert command in shown.stdout
    missing = tmp_path / "nowhere"
    failed = subprocess.run(
        [script, *attribute_args(missing, missing, tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert_one_line_error(failed.returncode, failed.stderr, "attribute", "no gradient store")


def test_option_choices_are_the_registries() -> None:
    """The parser's torch-free choices name every registered method and durability mode."""
    from tda_plugins.cli import choices
    from tda_plugins.methods import METHODS
    from tda_plugins.session.scoring import LIVE_METHODS
    from tda_plugins.store.sync import DURABILITY

    assert tuple(sorted(METHODS)) == choices.METHODS
    assert tuple(sorted(LIVE_METHODS)) == choices.LIVE_METHODS
    assert tuple(sorted(DURABILITY)) == choices.DURABILITY


def test_layer_option_defaults_are_the_settings_defaults() -> None:
    """The torch-free parser's layer and projection defaults are the callbacks' own (what
    --like compares against to tell which options were given)."""
    from tda_plugins.session.settings import LAYER_OPTION_DEFAULTS

    args = build_parser().parse_args(["capture", "--model", "m", "--data", "d", "--out", "o"])
    assert {name: getattr(args, name) for name in LAYER_OPTION_DEFAULTS} == LAYER_OPTION_DEFAULTS


def test_like_captures_queries_with_the_stores_layers_and_projection(
    runs: dict[str, CliRun], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A store of linear layers but the head, factor-projected with its own sizes and seed:
    queries captured with --like hold its very layers and projection, and score as queries
    captured with the same options spelled out; --like with a layer option is refused."""
    run = runs["llama"]
    options = ["--layers", "linear", "--exclude", "lm_head", "--projection", "factor"]
    options += ["--k-a", 4, "--k-g", 6, "--seed", 3]
    store, spelled, like = tmp_path / "store", tmp_path / "spelled", tmp_path / "like"
    run_tda(*capture_args(run.model_dir, run.train_file, store, *options))
    queries = write_examples(tmp_path / "q.jsonl", run.queries)
    run_tda(*capture_args(run.model_dir, queries, spelled, *options))
    run_tda(*capture_args(run.model_dir, queries, like, "--like", store))
    config = StoreReader(store).config
    assert "lm_head" not in config.layers and config.projection is not None
    assert StoreReader(like).config.layers == config.layers
    assert StoreReader(like).config.projection == config.projection
    for name, folder in (("spelled", spelled), ("like", like)):
        run_tda(*attribute_args(store, folder, tmp_path / f"scores-{name}"))
    got, expected = (Scores.load(tmp_path / f"scores-{n}") for n in ("like", "spelled"))
    assert torch.equal(got.values, expected.values)
    refused = capture_args(run.model_dir, queries, tmp_path / "x", "--like", store, "--k-a", 8)
    code, _, err = run_main(capsys, *refused)
    assert_one_line_error(code, err, "capture", "--like takes the layers", "--k-a")


SUBCOMMAND_OPTIONS = {
    "capture": [
        "--model",
        "--data",
        "--out",
        "--layers",
        "--projection",
        "--k-a",
        "--keep-tokens",
        "--like",
    ],
    "attribute": ["--store", "--queries", "--method", "--damping", "--checkpoint", "--top-k"],
    "report": ["--scores", "--store", "--queries", "--out"],
    "score": ["--model", "--data", "--queries", "--method", "--layers", "--projection", "--out"],
}


@pytest.mark.parametrize("command", sorted(SUBCOMMAND_OPTIONS))
def test_subcommand_help_documents_every_option(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """``tda <cmd> --help`` exits 0 and shows every option of the parser with a help text."""
    code, out, _ = run_main(capsys, command, "--help")
    assert code == 0
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    options = [a for a in sub.choices[command]._actions if a.dest != "help"]  # type: ignore[index]
    assert options
    for action in options:
        assert action.help, f"{action.option_strings} has no help text"
        assert action.option_strings[0] in out
    for name in SUBCOMMAND_OPTIONS[command]:
        assert name in out
    if command == "attribute":
        for method in ("graddot", "gradcos", "tracin", "kfac", "ekfac", "logra", "less"):
            assert method in out


Arguments = Callable[[CliRun, Path], list[object]]


def capture_with(data: list[dict]) -> Arguments:
    """``tda capture`` of the llama model on a JSONL file with these rows."""
    return lambda r, tmp: capture_args(r.model_dir, write_jsonl(tmp / "x.jsonl", data), tmp / "out")


BAD_INPUT: dict[str, tuple[Arguments, tuple[str, ...]]] = {
    "missing store": (
        lambda r, tmp: attribute_args(tmp / "nowhere", r.query_store, tmp / "out"),
        ("no gradient store", "nowhere"),
    ),
    "less without optimizer state": (
        lambda r, tmp: attribute_args(r.store, r.query_store, tmp / "out", method="less"),
        ("no optimizer state", "save_adam_state"),
    ),
    "missing scores": (
        lambda r, tmp: [
            "report",
            "--scores",
            tmp / "none",
            "--store",
            r.store,
            "--queries",
            r.store,
        ],
        ("scores.safetensors",),
    ),
    "missing model dir": (
        lambda r, tmp: capture_args(tmp / "no-model", r.train_file, tmp / "out"),
        ("no transformers model", "no-model"),
    ),
    "empty data file": (capture_with([]), ("holds no example",)),
    "line without usable keys": (
        capture_with([{"input_ids": [1, 2, 3], "id": 1}, {"tokens": [1, 2], "id": 2}]),
        ("line 2", "input_ids", "tokens"),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_exits_2_with_one_line_error(
    capsys: pytest.CaptureFixture[str], runs: dict[str, CliRun], tmp_path: Path, case: str
) -> None:
    """Each bad input ends with exit code 2 and one ``tda <cmd>: error:`` line that names
    the cause (the path, or the JSONL line and the keys it has); nothing is written."""
    arguments, fragments = BAD_INPUT[case]
    argv = arguments(runs["llama"], tmp_path)
    code, _, err = run_main(capsys, *argv)
    assert_one_line_error(code, err, str(argv[0]), *fragments)
    assert not (tmp_path / "out").exists()


def test_queries_captured_with_another_projection_are_refused(
    capsys: pytest.CaptureFixture[str], runs: dict[str, CliRun], tmp_path: Path
) -> None:
    """Queries captured with ``--projection factor`` against a store captured without
    projection: exit 2, and the message says the projection differs."""
    run = runs["llama"]
    queries = write_examples(tmp_path / "q.jsonl", run.queries)
    factor = ("--projection", "factor", "--k-a", 4, "--k-g", 4)
    code, _, err = run_main(capsys, *capture_args(run.model_dir, queries, tmp_path / "fq", *factor))
    assert code == 0, err
    code, _, err = run_main(capsys, *attribute_args(run.store, tmp_path / "fq", tmp_path / "out"))
    assert_one_line_error(code, err, "attribute", "projection differs")


def test_unknown_method_is_rejected_by_argparse(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An unregistered ``--method`` is a usage error (exit 2) naming the valid choices."""
    argv = attribute_args(tmp_path, tmp_path, tmp_path / "out", method="magic")
    code, _, err = run_main(capsys, *argv)
    assert code == 2
    assert "invalid choice: 'magic'" in err and "graddot" in err


# -- 9: appending ----------------------------------------------------------------------------


def shard_entries(store: Path) -> list[dict]:
    return json.loads((store / "rank-0" / "index.json").read_text())["shards"]


def file_digests(store: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in (store / "rank-0").glob("s*.safetensors")
    }


def test_capture_into_an_existing_store_appends(
    capsys: pytest.CaptureFixture[str], runs: dict[str, CliRun], tmp_path: Path
) -> None:
    """A second ``tda capture`` into the same store is refused without ``--append`` (exit 2,
    nothing changed); with it, it adds its examples with step numbers after the existing
    ones (none reused), leaves the existing shards byte for byte, and merges the texts; a
    capture with another projection into it is refused (exit 2) and changes nothing."""
    run = runs["llama"]
    store = tmp_path / "store"
    shutil.copytree(run.store, store)
    before, digests = shard_entries(store), file_digests(store)
    assert [s["step"] for s in before] == [0, 1, 2]  # 8 examples in batches of 3
    more = random_sequences(range(200, 205), 3)
    data = write_examples(tmp_path / "more.jsonl", more)
    code, _, err = run_main(capsys, *capture_args(run.model_dir, data, store, "--batch-size", 2))
    assert_one_line_error(code, err, "capture", "already holds steps 0..2", "--append")
    assert shard_entries(store) == before
    code, _, err = run_main(
        capsys, *capture_args(run.model_dir, data, store, "--batch-size", 2, "--append")
    )
    assert code == 0, err

    after = shard_entries(store)
    assert after[: len(before)] == before
    added = after[len(before) :]
    assert [s["step"] for s in added] == [3, 4, 5]  # 5 examples in batches of 2
    assert sorted(i for s in added for i in s["example_ids"]) == list(more)
    assert {name: file_digests(store)[name] for name in digests} == digests
    assert len(file_digests(store)) == len(after)

    factor = ("--projection", "factor", "--k-a", 4, "--k-g", 4)
    code, _, err = run_main(capsys, *capture_args(run.model_dir, data, store, *factor, "--append"))
    assert_one_line_error(code, err, "capture", "another config")
    assert shard_entries(store) == after

    reader = StoreReader(store)
    assert reader.num_examples == len(run.train) + len(more)
    assert reader.steps == [0, 1, 2, 3, 4, 5]
    texts = reader.texts()
    assert texts[100] == text_of(run.train[100]) and texts[204] == text_of(more[204])

    # the same file again (a capture resumed after a crash with its whole --data): the
    # examples the store holds are named as such, not as duplicates within the file
    code, _, err = run_main(capsys, *capture_args(run.model_dir, data, store, "--append"))
    assert_one_line_error(code, err, "capture", "already holds example id 200", "(5 of the 5")
    assert shard_entries(store) == after


@pytest.mark.parametrize(("extra", "durability"), [((), "end"), (("--durability", "step"), "step")])
def test_capture_durability_reaches_the_store(
    capsys: pytest.CaptureFixture[str],
    runs: dict[str, CliRun],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    extra: tuple[str, ...],
    durability: str,
) -> None:
    """``tda capture`` makes its store durable once it has ended (``end``) unless
    ``--durability`` says otherwise; it stores the same examples in the same steps."""
    from tda_plugins.session import dataset
    from tda_plugins.store.writer import DURABILITY

    made = made_stores(monkeypatch, dataset)
    run = runs["llama"]
    args = capture_args(run.model_dir, run.train_file, tmp_path / "s", "--batch-size", 3, *extra)
    code, _, err = run_main(capsys, *args)
    assert code == 0, err
    assert [s.durability for s in made] == [DURABILITY[durability]]
    assert (
        StoreReader(tmp_path / "s").step_example_ids() == StoreReader(run.store).step_example_ids()
    )


def test_capture_fails_when_its_end_sync_fails(
    capsys: pytest.CaptureFixture[str],
    runs: dict[str, CliRun],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed fsync of the end pass (an I/O error) is the command's failure, exit 2 with
    one line, not a logged error after a success: a script's `tda capture && tda
    attribute` stops there."""
    import errno

    from tda_plugins.store import sync

    def failing(path: Path) -> None:
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(sync, "fsync_path", failing)
    run = runs["llama"]
    code, _, err = run_main(capsys, *capture_args(run.model_dir, run.train_file, tmp_path / "s"))
    assert_one_line_error(code, err, "capture", "durable failed", "Input/output error")


def test_an_output_that_holds_an_input_is_refused_even_with_force(
    capsys: pytest.CaptureFixture[str], run: CliRun, tmp_path: Path
) -> None:
    """``--out`` that is, or holds, the store or the queries would delete them when the
    output replaces it: refused, with or without ``--force``, and nothing is removed. A
    report ``--out`` that is a folder is refused too. New output folders get the
    permissions of any new folder."""
    import os
    import shutil

    root = tmp_path / "run"
    shutil.copytree(run.store, root / "grads")
    shutil.copytree(run.query_store, root / "queries")
    stores = ["--store", root / "grads", "--queries", root / "queries", "--method", "graddot"]
    for out in (root, root / "grads", root / "queries"):
        code, _, err = run_main(capsys, "attribute", *stores, "--out", out, "--force")
        assert_one_line_error(code, err, "attribute", "an input of this command")
    assert StoreReader(root / "grads").num_examples == StoreReader(run.store).num_examples
    assert (root / "queries" / "store.json").exists()
    code, _, err = run_main(capsys, "attribute", *stores, "--out", tmp_path / "scores")
    assert code == 0, err
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "scores").stat().st_mode & 0o777 == 0o777 & ~mask
    report = ["report", "--scores", tmp_path / "scores", "--store", root / "grads"]
    code, _, err = run_main(
        capsys, *report, "--queries", root / "queries", "--out", root, "--force"
    )
    assert_one_line_error(code, err, "report", "is a folder")


def test_loss_switches_reach_the_store_and_like_captures_inherit_them(
    runs: dict[str, CliRun], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--no-completion-only-loss`` / ``--assistant-only-loss`` / ``--eos`` are the rows'
    loss tokens, recorded in the store; ``--like`` of it takes them when not given;
    ``tda score`` passes them on."""
    from tda_plugins.cli import runs as cli_runs

    run = runs["llama"]
    first = tmp_path / "full"
    switches = ("--no-completion-only-loss", "--eos")
    run_tda(*capture_args(run.model_dir, run.train_file, first, *switches))
    full = {
        "completion_only_loss": False,
        "assistant_only_loss": False,
        "eos": True,
        "max_length": None,  # a capture cuts no rows of its own; a training run records its
        "keep_end": False,
        "eos_token": None,  # the tokenizer's own
        "text_field": "text",
        "completion_mask": False,
    }
    assert StoreReader(first).metadata["loss_tokens"] == full
    run_tda(*capture_args(run.model_dir, run.train_file, tmp_path / "like", "--like", first))
    assert StoreReader(tmp_path / "like").metadata["loss_tokens"] == full
    given: dict[str, object] = {}

    def recorded(*args: object, **kwargs: object) -> None:
        given.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(cli_runs, "score_examples", recorded)
    with pytest.raises(SystemExit):
        main(["score", "--model", str(run.model_dir), "--data", str(run.train_file),
              "--queries", str(run.train_file), "--out", str(tmp_path / "s"),
              "--assistant-only-loss"])  # fmt: skip
    assert given["assistant_only_loss"] is True and given["completion_only_loss"] is None
    assert given["eos"] is None  # off: tda score has no store to take it from


# -- 10: model placement ---------------------------------------------------------------------


def test_capture_with_device_map_equals_the_plain_capture(
    capsys: pytest.CaptureFixture[str], runs: dict[str, CliRun], tmp_path: Path
) -> None:
    """``--device-map auto`` (transformers places the model; on a machine without GPU all
    of it on the CPU) stores bitwise the gradients of the plain capture, same order."""
    run = runs["llama"]
    stores = {}
    for name, extra in (("plain", ()), ("mapped", ("--device-map", "auto"))):
        out = tmp_path / name
        code, _, err = run_main(
            capsys, *capture_args(run.model_dir, run.train_file, out, "--batch-size", 3, *extra)
        )
        assert code == 0, err
        stores[name] = StoreReader(out).load_all()
    plain, mapped = stores["plain"], stores["mapped"]
    assert mapped.example_ids.tolist() == plain.example_ids.tolist() == list(run.train)
    for name, grads in plain.layers.items():
        assert torch.equal(mapped.layers[name].materialize(), grads.materialize()), name
