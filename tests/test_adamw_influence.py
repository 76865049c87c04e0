"""Trajectory recording and ``adamw_influence``.

1. Inside real ``Trainer`` runs (full fine-tuning and LoRA, gradient accumulation 1 and
   2, with and without clipping, weight decay, a decaying learning rate), the method's
   scores equal a brute-force derivative of each query's loss at the final weights with
   respect to each example's loss weight, through a ``torch.func`` replay of the run's
   AdamW steps with the denominators held fixed (``tests.trajectory_oracle``), and the
   replay's final weights equal the trainer's.
2. The sign convention and scale against actual leave-one-out retraining.
3. Crash and resume: a resumed run's trajectory equals an uninterrupted run's.
4. Refusals: unsupported optimizers and captures before the first step, stores without
   a trajectory, ``.grad`` edited behind the recording.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
import torch
from datasets import Dataset
from torch import Tensor, nn
from transformers import Trainer, TrainerCallback

from tda_plugins import LayerSelection, causal_lm_example_losses
from tda_plugins.capture import content_hash
from tda_plugins.capture.normalization import SummedLoss
from tda_plugins.cli import main as cli_main
from tda_plugins.integrations.transformers import DataSelectionCallback, GradientCaptureCallback
from tda_plugins.methods import Scores, method_by_name
from tda_plugins.session.capture import CaptureSession, UnsupportedTrainingSetup
from tda_plugins.session.settings import CaptureSettings
from tda_plugins.store import StoreError, StoreReader
from tda_plugins.trajectory import TrajectoryReader
from tests import trajectory_worker
from tests.models import tiny_causal_lm, with_lora
from tests.selection_helpers import PINNED
from tests.stores import capture_store, rel_error, scores_by_id, summed_loss
from tests.trainers import RecordingCollator, WeightSnapshots, pad_rows, token_rows, training_args
from tests.trajectory_oracle import AdamWRun, replay
from tests.trajectory_worker import linear_only_llama
from tests.zygote import Worker, Zygote

ROWS = 24
STEPS = 4


def fp64_loss(
    logits: Tensor,
    labels: Tensor,
    vocab_size: int,
    num_items_in_batch: Tensor | int | None = None,
    **kwargs: Any,
) -> Tensor:
    """The transformers causal-LM loss (summed token losses over ``num_items_in_batch``,
    else the mean) without its cast of the logits to fp32, so an fp64 run stays fp64."""
    divisor = num_items_in_batch or int((labels[..., 1:] != -100).sum())
    return causal_lm_example_losses(logits, labels).sum() / divisor


def fp64_model(kind: str) -> nn.Module:
    """The tiny Llama in fp64 computing its training loss in fp64 (``"lora"``: with LoRA)."""
    model = tiny_causal_lm("llama", torch.float64)
    model.loss_function = fp64_loss
    return with_lora(model) if kind == "lora" else model


@dataclass
class Run:
    trainer: Trainer
    collator: RecordingCollator
    snapshots: WeightSnapshots
    store_dir: Path

    @property
    def store(self) -> StoreReader:
        return StoreReader(self.store_dir)


def train(
    tmp_path: Path,
    kind: str = "full",
    capture: dict[str, Any] | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    resume_from: Path | None = None,
    **overrides: Any,
) -> Run:
    """An fp64 ``Trainer`` run of the tiny Llama (``kind``: ``"full"`` or ``"lora"``) with
    ``GradientCaptureCallback(record_trajectory=True, **capture)``."""
    options: dict[str, Any] = dict(max_steps=STEPS, weight_decay=0.1, adam_beta2=0.99)
    options.update(overrides)
    store_dir = tmp_path / "store"
    collator = RecordingCollator()
    snapshots = WeightSnapshots()
    settings = {
        "store_dir": str(store_dir),
        "curvature": False,
        "record_trajectory": True,
        **(capture or {}),
    }
    trainer = Trainer(
        model=fp64_model(kind),
        args=training_args(tmp_path / "out", **options),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(ROWS)]),
        data_collator=collator,
        callbacks=[snapshots, *callbacks, GradientCaptureCallback(**settings)],
    )
    trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    return Run(trainer, collator, snapshots, store_dir)


def query_rows() -> list[list[int]]:
    return token_rows(3, seed=11)


def capture_queries(run: Run, path: Path) -> StoreReader:
    """Query gradients at the run's final weights, with the store's layers."""
    batch = pad_rows([{"input_ids": r} for r in query_rows()])
    layers = LayerSelection(include="|".join(f"^{n}$" for n in run.store.layer_names))
    return capture_store(run.trainer.model, [batch], path, layers=layers, curvature=False)


def replay_run(
    run: Run, accumulation: int, max_grad_norm: float, curvature: float = 0.0
) -> tuple[Any, ...]:
    """The brute-force replay of ``run`` from its initial weights (``curvature``: the
    oracle's empirical-Fisher factor, :class:`AdamWRun`)."""
    model = run.trainer.model
    initial = fp64_model("lora" if hasattr(model, "peft_config") else "full")
    initial.load_state_dict(run.snapshots.weights[0])
    initial.train()
    decayed = set(run.trainer.get_decay_parameter_names(model))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    captured = {
        f"{layer}.{local}"
        for layer in run.store.layer_names
        for local, _ in model.get_submodule(layer).named_parameters(recurse=False)
    }
    args = run.trainer.args
    batches = run.collator.batches
    windows = [batches[s * accumulation : (s + 1) * accumulation] for s in range(STEPS)]
    steps = [
        [i for b in window for i in content_hash(b["input_ids"], b["attention_mask"]).tolist()]
        for window in windows
    ]
    oracle = AdamWRun(
        steps=steps,
        examples=run.collator.examples(),
        lr=[args.learning_rate * (STEPS - s) / STEPS for s in range(STEPS)],
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay={n: args.weight_decay if n in decayed else 0.0 for n in trained},
        max_grad_norm=max_grad_norm,
        captured=frozenset(captured),
        curvature=curvature,
    )
    queries = [(torch.tensor(r), torch.tensor(r)) for r in query_rows()]
    return replay(initial, oracle, queries)


CASES = {
    "full-accumulation1-noclip": ("full", 1, 0.0),
    "full-accumulation2-clip": ("full", 2, 1.0),
    "lora-accumulation1-clip": ("lora", 1, 1.0),
    "lora-accumulation2-noclip": ("lora", 2, 0.0),
}


@pytest.mark.parametrize("case", CASES)
def test_scores_equal_the_derivative_of_a_replayed_run(tmp_path: Path, case: str) -> None:
    """``adamw_influence`` = ``-d L_q(theta_T) / d w_z`` of the brute-force replay (an fp64
    run, relative 1e-6: scores are fp32), whose final weights are the trainer's (1e-10)."""
    kind, accumulation, clip = CASES[case]
    run = train(tmp_path, kind, gradient_accumulation_steps=accumulation, max_grad_norm=clip)
    trajectory = TrajectoryReader(run.store_dir)
    clips = [trajectory.record(step).clip for step in trajectory.steps]
    assert trajectory.steps == list(range(STEPS))
    assert min(clips) < 1 if clip else clips == [1.0] * STEPS  # clipping acted where on
    queries = capture_queries(run, tmp_path / "queries")
    scores = method_by_name("adamw_influence").score(run.store, queries)

    final, occurrences, derivatives = replay_run(run, accumulation, clip)
    trained = dict(run.trainer.model.named_parameters())
    assert max(rel_error(trained[n].detach(), t) for n, t in final.items()) < 1e-10
    ids = torch.tensor([i for _, i in occurrences])
    assert len(set(ids.tolist())) == len(ids)  # one epoch: each example once
    got = scores_by_id(scores, ids, queries.load_all().example_ids)
    expected = -derivatives
    assert expected.abs().max() > 0
    assert rel_error(got, expected) < 1e-6


# -- 2. against leave-one-out retraining ---------------------------------------------------


LOO_ROWS = token_rows(12)
LOO_BATCH = 4


def train_plain(
    lr: float, eps: float, removed: int | None = None, store_dir: Path | None = None
) -> nn.Module:
    """3 AdamW steps of 4 rows of ``LOO_ROWS`` (without row ``removed``), each step the
    plain sum of its examples' losses; recorded into ``store_dir`` when given, through
    :class:`CaptureSession` as a training loop of one's own drives it."""
    model = linear_only_llama()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, eps=eps, weight_decay=0.01)
    session = None
    if store_dir is not None:
        settings = CaptureSettings.from_options(
            store_dir=str(store_dir), curvature=False, store_texts=False, record_trajectory=True
        )
        session = CaptureSession(
            settings, model=model, normalization=SummedLoss(), optimizer=optimizer
        )
    for first in range(0, len(LOO_ROWS), LOO_BATCH):
        rows = [
            {"input_ids": r}
            for i, r in enumerate(LOO_ROWS[first : first + LOO_BATCH], start=first)
            if i != removed
        ]
        summed_loss(model, pad_rows(rows)).backward()
        if session is not None:
            session.step()
        optimizer.step()
        if session is not None:
            session.after_optimizer_step()
            session.finish_step()
        optimizer.zero_grad()
    if session is not None:
        session.end(optimizer)
    return model


