"""OLMo-core ``Trainer`` + ``InfluenceLoggingCallback``: the metrics it records equal GradDot
scores recomputed from a store captured in the same run, under the trainer's step numbers,
and its report names the stored instances.

The tiny OLMo-2 transformer and ``NumpyFSLDataset`` of ``tests.test_olmo_core`` train for
:data:`STEPS` steps on CPU in fp32: AdamW behind a linear warmup (a non-zero learning rate
that differs between steps, so the weights change at every step), 4 instances a step in
two micro-batches. ``GradientCaptureCallback`` stores every layer's per-instance gradients
(store step ``k`` is OLMo-core step ``k + 1``); the influence callback scores every second
step (OLMo-core steps 1 and 3) against three queries of different lengths.

The reference never touches the callback: each scored step's instance gradients are read
from the store, and each query's gradient is one autograd backward of its summed
next-token cross-entropy, written by hand from the logits, through a copy of the model at
the parameters the step started from (kept by ``StepRecorder`` at ``pre_step``).

Under DDP and FSDP on two ranks the callback records what one process records: see
``tests/test_olmo_core_distributed.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from olmo_core.nn.lm_head import LMLossImplementation
from olmo_core.optim import LinearWithWarmup
from olmo_core.train.callbacks import Callback
from torch import Tensor

from tda_plugins.integrations.olmo_core import (
    GradientCaptureCallback,
    InfluenceLoggingCallback,
    UnsupportedTrainingSetup,
)
from tda_plugins.live.influence import InfluenceLogger
from tda_plugins.session.settings import CaptureSettings
from tda_plugins.store import StoreReader
from tests.test_olmo_core import (  # noqa: F401 (gloo_world_of_one: a fixture)
    BATCH,
    MODEL,
    VOCAB,
    StepRecorder,
    fit,
    gloo_world_of_one,
    instance_grads,
    layer_params,
)

STEPS = 4
EVERY = 2
SCORED = [1, 3]  # OLMo-core steps 1, 1 + EVERY
FP32_TOL = 1e-4
rng = np.random.default_rng(5)
QUERIES = [rng.integers(1, VOCAB, size=n).tolist() for n in (8, 5, 6)]


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


@dataclass
class MetricLog(Callback):
    """Every metric the trainer logs, by the step it logs it under."""

    logged: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.setdefault(step, {}).update(metrics)


@dataclass
class Run:
    influence: InfluenceLoggingCallback
    recorder: StepRecorder
    metrics: MetricLog
    store: StoreReader
    folder: Path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("olmo_influence")
    store = folder / "grads"
    settings = CaptureSettings.from_options(store_dir=str(store), layers="all", curvature=False)
    influence = InfluenceLoggingCallback(
        QUERIES, method="graddot", every_n_steps=EVERY, top_k=2, tokenizer=words, layers="all"
    )
    recorder, metrics = StepRecorder(), MetricLog()
    callbacks = {
        "tda": GradientCaptureCallback(settings),
        "influence": influence,
        "recorder": recorder,
        "metrics": metrics,
    }
    fit(folder, callbacks, STEPS, folder / "run", scheduler=LinearWithWarmup(warmup=2))
    return Run(influence, recorder, metrics, StoreReader(store), folder)


def reference_scores(run: Run, step: int) -> tuple[Tensor, Tensor]:
    """OLMo-core step ``step``: its instances' ids and their ``(N, M)`` GradDot scores
    against the queries at the weights the step started from (store gradients . oracle
    query gradients, summed over the store's layers)."""
    chunk = run.store.load_all()
    rows = (chunk.steps == step - 1).nonzero().flatten()
    recorded = run.recorder.steps[step - 1]
    assert chunk.example_ids[rows].tolist() == recorded.index.tolist()
    model = MODEL.build(init_device="cpu")
    queries = instance_grads(model, recorded.params, [torch.tensor(q) for q in QUERIES], None)
    scores = torch.zeros(len(rows), len(QUERIES), dtype=torch.float64)
    for layer in run.store.layer_names:
        names = layer_params(model, layer)
        stored = chunk.layers[layer].materialize()[rows].double()
        q = torch.stack([torch.cat([g[n].flatten() for n in names]) for g in queries]).double()
        scores += stored @ q.T
    return chunk.example_ids[rows], scores


def test_recorded_influence_equals_scores_recomputed_from_the_store(run: Run) -> None:
    """At OLMo-core steps 1 and 3 (every second step, from the first) the trainer logs
    ``influence/q<j>_mean`` and ``_max``, equal to the mean and max of the step's 4
    instances' GradDot scores against query ``j`` at that step's weights; at steps 2 and 4
    it logs none."""
    logged = {
        step: metrics
        for step, metrics in run.metrics.logged.items()
        if any(name.startswith("influence/") for name in metrics)
    }
    assert sorted(logged) == SCORED
    assert set(range(1, STEPS + 1)) <= set(run.metrics.logged)  # steps 2, 4: other metrics
    for step in SCORED:
        _, scores = reference_scores(run, step)
        assert scores.shape == (BATCH, len(QUERIES))
        expected = {}
        for j in range(len(QUERIES)):
            expected[f"influence/q{j}_mean"] = float(scores[:, j].mean())
            expected[f"influence/q{j}_max"] = float(scores[:, j].max())
        got = {k: v for k, v in logged[step].items() if k.startswith("influence/")}
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=FP32_TOL, abs=1e-6), (step, name)
    # the weights moved between the scored steps, so the queries' gradients had to be
    # taken again at step 3's weights
    first, third = run.recorder.steps[0].params, run.recorder.steps[2].params
    assert any(not torch.equal(first[n], third[n]) for n in first)


