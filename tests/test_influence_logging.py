"""InfluenceLoggingCallback: the logged per-step influence equals scores recomputed from a
store captured in the same run, and the report names real example ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainerCallback

from tda_plugins import LayerSelection
from tda_plugins.integrations.transformers import (
    GradientCaptureCallback,
    InfluenceLoggingCallback,
)
from tda_plugins.live.influence import InfluenceLogger
from tda_plugins.methods import method_by_name
from tda_plugins.session.batch import capture_batch
from tda_plugins.store import StoreReader
from tests.models import tiny_causal_lm
from tests.oracle import loop_oracle
from tests.stores import capture_store
from tests.trainers import RESTORE_BEST, pad_rows, token_rows, training_args

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Train 4 steps at learning rate 0 (fixed weights) with both callbacks."""
    tmp = tmp_path_factory.mktemp("influence")
    rows = [{"input_ids": r} for r in token_rows(16)]
    queries = [{"input_ids": r} for r in token_rows(2, seed=9)]
    model = tiny_causal_lm("llama", torch.float32)
    influence = InfluenceLoggingCallback(
        queries=queries, method="graddot", layers="linear", report_dir=str(tmp / "report"), top_k=3
    )
    capture = GradientCaptureCallback(store_dir=str(tmp / "store"), layers="linear")
    args = training_args(
        tmp / "out", learning_rate=0.0, max_steps=STEPS, logging_strategy="steps", logging_steps=1
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        data_collator=pad_rows,
        callbacks=[capture, influence],
    )
    trainer.train()
    query_store = capture_store(
        model, [pad_rows(queries)], tmp / "queries", LayerSelection("linear"), curvature=False
    )
    scores = method_by_name("graddot").score(StoreReader(tmp / "store"), query_store)
    return {"trainer": trainer, "influence": influence, "scores": scores, "tmp": tmp}


def test_logged_influence_equals_scores_recomputed_from_the_store(run: dict) -> None:
    """Per step and query, the logged mean and max equal those of GradDot scores of the
    step's stored examples against the queries (weights are fixed, so the queries' gradients
    are the same at every step)."""
    scores = run["scores"]
    steps = StoreReader(run["tmp"] / "store").load_all().steps
    logged = {h["step"]: h for h in run["trainer"].state.log_history if "influence/q0_mean" in h}
    assert sorted(logged) == list(range(1, STEPS + 1))
    for step in range(STEPS):
        values = scores.values[steps == step]
        assert values.shape[0] == 2  # the step's examples
        entry = logged[step + 1]
        for j in range(values.shape[1]):
            for stat, reference in (("mean", values[:, j].mean()), ("max", values[:, j].max())):
                got = entry[f"influence/q{j}_{stat}"]
                assert got == pytest.approx(float(reference), rel=1e-4, abs=1e-6)


def test_report_files_exist_and_name_stored_example_ids(run: dict) -> None:
    report = run["influence"].report
    assert set(report) == {"json", "html", "png"} and all(Path(p).exists() for p in report.values())
    summary = json.loads(Path(report["json"]).read_text())
    stored = set(run["scores"].train_ids.tolist())
    assert {e["id"] for e in summary["cumulative"]} == stored
    # learning rate 0: every cumulative (learning-rate-weighted) influence is 0, neither
    # helpful nor harmful
    assert all(score == 0 for e in summary["cumulative"] for score in e["scores"])
    assert all(q["helpful"] == q["harmful"] == [] for q in summary["top_k"])
    assert len(summary["top_k"]) == len(summary["query_ids"])
    # the report's steps and per-query values are the trainer's logged ones
    logged = {h["step"]: h for h in run["trainer"].state.log_history if "influence/q0_mean" in h}
    assert [h["step"] for h in summary["history"]] == sorted(logged)
    for h in summary["history"]:
        for j, (mean, top) in enumerate(zip(h["mean"], h["max"], strict=True)):
            assert mean == pytest.approx(logged[h["step"]][f"influence/q{j}_mean"])
            assert top == pytest.approx(logged[h["step"]][f"influence/q{j}_max"])
    page = Path(report["html"]).read_text()
    for j, query_id in enumerate(summary["query_ids"]):  # named as the logs name them
        assert f"Query q{j} (id {query_id})" in page