def query_losses(model: nn.Module) -> Tensor:
    """``(M,)`` each query's summed token loss."""
    with torch.no_grad():
        return torch.stack([summed_loss(model, pad_rows([{"input_ids": r}])) for r in query_rows()])


def ranks(values: Tensor) -> Tensor:
    return values.argsort().argsort().double()


def test_scores_predict_leave_one_out_retraining(tmp_path: Path) -> None:
    """Removing an example and retraining from the same start changes each query's loss
    by what ``adamw_influence`` predicts: positive = the loss rises without it. With
    ``eps`` dominating Adam's denominator (so that holding the denominator fixed is
    nearly exact) and a small step: within 5% overall, same sign for at least 90% of
    the pairs, Spearman >= 0.95 per query."""
    lr, eps = 1e-3, 10.0
    model = train_plain(lr, eps, store_dir=tmp_path / "store")
    batch = pad_rows([{"input_ids": r} for r in query_rows()])
    queries = capture_store(model, [batch], tmp_path / "queries", curvature=False)
    scores = method_by_name("adamw_influence").score(StoreReader(tmp_path / "store"), queries)

    base = query_losses(model)
    loo = torch.stack([query_losses(train_plain(lr, eps, removed=z)) - base for z in range(12)])
    rows = pad_rows([{"input_ids": r} for r in LOO_ROWS])
    ids = content_hash(rows["input_ids"], rows["attention_mask"])
    got = scores_by_id(scores, ids, queries.load_all().example_ids).double()
    assert loo.abs().min() > 0
    assert rel_error(got, loo) < 0.05
    assert (got.sign() == loo.sign()).double().mean() >= 0.9
    for j in range(loo.shape[1]):
        spearman = torch.corrcoef(torch.stack([ranks(got[:, j]), ranks(loo[:, j])]))[0, 1]
        assert spearman >= 0.95, (j, float(spearman))