def test_report_names_the_stored_instances_with_learning_rate_weighted_scores(run: Run) -> None:
    """The report is in ``<save_folder>/influence``; its instances are the stored ones of
    the scored steps (OLMo-core instance indices), each with its score times the learning
    rate the trainer logged for its step; its steps are the trainer's; its texts come from
    the tokenizer."""
    report = run.influence.report
    directory = run.folder / "run" / "influence"
    assert report == {k: directory / f"influence.{k}" for k in ("json", "html", "png")}
    assert all(path.stat().st_size > 0 for path in report.values())
    summary = json.loads(report["json"].read_text())
    assert summary["query_ids"] == list(range(len(QUERIES)))
    assert [h["step"] for h in summary["history"]] == SCORED

    expected: dict[int, Tensor] = {}
    for step in SCORED:
        lr = run.metrics.logged[step]["optim/LR (group 0)"]
        ids, scores = reference_scores(run, step)
        expected.update(zip(ids.tolist(), lr * scores, strict=True))
    assert len({run.metrics.logged[s]["optim/LR (group 0)"] for s in SCORED}) == 2
    cumulative = {e["id"]: e["scores"] for e in summary["cumulative"]}
    assert cumulative.keys() == expected.keys() and len(expected) == len(SCORED) * BATCH
    for example, scores in expected.items():
        assert torch.tensor(cumulative[example]).double() == pytest.approx(
            scores, rel=FP32_TOL, abs=1e-8
        )

    html = report["html"].read_text()
    assert all(words(q) in html for q in QUERIES)
    top = summary["top_k"][0]["helpful"] + summary["top_k"][0]["harmful"]
    assert top, "query 0 has no scored instance in the report"
    tokens = {
        int(i): ids.tolist()
        for step in run.recorder.steps
        for i, ids in zip(step.index, step.input_ids, strict=True)
    }
    assert all(words(tokens[entry["id"]]) in html for entry in top)


def test_report_texts_are_token_ids_without_a_tokenizer() -> None:
    logger = InfluenceLogger("graddot")
    train, queries = logger.report_texts(torch.tensor([0, 1]), [[5, 6, 7], [8, 9]])
    assert train == {} and queries == {0: "5 6 7", 1: "8 9"}
    _, decoded = logger.report_texts(torch.tensor([3]), [[5, 6]], words)
    assert decoded == {3: "w5 w6"}


def test_unsupported_setups_are_refused_before_any_step(tmp_path: Path) -> None:
    """The fused linear loss hides the LM head's output from its hooks: ``fit`` refuses
    at ``pre_train``, before the dry run and any step, and no query pass runs."""
    fused = replace(
        MODEL, lm_head=replace(MODEL.lm_head, loss_implementation=LMLossImplementation.fused_linear)
    )
    influence = InfluenceLoggingCallback(QUERIES, layers="all")
    recorder = StepRecorder()
    callbacks = {"influence": influence, "recorder": recorder}
    with pytest.raises(UnsupportedTrainingSetup, match="use LMLossImplementation"):
        fit(tmp_path, callbacks, 1, tmp_path / "run", model=fused)
    assert recorder.steps == [] and influence.influence_log.history == [] and influence.report == {}


def test_bad_arguments_are_refused_when_the_callback_is_made() -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        InfluenceLoggingCallback(QUERIES, every_n_steps=0)
    with pytest.raises(ValueError, match="graddot"):
        InfluenceLoggingCallback(QUERIES, method="tracin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two or more tokens"):
        InfluenceLoggingCallback([[3]])
    with pytest.raises(TypeError, match="decode"):
        InfluenceLoggingCallback(QUERIES, tokenizer=42)


@pytest.mark.slow
@pytest.mark.usefixtures("gloo_world_of_one")
def test_a_resumed_run_reports_every_step(tmp_path: Path) -> None:
    """OLMo-core resumed from its step-2 checkpoint: the report holds steps 1..4, the first
    two as the checkpoint saved them, and every instance's cumulative score equals the
    uninterrupted run's (the resumed steps to fp32 rounding of a resumed trainer)."""

    def report(save: Path, load: Path | None = None) -> dict:
        influence = InfluenceLoggingCallback(QUERIES, method="graddot", layers="all")
        fit(tmp_path, {"influence": influence}, STEPS, save, load_path=load, checkpoints=True)
        return json.loads(influence.report["json"].read_text())

    reference = report(tmp_path / "first")
    resumed = report(tmp_path / "second", load=tmp_path / "first" / "step2")
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]
    assert resumed["history"][:2] == reference["history"][:2]
    want = {row["id"]: row["scores"] for row in reference["cumulative"]}
    got = {row["id"]: row["scores"] for row in resumed["cumulative"]}
    assert got.keys() == want.keys() and len(got) == STEPS * BATCH
    for example, scores in want.items():
        assert torch.allclose(torch.tensor(got[example]), torch.tensor(scores), rtol=FP32_TOL)