def test_a_step_not_scored_logs_no_influence(tmp_path: Path) -> None:
    """every_n_steps=2, a log every step: the influence metrics are in the logs of the
    scored steps (1 and 3) alone, never an earlier step's values carried into a later
    step's log entry."""
    influence = InfluenceLoggingCallback(
        queries=[{"input_ids": r} for r in token_rows(2, seed=9)],
        method="graddot",
        every_n_steps=2,
        report_dir=str(tmp_path / "report"),
    )
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(
            tmp_path / "out", max_steps=4, logging_strategy="steps", logging_steps=1
        ),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(8)]),
        data_collator=pad_rows,
        callbacks=[influence],
    )
    trainer.train()
    losses = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in losses] == [1, 2, 3, 4]
    assert [h["step"] for h in losses if "influence/q0_mean" in h] == [1, 3]
    history = json.loads(Path(influence.report["json"]).read_text())["history"]
    assert [h["step"] for h in history] == [1, 3]


class _OtherRankScored:
    """The exchange as rank 0 sees it when only rank 1 had examples in the step: rank 1's
    rows (ids, then scores with the scoreless flag as a last column, here 0: every row
    scored) follow this rank's."""

    rank = 0

    def __init__(self, ids: torch.Tensor, scores: torch.Tensor):
        self.theirs = [ids, torch.cat([scores, torch.zeros(len(scores), 1)], dim=1)]

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        other = self.theirs[0] if values.dtype == torch.long else self.theirs[1]
        assert values.shape[1:] == other.shape[1:] and values.shape[0] == 0
        return torch.cat([values, other.to(values.dtype)])

    def objects(self, value: object) -> list[object]:
        return [value]


def test_a_rank_without_examples_joins_the_step_with_an_empty_share() -> None:
    """A scored step in which this rank had no micro-batch: it still takes part in the
    exchange, with ``(0, M)`` scores, and logs the other rank's examples."""
    model = tiny_causal_lm("llama", torch.float32)
    queries = capture_batch(model, pad_rows([{"input_ids": r} for r in token_rows(3, seed=9)]))
    ids, scores = torch.tensor([7, 8]), torch.tensor([[1.0, -2.0, 3.0], [3.0, 0.0, -1.0]])
    logger = InfluenceLogger("graddot", _OtherRankScored(ids, scores))
    logger.set_queries(queries)
    logger.on_optimizer_step(0, [])
    assert [h.example_ids.tolist() for h in logger.history] == [[7, 8]]
    assert logger.metrics(0) == {
        "influence/q0_mean": 2.0,
        "influence/q0_max": 3.0,
        "influence/q1_mean": -1.0,
        "influence/q1_max": 0.0,
        "influence/q2_mean": 1.0,
        "influence/q2_max": 3.0,
    }