# -- 3. crashes and resuming ---------------------------------------------------------------


class SimulatedCrash(RuntimeError):
    """Raised by :class:`CrashAtStep`."""


class CrashAtStep(TrainerCallback):
    """Kills training at the start of optimizer step ``step`` (steps before it are done)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise SimulatedCrash(f"crash at step {self.step}")


RESUMABLE: dict[str, Any] = dict(save_strategy="steps", save_steps=2, gradient_accumulation_steps=2)


def assert_same_trajectory(got: Path, ref: Path) -> None:
    """The same steps, each with the same record and bitwise the same second moments."""
    a, b = TrajectoryReader(got), TrajectoryReader(ref)
    assert a.steps == b.steps and a.layers == b.layers and a.steps
    for step in b.steps:
        x, y = a.record(step), b.record(step)
        assert torch.equal(x.example_ids, y.example_ids), step
        assert torch.equal(x.loss_scale, y.loss_scale), step
        assert (x.clip, x.groups, x.layers) == (y.clip, y.groups, y.layers), step
        for layer in b.layers:
            assert torch.equal(a.second_moment(step, layer), b.second_moment(step, layer))


@pytest.mark.parametrize("first_run", ["crashed", "finished"])
def test_a_resumed_run_records_what_an_uninterrupted_run_records(
    tmp_path: Path, first_run: str
) -> None:
    """A run that crashed at the start of step 3 (steps 0..2 recorded) or finished all 4,
    resumed from ``checkpoint-2`` with a fresh callback on the same store: the trajectory
    holds steps 0..3 once each, equal to an uninterrupted run's, and so do the scores."""
    reference = train(tmp_path / "reference", "lora", **RESUMABLE)
    if first_run == "crashed":
        with pytest.raises(SimulatedCrash):
            train(tmp_path, "lora", callbacks=[CrashAtStep(3)], **RESUMABLE)
        assert TrajectoryReader(tmp_path / "store").steps == [0, 1, 2]
    else:
        train(tmp_path, "lora", **RESUMABLE)
    resumed = train(tmp_path, "lora", resume_from=tmp_path / "out" / "checkpoint-2", **RESUMABLE)
    assert resumed.snapshots.steps_begun == 2  # steps 2 and 3 only
    assert_same_trajectory(resumed.store_dir, reference.store_dir)
    queries = capture_queries(reference, tmp_path / "queries")
    scores = [
        method_by_name("adamw_influence").score(r.store, queries) for r in (resumed, reference)
    ]
    assert torch.equal(scores[0].values, scores[1].values)


