"""``tda`` on bad input: exit code 2, one line naming the input and the fix, nothing written.

Every case runs :func:`tda_plugins.cli.main` in this process on tiny saved models (GPT-2
with 64 positions, Llama) and a store and queries captured once for the module.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tda_plugins.cli import main
from tda_plugins.store import StoreReader
from tda_plugins.store.layout import CURVATURE_FILE, rank_dir
from tests.models import VOCAB, tiny_causal_lm


@dataclass
class Setup:
    """Saved models, a training store, queries and scores, built once."""

    root: Path
    llama: Path
    gpt2: Path
    data: Path
    store: Path
    queries: Path
    scores: Path


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str]:
    """Exit code and stderr of ``tda args`` in this process (argparse exits are caught)."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("cli-faults")
    for arch in ("llama", "gpt2"):
        tiny_causal_lm(arch).save_pretrained(root / arch)
    rows = [{"input_ids": [3 + i, 5, 7 + i, 9], "id": i} for i in range(6)]
    data = write_jsonl(root / "train.jsonl", rows)
    queries = write_jsonl(root / "queries.jsonl", [{"input_ids": [4, 6, 8], "id": 100}])
    for source, out in ((data, "store"), (queries, "queries")):
        argv = ["capture", "--model", root / "llama", "--data", source, "--out", root / out]
        assert main([str(a) for a in argv]) == 0
    scores = ["attribute", "--store", root / "store", "--queries", root / "queries"]
    assert main([str(a) for a in [*scores, "--method", "graddot", "--out", root / "scores"]]) == 0
    return Setup(
        root, root / "llama", root / "gpt2", data, root / "store", root / "queries", root / "scores"
    )


Case = Callable[[Setup, Path], list[object]]


def capture(
    model: str = "llama", data: list[object] | None = None, extra: tuple[str, ...] = ()
) -> Case:
    """``tda capture`` of ``setup.data`` (or of the rows ``data``) into ``tmp/out``, then
    ``extra`` (without it, ``--out`` is the last argument); a ``model`` other than
    llama/gpt2 is an empty folder of that name."""

    def argv(s: Setup, tmp: Path) -> list[object]:
        source = s.data if data is None else write_jsonl(tmp / "d.jsonl", data)
        if model in ("llama", "gpt2"):
            model_dir = getattr(s, model)
        else:
            model_dir = tmp / model
            model_dir.mkdir(exist_ok=True)
        return ["capture", "--model", model_dir, "--data", source, "--out", tmp / "out", *extra]

    return argv


def attribute(*extra: object, method: str = "graddot") -> Case:
    def argv(s: Setup, tmp: Path) -> list[object]:
        options = ["--store", s.store, "--queries", s.queries, "--method", method]
        return ["attribute", *options, "--out", tmp / "out", *extra]

    return argv


