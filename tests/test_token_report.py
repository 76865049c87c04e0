"""``tda attribute --tokens``: the score of each token of each query's top-k examples.

The oracle is independent of the engine: each captured layer's input ``a_t`` and output
gradient ``g_t`` of one training example are taken with plain module and tensor hooks in
this file, and the query's weight gradient ``Q`` with ``torch.autograd.grad``; token
``t``'s GradDot score is then ``sum over layers of g_t^T Q a_t`` (the tiny Llama's linear
layers, its untied head among them, have no bias).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tda_plugins.cli import main
from tda_plugins.methods import Scores
from tda_plugins.store import StoreReader
from tests.models import tiny_causal_lm
from tests.trainers import word_tokenizer

TRAIN = {10: [5, 9, 14, 3, 22], 11: [7, 7, 30, 12], 12: [19, 4, 8, 25, 6, 11, 2], 13: [33, 5]}
QUERIES = {90: [5, 9, 14, 8], 91: [30, 12, 7]}
TOP_K = 2


def write_rows(path: Path, rows: dict[int, list[int]]) -> Path:
    lines = [
        json.dumps({"id": i, "text": " ".join(f"w{t}" for t in ids)}) for i, ids in rows.items()
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fp64 tiny Llama and its word tokenizer saved together; a training store with
    per-token factors (batches of 3: the shorter rows are padded), a query store, and
    ``tda attribute --tokens`` scores."""
    root = tmp_path_factory.mktemp("tokens")
    tiny_causal_lm("llama").save_pretrained(root / "model")
    word_tokenizer().save_pretrained(root / "model")
    common = ["--model", root / "model", "--dtype", "float64"]
    for name, rows, extra in (
        ("store", TRAIN, ["--keep-tokens", "--batch-size", "3"]),
        ("queries", QUERIES, []),
        ("plain", TRAIN, []),
    ):
        data = write_rows(root / f"{name}.jsonl", rows)
        args = ["capture", *common, "--data", data, "--out", root / name, *extra]
        assert main([str(a) for a in args]) == 0
    scores = ["--store", root / "store", "--queries", root / "queries"]
    args = ["attribute", *scores, "--method", "graddot", "--top-k", TOP_K, "--tokens"]
    args += ["--out", root / "out"]
    assert main([str(a) for a in args]) == 0
    return root


def oracle_token_scores(model: nn.Module, train: list[int], query: list[int]) -> Tensor:
    """``(T,)`` GradDot score of each token of ``train`` against ``query``, each example's
    loss its summed next-token cross-entropy, over every ``nn.Linear`` (the head
    included: untied here)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}

    def loss_of(ids: list[int]) -> Tensor:
        tokens = torch.tensor([ids])
        logits = model(input_ids=tokens).logits
        return F.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="sum")

    weights = [m.weight for m in layers.values()]
    q_grads = dict(zip(layers, torch.autograd.grad(loss_of(query), weights), strict=True))
    inputs: dict[str, Tensor] = {}
    outputs: dict[str, Tensor] = {}

    def keep(name: str) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], None]:
        def hook(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            inputs[name] = args[0].detach()[0]
            out.register_hook(lambda grad: outputs.__setitem__(name, grad.detach()[0]))

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in layers.items()]
    try:
        loss_of(train).backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return sum(torch.einsum("to,oi,ti->t", outputs[n], q_grads[n], inputs[n]) for n in layers)  # type: ignore[return-value]


def test_token_scores_equal_the_hook_oracle_and_name_the_tokens(run: Path) -> None:
    """Every listed example's token values equal the oracle's, sum to its saved score,
    and sit on its real tokens, each decoded alone."""
    model = tiny_causal_lm("llama")
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(StoreReader(run / "store").layer_names) == sorted(linear)  # the oracle's
    scores = Scores.load(run / "out")
    report = json.loads((run / "out" / "tokens.json").read_text())
    assert [q["query_id"] for q in report] == scores.query_ids.tolist()
    row = {int(i): r for r, i in enumerate(scores.train_ids.tolist())}
    listed = 0
    for j, entry in enumerate(report):
        query = QUERIES[entry["query_id"]]
        for side in ("helpful", "harmful"):
            for example in entry[side]:
                listed += 1
                tokens = TRAIN[example["id"]]
                assert example["tokens"] == [f"w{t}" for t in tokens]
                assert example["positions"] == list(range(len(tokens)))  # right padding
                values = torch.tensor(example["values"], dtype=torch.float64)
                expected = oracle_token_scores(model, tokens, query)
                torch.testing.assert_close(values, expected, rtol=1e-4, atol=1e-6)
                saved = float(scores.values[row[example["id"]], j])
                assert values.sum().item() == pytest.approx(saved, rel=1e-4)
    assert listed >= len(QUERIES)  # the check above ran on real entries


def test_report_shades_each_token_and_rerenders_with_them(run: Path) -> None:
    """The attribute report shows each token of a listed example as its own shaded span,
    and ``tda report`` over the same scores renders the same page."""
    page = (run / "out" / "report.html").read_text()
    report = json.loads((run / "out" / "tokens.json").read_text())
    listed = [e for q in report for side in ("helpful", "harmful") for e in q[side]]
    assert page.count("<span title=") == sum(len(e["values"]) for e in listed)
    for example in listed:
        for piece, value in zip(example["tokens"], example["values"], strict=True):
            assert f"<span title='{value:+.3g}'" in page
            assert f">{piece}</span>" in page
    again = run / "again.html"
    args = ["report", "--scores", run / "out", "--store", run / "store"]
    args += ["--queries", run / "queries", "--top-k", TOP_K, "--out", again]
    assert main([str(a) for a in args]) == 0
    assert again.read_text() == page


@pytest.mark.parametrize(
    ("store", "method", "fragment"),
    [("plain", "graddot", "--keep-tokens"), ("store", "tracin", "not 'tracin'")],
)
def test_tokens_refused_before_scoring(
    run: Path,
    capsys: pytest.CaptureFixture[str],
    store: str,
    method: str,
    fragment: str,
) -> None:
    """A store without per-token factors, or a method whose score is not one pass over
    them, ends with exit 2 and the way out, and writes nothing."""
    out = run / f"refused-{store}-{method}"
    args = ["attribute", "--store", run / store, "--queries", run / "queries"]
    args += ["--method", method, "--tokens", "--out", out]
    assert main([str(a) for a in args]) == 2
    assert fragment in capsys.readouterr().err
    assert not out.exists()


def test_stores_without_keep_tokens_save_no_tokens(run: Path) -> None:
    """Only a ``--keep-tokens`` capture pays for the per-token texts."""
    assert StoreReader(run / "plain").token_texts() == {}
    assert sorted(StoreReader(run / "store").token_texts()) == sorted(TRAIN)