def test_gradcos_leaves_out_an_example_without_a_loss_token() -> None:
    """An example whose labels are all ignored has a zero gradient and no cosine: it did
    not train, so the step's rows, mean and max are those of the others, whose cosines
    are the loop oracle's (fp64, one backward per example, every linear weight)."""
    model = tiny_causal_lm("llama", torch.float64)
    train = pad_rows([{"input_ids": r} for r in token_rows(4, seed=3)])
    train["labels"][1] = -100
    queries = pad_rows([{"input_ids": r} for r in token_rows(2, seed=9)])
    record = capture_batch(model, train)
    logger = InfluenceLogger("gradcos")
    logger.set_queries(capture_batch(model, queries))
    logger.on_optimizer_step(0, [record])

    names = [f"{n}.weight" for n in LayerSelection("linear").resolve(model)]

    def flat(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        grads = loop_oracle(model, batch, names)
        return torch.cat([g.flatten(1) for g in grads.values()], dim=1)

    g_train, g_query = flat(train), flat(queries)
    assert float(g_train[1].abs().max()) == 0.0
    trained = g_train[[0, 2, 3]]
    cosines = (trained @ g_query.T) / torch.outer(trained.norm(dim=1), g_query.norm(dim=1))
    (step,) = logger.history
    assert step.example_ids.tolist() == record.example_ids[[0, 2, 3]].tolist()
    torch.testing.assert_close(step.scores.double(), cosines, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(step.mean.double(), cosines.mean(0), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(step.max.double(), cosines.amax(0), rtol=1e-5, atol=1e-7)


def test_a_step_with_non_finite_scores_is_refused_before_it_is_logged() -> None:
    """NaN in a training example's gradient (an overflowing step) makes its scores NaN:
    the step is refused, naming it and the example, and nothing of it is logged (the
    report would otherwise hold NaN, which JSON cannot)."""
    model = tiny_causal_lm("llama", torch.float32)
    logger = InfluenceLogger("graddot")
    logger.set_queries(capture_batch(model, pad_rows([{"input_ids": r} for r in token_rows(2)])))
    record = capture_batch(model, pad_rows([{"input_ids": r} for r in token_rows(3, seed=4)]))
    layer = next(iter(record.layers.values()))
    layer.grads.g[1, 0, 0] = float("nan")  # the second example's
    with pytest.raises(FloatingPointError, match="at step 3, of the examples") as info:
        logger.on_optimizer_step(2, [record])
    assert str(record.example_ids[1].item()) in str(info.value)
    assert logger.history == []


class _LogRecorder(TrainerCallback):
    """Stands in for a ``report_to`` integration: keeps the logs it is handed."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.logs.append(dict(logs or {}))


def test_add_to_puts_the_callback_before_the_integrations_that_report_its_metrics(
    tmp_path: Path,
) -> None:
    recorder = _LogRecorder()
    queries = [{"input_ids": r} for r in token_rows(2, seed=9)]
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(tmp_path, max_steps=2, logging_strategy="steps", logging_steps=1),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(4)]),
        data_collator=pad_rows,
        callbacks=[recorder],
    )
    influence = InfluenceLoggingCallback(queries=queries, layers="linear").add_to(trainer)
    assert trainer.callback_handler.callbacks[0] is influence
    trainer.train()
    logged = [entry for entry in recorder.logs if "loss" in entry]
    assert logged and all("influence/q0_mean" in entry for entry in logged)


def resumable_run(output: Path, resume: Path | None = None) -> dict[str, Any]:
    """6 steps of 4 examples with a checkpoint every 3 and live influence (lr 1e-2, so
    the weights move); the report ``influence.json``."""
    queries = [{"input_ids": r} for r in token_rows(2, seed=9)]
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(
            output,
            per_device_train_batch_size=4,
            max_steps=6,
            save_strategy="steps",
            save_steps=3,
        ),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(32)]),
        data_collator=pad_rows,
        callbacks=[InfluenceLoggingCallback(queries, layers="linear", top_k=3)],
    )
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return json.loads((output / "influence" / "influence.json").read_text())


def test_a_resumed_run_reports_every_step_as_the_uninterrupted_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Resumed from ``checkpoint-3``, the report covers steps 1..6 with the uninterrupted
    run's per-step history, cumulative scores and top-k (the checkpoint holds the log so
    far). A checkpoint without it: a warning, and a report of steps 4..6 only."""
    output = tmp_path / "out"
    reference = resumable_run(output)
    assert [h["step"] for h in reference["history"]] == list(range(1, 7))
    checkpoint = output / "checkpoint-3"
    assert (checkpoint / "influence-state-rank-0.safetensors").is_file()
    assert resumable_run(output, resume=checkpoint) == reference

    (checkpoint / "influence-state-rank-0.safetensors").unlink()
    with caplog.at_level("WARNING", logger="tda_plugins"):
        partial = resumable_run(output, resume=checkpoint)
    assert [h["step"] for h in partial["history"]] == [4, 5, 6]
    assert any("covers the steps from 4 on only" in r.getMessage() for r in caplog.records)


def test_writing_the_plot_leaves_the_processs_matplotlib_as_it_was(
    run: dict, tmp_path: Path
) -> None:
    """The report's PNG is drawn without pyplot: a notebook's backend and its open figures
    are the same after it (pyplot's Agg switch would end inline plots)."""
    import matplotlib
    import matplotlib.pyplot as plt

    logger = run["influence"].influence_log
    previous = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        figure = plt.figure()
        ids = torch.tensor([7, 9])
        paths = logger.write_report(tmp_path, ids, {}, {})
        assert paths["png"].read_bytes().startswith(b"\x89PNG")
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == [figure.number]
    finally:
        plt.close("all")
        matplotlib.use(previous)


def test_the_report_ends_at_the_checkpoint_load_best_model_at_end_restores(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three steps at learning rate 0 evaluate alike, so checkpoint-1 stays the best and
    the trainer puts it back: the report is the log saved with it (step 1 and its
    examples), while the trainer's logs keep every step's metrics."""
    rows = [{"input_ids": r} for r in token_rows(8)]
    queries = [{"input_ids": r} for r in token_rows(2, seed=9)]
    influence = InfluenceLoggingCallback(
        queries=queries, method="graddot", layers="linear", report_dir=str(tmp_path / "report")
    )
    args = training_args(
        tmp_path / "out",
        learning_rate=0.0,
        logging_strategy="steps",
        logging_steps=1,
        **RESTORE_BEST,
    )
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows[:2]),
        data_collator=pad_rows,
        callbacks=[influence],
    )
    with caplog.at_level("WARNING"):
        trainer.train()
    assert Path(str(trainer.state.best_model_checkpoint)).name == "checkpoint-1"
    assert "the influence report ends there" in caplog.text
    summary = json.loads(Path(influence.report["json"]).read_text())
    assert [h["step"] for h in summary["history"]] == [1]
    first = influence.influence_log.history[0].example_ids.tolist()
    assert sorted(e["id"] for e in summary["cumulative"]) == sorted(first)
    logged = [h["step"] for h in trainer.state.log_history if "influence/q0_mean" in h]
    assert logged == [1, 2, 3]


def one_step_report(output: Path, queries: list[dict[str, Any]]) -> dict[str, Any]:
    """One training step with live influence on ``queries``; the report."""
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=training_args(output, max_steps=1),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(4)]),
        data_collator=pad_rows,
        callbacks=[InfluenceLoggingCallback(queries, layers="linear", method="graddot")],
    )
    trainer.train()
    return json.loads((output / "influence" / "influence.json").read_text())


def test_the_report_names_queries_by_their_ids(tmp_path: Path) -> None:
    """Queries with an 'id' are reported under it, as every other example row is; two
    queries of the same tokens then keep their own columns."""
    first, second = token_rows(2, seed=9)
    queries = [
        {"input_ids": first, "id": 7},
        {"input_ids": first, "id": 3},
        {"input_ids": second, "id": 11},
    ]
    report = one_step_report(tmp_path / "ids", queries)
    assert report["query_ids"] == [7, 3, 11]
    assert [entry["query_id"] for entry in report["top_k"]] == [7, 3, 11]


def test_queries_of_the_same_tokens_without_ids_are_refused_before_any_step(
    tmp_path: Path,
) -> None:
    first, second = token_rows(2, seed=9)
    queries = [{"input_ids": first}, {"input_ids": second}, {"input_ids": first}]
    with pytest.raises(ValueError, match="queries q0 and q2 are the same tokens"):
        one_step_report(tmp_path / "same", queries)
    assert not (tmp_path / "same" / "influence").exists()