#: case -> (arguments, fragments the error line must contain)
BAD_INPUT: dict[str, tuple[Case, tuple[str, ...]]] = {
    "--damping for a method without curvature": (
        attribute("--damping", "0.5"),
        ("damping applies to the curvature methods", "'graddot'"),
    ),
    "token id past the vocabulary": (
        capture(data=[{"input_ids": [1, 2, VOCAB + 5]}]),
        ("line 1", f"token id {VOCAB + 5}", "vocabulary"),
    ),
    "negative token id": (capture(data=[{"input_ids": [1, -3, 4]}]), ("line 1", "-3")),
    "labels of another length": (
        capture(data=[{"input_ids": [1, 2, 3], "labels": [1, 2]}]),
        ("line 1", "'labels' has 2 entries for 3 input_ids"),
    ),
    "label outside the vocabulary": (
        capture(data=[{"input_ids": [1, 2, 3], "labels": [1, 2, 999]}]),
        ("line 1", "999"),
    ),
    "text that is not a string": (
        capture(data=[{"text": 5}]),
        ("line 1", "'text' must be a string"),
    ),
    "id that is not an integer": (
        capture(data=[{"input_ids": [1, 2, 3], "id": "x"}]),
        ("line 1", "'id' must be an integer"),
    ),
    "row that is not an object": (capture(data=[[1, 2, 3]]), ("line 1", "JSON object")),
    "only empty lines": (capture(data=[]), ("holds no example",)),
    "mixed explicit and missing ids": (
        capture(data=[{"input_ids": [1, 2, 3], "id": 1}, {"input_ids": [4, 5, 6]}]),
        ("d.jsonl:2 has no 'id' while", "d.jsonl:1 has one"),
    ),
    "duplicated explicit ids": (
        capture(data=[{"input_ids": [1, 2, 3], "id": 1}, {"input_ids": [4, 5, 6], "id": 1}]),
        ("d.jsonl: rows 1 and 2 have the same example id 1", "its own 'id'"),
    ),
    "rows of the same tokens without ids": (
        capture(data=[{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [1, 2, 3]}]),
        ("d.jsonl: rows 1 and 3 have the same example id", "same content hash"),
    ),
    "directory as --data": (
        lambda s, tmp: ["capture", "--model", s.llama, "--data", tmp, "--out", tmp / "out"],
        ("is not a file",),
    ),
    "model directory without config.json": (
        capture(model="empty-model"),
        ("no transformers model", "missing config.json"),
    ),
    "--out is a file": (
        lambda s, tmp: [*capture()(s, tmp)[:-1], write_jsonl(tmp / "out", [])],
        ("is a file",),
    ),
    "--out is a folder of other files": (
        lambda s, tmp: [*capture()(s, tmp)[:-1], write_jsonl(tmp / "mine" / "x.txt", []).parent],
        ("holds no gradient store",),
    ),
    "capture into a store without --append": (
        lambda s, tmp: [*capture()(s, tmp)[:-1], s.store],
        ("already holds steps", "--append"),
    ),
    "queries of another model": (
        lambda s, tmp: [
            "attribute",
            "--store",
            s.store,
            "--queries",
            capture_queries(s, tmp, "gpt2"),
            "--method",
            "graddot",
            "--out",
            tmp / "out",
        ],
        ("do not match the store",),
    ),
    "existing --out without --force": (
        lambda s, tmp: [*attribute()(s, tmp)[:-1], s.scores],
        ("exists", "--force"),
    ),
    "--out inside a file": (
        lambda s, tmp: [*attribute()(s, tmp)[:-1], write_jsonl(tmp / "f", []) / "out"],
        ("cannot write into",),
    ),
    "--checkpoint without tracin": (
        attribute("--checkpoint", "a", "b", "1.0"),
        ("--checkpoint applies to --method tracin only",),
    ),
    "--checkpoint learning rate not a number": (
        attribute("--checkpoint", "a", "b", "abc", method="tracin"),
        ("--checkpoint a b abc", "'abc' is not a number"),
    ),
    "--checkpoint learning rate not positive": (
        attribute("--checkpoint", "a", "b", "-1", method="tracin"),
        ("--checkpoint a b -1", "more than 0"),
    ),
    "--learning-rate without tracin": (
        attribute("--learning-rate", "0.5"),
        ("--learning-rate applies to --method tracin only",),
    ),
    "--curvature-head without curvature": (
        capture(extra=("--no-curvature", "--curvature-head")),
        ("--curvature-head", "--no-curvature turns off"),
    ),
    "--curvature-budget-gb without curvature": (
        capture(extra=("--no-curvature", "--curvature-budget-gb", "1")),
        ("--curvature-budget-gb", "--no-curvature turns off"),
    ),
    "missing store": (
        lambda s, tmp: [
            "attribute",
            "--store",
            tmp / "nowhere",
            "--queries",
            s.queries,
            "--method",
            "graddot",
            "--out",
            tmp / "out",
        ],
        ("no gradient store", "nowhere"),
    ),
    "index entry missing a key": (
        lambda s, tmp: attribute()(damaged(s, tmp, "index"), tmp),
        ("lacks ['xxh3']",),
    ),
    "truncated curvature file": (
        lambda s, tmp: attribute(method="kfac")(damaged(s, tmp, "curvature"), tmp),
        ("cannot read K-FAC statistics",),
    ),
    "--device-map with --device": (
        capture(extra=("--device-map", "auto", "--device", "cpu:0")),
        ("--device-map places the model itself",),
    ),
    "unknown --device-map": (capture(extra=("--device-map", "bogus")), ("bogus",)),
    "report from the stores swapped": (
        lambda s, tmp: report(s.scores, s.queries, s.store, tmp),
        ("--store", "is not the store the scores", "were computed from"),
    ),
    "report from another store of the same ids": (
        lambda s, tmp: report(s.scores, other_store(s, tmp), s.queries, tmp),
        ("--store", "is not the store the scores", "its rows differ"),
    ),
    "report of scores that record no stores, from the stores swapped": (
        lambda s, tmp: report(damaged_scores(s, tmp, "sources"), s.queries, s.store, tmp),
        ("--store", "holds no example 0 of the scores", "scored from"),
    ),
    "report of scores without their ids": (
        lambda s, tmp: report(damaged_scores(s, tmp, "ids"), s.store, s.queries, tmp),
        ("lacks ['train_ids']", "not scores tda attribute wrote"),
    ),
    "report of scores whose matrix does not fit its ids": (
        lambda s, tmp: report(damaged_scores(s, tmp, "shape"), s.store, s.queries, tmp),
        ("values are (5, 1) for 6 training and 1 query ids", "damaged"),
    ),
    "report over an existing page without --force": (
        lambda s, tmp: [
            "report",
            "--scores",
            s.scores,
            "--store",
            s.store,
            "--queries",
            s.queries,
            "--out",
            write_jsonl(tmp / "page.html", []),
        ],
        ("exists", "--force"),
    ),
}