def start_worker(
    zygote: Zygote, store: Path, checkpoints: Path, pause: int, stderr: IO[str]
) -> Worker:
    """``tests/trajectory_worker.py`` in a worker process that stops at step ``pause``."""
    argv = [str(store), str(checkpoints), "--pause", str(pause)]
    return zygote.popen("tests.trajectory_worker:main", argv, stderr=stderr.fileno())


@pytest.mark.slow
def test_sigkill_after_an_update_keeps_a_readable_prefix_and_resume_is_exact(
    tmp_path: Path, zygote: Zygote
) -> None:
    """A run killed (SIGKILL) right after step 2's update was handed to the trajectory's
    background write reopens with steps 0, 1 and maybe 2, each readable; resuming from
    the checkpoint after step 2 removes what no index lists (an orphaned step file, a
    half-written temporary file) and ends with a trajectory equal to an uninterrupted
    run's."""
    killed, checkpoints, log = tmp_path / "killed", tmp_path / "ckpt", tmp_path / "log"
    with log.open("w") as stderr, start_worker(zygote, killed, checkpoints, 2, stderr) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip() == "paused", log.read_text()
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()

    reader = TrajectoryReader(killed)
    assert reader.steps in ([0, 1], [0, 1, 2])
    for step in reader.steps:
        assert reader.record(step).step == step
    folder = killed / "rank-0" / "trajectory"
    orphan, half = folder / "t00000007.safetensors", folder / ".t00000003.safetensors.tmp-42"
    orphan.write_bytes(b"a step no index lists")
    half.write_bytes(b"a write cut short")
    trajectory_worker.train(killed, checkpoints)
    assert not orphan.exists() and not half.exists()
    trajectory_worker.train(tmp_path / "reference", tmp_path / "reference-ckpt")
    assert_same_trajectory(killed, tmp_path / "reference")


# -- 4. refusals, and what recording leaves alone ------------------------------------------


