"""The README's quickstarts, run as written on a tiny model, so the README cannot rot.

Each marked block (``<!-- test: NAME -->`` before a code fence) is read from README.md and
run in a fresh folder: Python blocks in a namespace holding what the README says they
start from (``model`` and ``tokenizer`` loaded with ``from_pretrained`` from a local
directory, a ``train`` Dataset of prompt/completion rows with an integer ``id`` column,
``queries`` and ``target`` rows, and ``queries.jsonl``), shell blocks line by line through
the ``tda`` entry point (``tda_plugins.cli``'s ``main``).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers.training_args
from datasets import Dataset
from transformers import AutoModelForCausalLM

from tda_plugins import DataSelectionCallback
from tda_plugins.cli import main
from tda_plugins.data_selection import SelectionSettings
from tda_plugins.store import StoreReader
from tests.models import tiny_causal_lm
from tests.trainers import prompt_completion_pairs, word_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
#: Training rows: ids far from row positions; rows 3 and 11 share their text.
IDS = [500 + 3 * i for i in range(16)]


def block(name: str) -> str:
    """The code of the README block marked ``<!-- test: name -->``."""
    match = re.search(
        rf"<!-- test: {re.escape(name)} -->\n```\w+\n(.*?)```", README.read_text(), re.DOTALL
    )
    assert match, f"README.md has no block marked {name!r}"
    return match.group(1)


def train_rows() -> list[dict[str, Any]]:
    pairs = prompt_completion_pairs(len(IDS), seed=3)
    rows = [{**p.row(), "id": i} for p, i in zip(pairs, IDS, strict=True)]
    rows[11] = {**rows[3], "id": IDS[11]}  # a duplicated text under its own id
    return rows


def pair(row: dict[str, Any]) -> dict[str, str]:
    """A training row's prompt and completion, without its id."""
    return {"prompt": row["prompt"], "completion": row["completion"]}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh folder as the working directory, with a base model saved in it. SFTConfig
    trains in bf16 by default and refuses that without a GPU; here the CPU stands in for
    one (bf16 autocast on the CPU), so the snippets run with the defaults users get."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    tiny_causal_lm("llama", dtype=torch.float32).save_pretrained("base")
    word_tokenizer().save_pretrained("base")
    return tmp_path


def run_python(name: str) -> dict[str, Any]:
    """Run the block with the namespace the README promises; returns the namespace."""
    rows = train_rows()
    namespace: dict[str, Any] = {
        "model": AutoModelForCausalLM.from_pretrained("base"),
        "tokenizer": word_tokenizer(),
        "train": Dataset.from_list(rows),
        "queries": [pair(r) for r in rows[:2]],
        "target": Dataset.from_list(
            [{k: r[k] for k in ("prompt", "completion")} for r in rows[4:8]]
        ),
    }
    exec(compile(block(name), f"README.md:{name}", "exec"), namespace)
    return namespace


def run_shell(name: str) -> None:
    """Each line through the ``tda`` entry point's ``main`` in this process (a process
    start per line would import torch and transformers again); the console script itself
    is checked in ``tests/test_cli.py``."""
    script = block(name).replace("\\\n", " ")
    for line in filter(str.strip, script.splitlines()):
        command = shlex.split(line)
        assert command[0] == "tda"
        assert main(command[1:]) == 0, line


def test_quickstart_attribute(workdir: Path) -> None:
    """LoRA SFT with the capture callback, the adapter saved, then queries, attribution and
    report from the CLI: a query copied from a training row ranks that row first, named
    by its id; the report shows the training texts."""
    rows = train_rows()
    copied = [rows[6], rows[13]]
    Path("queries.jsonl").write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n"
            for r in copied
        )
    )
    run_python("quickstart-attribute")
    run_shell("quickstart-attribute-cli")
    top = json.loads(Path("run/scores/topk.json").read_text())["queries"]
    assert [q["helpful"][0]["id"] for q in top] == [r["id"] for r in copied]
    report = Path("run/scores/report.html").read_text()
    for r in copied:
        assert str(r["id"]) in report and r["completion"].strip() in report
    stored = StoreReader("run/grads").load_all().example_ids.tolist()
    assert sorted(stored) == sorted(IDS)  # the duplicated text stays two examples


def test_quickstart_selection(workdir: Path) -> None:
    """The snippet runs the library's default settings (the ones ``make demo`` measures);
    every step logs its dropped ids, of training rows, and keeps at least one example."""
    namespace = run_python("quickstart-selection")
    (selection,) = [
        c
        for c in namespace["trainer"].callback_handler.callbacks
        if isinstance(c, DataSelectionCallback)
    ]
    assert selection.settings == SelectionSettings(log_path=None)
    lines = [json.loads(line) for line in Path("run/selection.jsonl").read_text().splitlines()]
    assert len(lines) == len(IDS) // 4
    assert all(line["kept"] >= 1 and line["kept"] + line["dropped"] == 4 for line in lines)
    dropped = [i for line in lines for i in line["dropped_ids"]]
    assert set(dropped) <= set(IDS)


def test_quickstart_influence(workdir: Path) -> None:
    namespace = run_python("quickstart-influence")
    logged = [e for e in namespace["trainer"].state.log_history if "influence/q0_mean" in e]
    assert logged and all("influence/q1_max" in e for e in logged)
    report = json.loads(Path("run/influence/influence.json").read_text())
    assert report
    assert Path("run/influence/influence.html").is_file()
    assert Path("run/influence/influence.png").is_file()