#: argparse usage errors (exit 2, the last line names the option and the value)
USAGE_ERRORS: dict[str, tuple[Case, str]] = {
    "--batch-size -1": (capture(extra=("--batch-size", "-1")), "--batch-size"),
    "--batch-size 0": (capture(extra=("--batch-size", "0")), "--batch-size"),
    "--max-length 0": (capture(extra=("--max-length", "0")), "--max-length"),
    "--k-a 0": (capture(extra=("--projection", "factor", "--k-a", "0")), "--k-a"),
    "bad --include regex": (capture(extra=("--include", "(")), "--include"),
    "bad --exclude regex": (capture(extra=("--exclude", "[a-")), "--exclude"),
    "unavailable --device cuda": (capture(extra=("--device", "cuda")), "not available"),
    "unknown --device": (capture(extra=("--device", "foo")), "not a torch device"),
    "--damping nan": (attribute("--damping", "nan"), "--damping"),
    "--damping inf": (attribute("--damping", "inf"), "--damping"),
    "--damping -1": (attribute("--damping", "-1"), "--damping"),
    "--top-k 0": (attribute("--top-k", "0"), "--top-k"),
    "--top-k -1": (attribute("--top-k", "-1"), "--top-k"),
    "--chunk 0": (attribute("--chunk", "0"), "--chunk"),
    "--learning-rate nan": (attribute("--learning-rate", "nan"), "--learning-rate"),
    "--learning-rate -2": (attribute("--learning-rate", "-2", method="tracin"), "more than 0"),
    "--k-g 0": (capture(extra=("--projection", "factor", "--k-g", "0")), "--k-g"),
    "--k 0": (capture(extra=("--projection", "dense", "--k", "0")), "--k"),
    "--last-n-blocks 0": (capture(extra=("--last-n-blocks", "0")), "--last-n-blocks"),
    "--batch-size x": (capture(extra=("--batch-size", "x")), "--batch-size"),
    "unavailable attribute --device cuda": (attribute("--device", "cuda"), "not available"),
    "unknown attribute --device": (attribute("--device", "tpu9"), "not a torch device"),
    "unknown --method": (attribute(method="magic"), "invalid choice: 'magic'"),
    "missing --out": (lambda s, tmp: attribute()(s, tmp)[:-2], "--out"),
}


def capture_queries(s: Setup, tmp: Path, arch: str) -> Path:
    out = tmp / f"q-{arch}"
    argv = ["capture", "--model", getattr(s, arch), "--data", s.root / "queries.jsonl"]
    assert main([str(a) for a in [*argv, "--out", out]]) == 0
    return out


def report(scores: Path, store: Path, queries: Path, tmp: Path) -> list[object]:
    """``tda report`` of ``scores`` from ``store`` and ``queries``, written into ``tmp``."""
    options = ["--store", store, "--queries", queries, "--out", tmp / "page.html"]
    return ["report", "--scores", scores, *options]