def store_bytes(store_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(store_dir)): p.read_bytes() for p in store_dir.rglob("*") if p.is_file()
    }


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    "amsgrad": lambda params: torch.optim.AdamW(params, lr=0.01, amsgrad=True),
    "coupled-l2": lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizers_it_cannot_follow_are_refused_before_the_first_step(
    tmp_path: Path, optimizer: str
) -> None:
    """SGD, AMSGrad and Adam's coupled L2 decay: refused at ``on_train_begin``, naming
    the reason; no step is recorded."""
    model = fp64_model("full")
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path / "out"),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(ROWS)]),
        data_collator=pad_rows,
        optimizers=(OPTIMIZERS[optimizer](model.parameters()), None),
        callbacks=[
            GradientCaptureCallback(store_dir=str(tmp_path / "store"), record_trajectory=True)
        ],
    )
    with pytest.raises(UnsupportedTrainingSetup, match="record_trajectory"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert not (tmp_path / "store").exists()


def test_a_projected_capture_is_refused_before_the_first_step(tmp_path: Path) -> None:
    """A projected capture has no per-parameter entries to divide by Adam's denominator.
    (fp16 loss scaling, which rescales ``.grad`` before clipping and skips steps, is refused
    on an accelerator for every capture; on the CPU accelerate trains ``fp16=True`` in
    fp32, without a scaler, and the trajectory is recorded.)"""
    with pytest.raises(UnsupportedTrainingSetup, match="record_trajectory"):
        train(tmp_path, capture={"projection": "factor"})
    assert not (tmp_path / "store").exists()


def test_fp16_on_the_cpu_trains_in_fp32_and_records_the_trajectory(tmp_path: Path) -> None:
    run = train(tmp_path, fp16=True)
    assert run.trainer.state.global_step == STEPS
    assert run.trainer.accelerator.scaler is None  # no loss scaling on the CPU
    assert sorted(TrajectoryReader(run.store_dir).steps) == list(range(STEPS))


def test_editing_grad_behind_the_recording_is_refused_at_that_step(tmp_path: Path) -> None:
    """A callback that rescales ``.grad`` before the optimizer (as data selection would
    change it): the step's record would not be the run's, so the run stops there."""

    class HalveGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            for p in kwargs["model"].parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)

    with pytest.raises(StoreError, match=r"edited \.grad"):
        train(tmp_path, callbacks=[HalveGradients()], max_grad_norm=0.0)
    assert not list((tmp_path / "store" / "rank-0" / "trajectory").glob("t*.safetensors"))


class NegateGradients(TrainerCallback):
    """Flips the sign of every ``.grad`` before the optimizer: the norm stays the same."""

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for p in kwargs["model"].parameters():
            if p.grad is not None:
                p.grad.neg_()


def test_an_edit_that_keeps_the_norm_is_refused_at_that_step(tmp_path: Path) -> None:
    """A norm check alone lets a sign flip through; the sampled entries do not."""
    with pytest.raises(StoreError, match=r"differs entry by entry.*edited \.grad"):
        train(tmp_path, callbacks=[NegateGradients()], max_grad_norm=0.0)
    assert not list((tmp_path / "store" / "rank-0" / "trajectory").glob("t*.safetensors"))


def test_data_selection_beside_the_recording_is_refused_under_clipping(tmp_path: Path) -> None:
    """Data selection, with every corrected gradient clipped to ``max_grad_norm`` (1e-3,
    far below any step's norm): the applied gradient's norm is the one the recording
    expects, but it is not the captured backward's, so the first step is refused."""
    selection = DataSelectionCallback(
        [{"input_ids": r} for r in token_rows(2, seed=7)], fraction=0.5, layers="all", **PINNED
    )
    with pytest.raises(StoreError, match=r"edited \.grad"):
        train(tmp_path, callbacks=[selection], max_grad_norm=1e-3)
    assert not list((tmp_path / "store" / "rank-0" / "trajectory").glob("t*.safetensors"))


def test_stores_without_a_whole_trajectory_are_refused(tmp_path: Path) -> None:
    """A store captured without ``record_trajectory``, and one whose trajectory lacks its
    last step (a run stopped between a step's gradients and its update): refused, naming
    the fix."""
    plain = train(tmp_path / "plain", capture={"record_trajectory": False})
    queries = capture_queries(plain, tmp_path / "queries")
    method = method_by_name("adamw_influence")
    with pytest.raises(StoreError, match="record_trajectory=True"):
        method.score(plain.store, queries)

    run = train(tmp_path / "recorded")
    folder = run.store_dir / "rank-0" / "trajectory"
    index = json.loads((folder / "index.json").read_text())
    index["steps"] = index["steps"][:-1]
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreError, match=rf"steps \[{STEPS - 1}\] that its trajectory"):
        method.score(run.store, queries, allow_mismatch=True)


def test_a_damaged_or_crafted_trajectory_is_refused(tmp_path: Path) -> None:
    """A step file whose bytes changed fails its checksum; an index entry naming a path
    outside the folder is refused before anything is read."""
    run = train(tmp_path)
    folder = run.store_dir / "rank-0" / "trajectory"
    step_file = folder / "t00000001.safetensors"
    data = bytearray(step_file.read_bytes())
    data[-1] ^= 0xFF
    step_file.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum"):
        TrajectoryReader(run.store_dir).second_moment(1, run.store.layer_names[0])
    index = json.loads((folder / "index.json").read_text())
    index["steps"][0]["file"] = "../index.json"
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreError, match="outside the trajectory"):
        TrajectoryReader(run.store_dir)


def test_resuming_with_a_trajectory_a_store_captured_without_is_refused(tmp_path: Path) -> None:
    """The earlier steps have no record, so the trajectory would have gaps: refused, and
    the store is left byte for byte."""
    train(tmp_path, "lora", capture={"record_trajectory": False}, **RESUMABLE)
    before = store_bytes(tmp_path / "store")
    with pytest.raises(StoreError, match="without a recorded trajectory"):
        train(tmp_path, "lora", resume_from=tmp_path / "out" / "checkpoint-2", **RESUMABLE)
    assert store_bytes(tmp_path / "store") == before


def test_recording_changes_nothing_of_the_run_or_of_other_methods(tmp_path: Path) -> None:
    """With and without ``record_trajectory``: bitwise the same final weights, the same
    stored gradients, and the same GradDot and LESS scores."""
    runs = [
        train(tmp_path / name, "lora", capture={"record_trajectory": on})
        for name, on in (("on", True), ("off", False))
    ]
    weights = [dict(r.trainer.model.named_parameters()) for r in runs]
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[1])
    queries = capture_queries(runs[0], tmp_path / "queries")
    for method in ("graddot", "less"):
        got, expected = (method_by_name(method).score(r.store, queries) for r in runs)
        assert torch.equal(got.values, expected.values), method


def test_tracin_refuses_a_store_a_training_run_wrote(tmp_path: Path) -> None:
    """Each step's rows are at that step's weights and the queries at the end weights: no
    TracIn checkpoint, and TracIn over it used to return GradDot's scores without a word.
    Refused, naming the live TracIn and the checkpoints; GradDot still scores it."""
    run = train(tmp_path, "lora")
    queries = capture_queries(run, tmp_path / "queries")
    with pytest.raises(StoreError, match=r"written by a training run.*InfluenceLoggingCallback"):
        method_by_name("tracin").score(run.store, queries)
    assert method_by_name("graddot").score(run.store, queries).values.numel()


def test_tda_attribute_scores_with_the_trajectory_methods(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tda attribute --method adamw_own_step`` writes the scores of
    ``adamw_influence(own_step=True)``; on a store without a trajectory, ``adamw_influence``
    exits 2 with one line naming the fix. Token-level scores are refused."""
    run = train(tmp_path, "lora")
    queries = capture_queries(run, tmp_path / "queries")
    args = ["attribute", "--store", run.store_dir, "--queries", queries.root]
    assert (
        cli_main([str(a) for a in [*args, "--method", "adamw_own_step", "--out", tmp_path / "s"]])
        == 0
    )
    expected = method_by_name("adamw_influence", own_step=True).score(run.store, queries)
    assert torch.equal(Scores.load(tmp_path / "s").values, expected.values)
    with pytest.raises(ValueError, match="no token-level scores"):  # they would be GradDot's
        method_by_name("adamw_influence").token_scores(run.store, queries, [0])

    capsys.readouterr()  # the progress bars of the run above
    plain = train(tmp_path / "plain", "lora", capture={"record_trajectory": False})
    args = ["attribute", "--store", plain.store_dir, "--queries", queries.root]
    out = tmp_path / "none"
    code = cli_main(
        [str(a) for a in [*args, "--method", "adamw_influence", "--out", out, "--allow-mismatch"]]
    )
    error = capsys.readouterr().err.strip()
    assert code == 2 and "record_trajectory=True" in error and "\n" not in error