def damaged_scores(s: Setup, tmp: Path, what: str) -> Path:
    """A copy of the setup's scores folder whose ``scores.safetensors`` lacks its training
    ids (``"ids"``) or holds one row too few (``"shape"``), or whose ``topk.json`` records
    no stores (``"sources"``, as scores saved from Python); outside ``tmp``."""
    from safetensors.torch import load_file, save_file

    folder = tmp.parent / f"{tmp.name}-scores"
    shutil.copytree(s.scores, folder)
    if what == "sources":
        top = json.loads((folder / "topk.json").read_text())
        del top["sources"]
        (folder / "topk.json").write_text(json.dumps(top))
        return folder
    path = folder / "scores.safetensors"
    tensors = load_file(path)
    if what == "ids":
        del tensors["train_ids"]
    else:
        tensors["values"] = tensors["values"][:-1].contiguous()
    save_file(tensors, path, metadata={"method": "graddot"})
    return folder


def other_store(s: Setup, tmp: Path) -> Path:
    """The setup's training rows (the same ids) captured with the other model; outside
    ``tmp``."""
    out = tmp.parent / f"{tmp.name}-gpt2-store"
    argv = ["capture", "--model", s.gpt2, "--data", s.data, "--out", out]
    assert main([str(a) for a in argv]) == 0
    return out


def damaged(s: Setup, tmp: Path, what: str) -> Setup:
    """A copy of the setup whose training store has a damaged index or curvature file."""
    store = tmp / "damaged"
    shutil.copytree(s.store, store)
    if what == "index":
        path = rank_dir(store, 0) / "index.json"
        index = json.loads(path.read_text())
        index["shards"][0].pop("xxh3")
        path.write_text(json.dumps(index))
    else:
        path = rank_dir(store, 0) / CURVATURE_FILE
        path.write_bytes(path.read_bytes()[:40])
    return Setup(s.root, s.llama, s.gpt2, s.data, store, s.queries, s.scores)


def outputs(tmp: Path) -> set[str]:
    return {p.name for p in tmp.iterdir()}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_with_exit_2_and_writes_nothing(
    case: str, setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, fragments = BAD_INPUT[case]
    argv = make(setup, tmp_path)
    capsys.readouterr()
    store_before = sorted(p.name for p in setup.store.rglob("*"))
    before = outputs(tmp_path)
    code, err = run(capsys, *argv)
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("tda ")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"tda {argv[0]}: error: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert outputs(tmp_path) == before, "a refused command left output behind"
    assert sorted(p.name for p in setup.store.rglob("*")) == store_before


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_bad_option_values_are_usage_errors_before_any_work(
    case: str, setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse's errors too are one line (no usage block), naming the option."""
    make, fragment = USAGE_ERRORS[case]
    argv = make(setup, tmp_path)
    before = outputs(tmp_path)
    code, err = run(capsys, *argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"tda {argv[0]}: error: ") and fragment in lines[0], lines[0]
    assert outputs(tmp_path) == before


def test_examples_longer_than_the_models_positions_are_truncated_with_a_warning(
    setup: Setup,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """GPT-2's 64 positions: a 100-token example with ``--max-length 1000`` is captured as
    its first 64 tokens (it used to fail with an IndexError), with a logged warning (on
    stderr outside the tests)."""
    data = write_jsonl(tmp_path / "long.jsonl", [{"input_ids": [5] * 100, "id": 1}])
    argv = ["capture", "--model", setup.gpt2, "--data", data, "--out", tmp_path / "s"]
    with caplog.at_level("WARNING"):
        code, err = run(capsys, *argv, "--max-length", 1000)
    assert code == 0, err
    assert "max length 1000 is more than the model's 64 positions" in caplog.text
    assert StoreReader(tmp_path / "s").num_examples == 1


def test_force_replaces_an_existing_output_whole(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scores"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier run")
    argv = attribute()(setup, tmp_path)[:-1]  # every option but --out's value
    code, err = run(capsys, *argv, out, "--force")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "report.html",
        "scores.safetensors",
        "topk.json",
    ]


def test_allow_mismatch_scores_queries_of_another_model(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other-weights"
    tiny_causal_lm("llama", seed=3).save_pretrained(other)
    argv = ["capture", "--model", other, "--data", setup.root / "queries.jsonl"]
    assert run(capsys, *argv, "--out", tmp_path / "q")[0] == 0
    attribute_argv = [
        "attribute",
        "--store",
        setup.store,
        "--queries",
        tmp_path / "q",
        "--method",
        "graddot",
        "--out",
        tmp_path / "out",
    ]
    code, err = run(capsys, *attribute_argv)
    assert code == 2 and "other weights than the training run ended with" in err
    code, err = run(capsys, *attribute_argv, "--allow-mismatch")
    assert code == 0, err
