"""OLMo-core's ``Trainer`` with ``GradientCaptureCallback`` records exact per-example gradients.

A tiny OLMo-2 transformer (``TransformerConfig.olmo2_1M``, 2 blocks, 64-token vocabulary)
trains for a few steps on CPU on a ``NumpyFSLDataset`` written to a temporary folder,
with gradient accumulation (two micro-batches per step): in one process without
``torch.distributed``, and (the resume test) in a one-process gloo group, where OLMo-core
saves checkpoints asynchronously. A second
callback keeps every step's parameters and batch; the oracle is one backward per instance
through a fresh copy of the model at those parameters, of the instance's summed
next-token cross-entropy written by hand from the logits (plus the z-loss term when the
train module uses one). Every stored gradient of every layer (``layers="all"``: linear,
embedding and norm scales) must match it, and the stored ids must be OLMo-core's
instance indices in batch order.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.nn.lm_head import LMLossImplementation
from olmo_core.nn.transformer import Transformer, TransformerConfig
from olmo_core.optim import AdamWConfig, Scheduler
from olmo_core.train import Duration, Trainer, TrainerConfig
from olmo_core.train.callbacks import Callback, CheckpointerCallback
from olmo_core.train.train_module import (
    TransformerActivationCheckpointingConfig,
    TransformerActivationCheckpointingMode,
    TransformerTrainModuleConfig,
)
from torch import Tensor

from tda_plugins.capture import LayerSelection
from tda_plugins.capture.names import canonical_name
from tda_plugins.integrations.olmo_core import (
    GradientCaptureCallback,
    OLMoCoreLossNormalization,
    UnsupportedTrainingSetup,
    check_train_module,
)
from tda_plugins.precondition import load_curvature
from tda_plugins.session.capture import CaptureSession
from tda_plugins.session.settings import CaptureSettings
from tda_plugins.store import StoreReader
from tests.stores import rel_error

VOCAB = 64
SEQ = 8
INSTANCES = 24
BATCH = 4  # instances per optimizer step
MICRO_BATCH = 2  # instances per forward/backward: two micro-batches per step
FP32_TOL = 1e-4
MODEL = TransformerConfig.olmo2_1M(vocab_size=VOCAB, n_layers=2)


@dataclass
class RecordedStep:
    params: dict[str, Tensor]
    index: Tensor
    input_ids: Tensor


@dataclass
class StepRecorder(Callback):
    """Keeps, before each step, the parameters it starts from (by their names without
    activation checkpointing's wrappers) and its batch."""

    steps: list[RecordedStep] = field(default_factory=list)

    def pre_step(self, batch: dict) -> None:
        model = self.trainer.train_module.model
        params = {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
        self.steps.append(RecordedStep(params, batch["index"].clone(), batch["input_ids"].clone()))


def dataset_config(folder: Path) -> NumpyFSLDatasetConfig:
    """A token file of ``INSTANCES`` random sequences and the FSL dataset over it."""
    tokenizer = TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0)
    path = folder / "tokens.npy"
    config = NumpyFSLDatasetConfig(
        paths=[str(path)], sequence_length=SEQ, tokenizer=tokenizer, work_dir=str(folder / "data")
    )
    if not path.exists():
        rng = np.random.default_rng(0)
        tokens = rng.integers(1, VOCAB, size=INSTANCES * SEQ).astype(config.get_dtype())
        tokens.tofile(path)  # OLMo-core reads raw token arrays, no .npy header
    return config


def fit(
    folder: Path,
    callbacks: dict[str, Callback],
    steps: int,
    save_folder: Path,
    z_loss: float | None = None,
    load_path: Path | None = None,
    checkpoints: bool = False,
    scheduler: Scheduler | None = None,
    model: TransformerConfig = MODEL,
    checkpointer: CheckpointerCallback | None = None,
    async_bookkeeping: bool | None = None,
    activation_checkpointing: TransformerActivationCheckpointingConfig | None = None,
) -> Trainer:
    """Train ``steps`` steps (in total, counting a loaded checkpoint's) on CPU; with
    ``checkpoints``, saving through ``checkpointer`` (default: every 2 steps).
    ``async_bookkeeping=False`` removes old checkpoints in the training thread."""
    torch.manual_seed(0)
    dataset = dataset_config(folder).build()
    loader = NumpyDataLoaderConfig(global_batch_size=BATCH * SEQ, seed=0).build(dataset)
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=MICRO_BATCH * SEQ,
        max_sequence_length=SEQ,
        optim=AdamWConfig(lr=1e-2),
        z_loss_multiplier=z_loss,
        scheduler=scheduler,
        ac_config=activation_checkpointing,
    ).build(model.build(init_device="cpu"), device=torch.device("cpu"))
    config = TrainerConfig(
        save_folder=str(save_folder),
        load_path=None if load_path is None else str(load_path),
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        no_checkpoints=not checkpoints,
        async_bookkeeping=async_bookkeeping,
        callbacks={
            "checkpointer": checkpointer
            or CheckpointerCallback(save_interval=2, pre_train_checkpoint=False)
        },
    ).with_callbacks(callbacks)
    trainer = config.build(module, loader)
    trainer.fit()
    return trainer


def instance_grads(
    model: Transformer, params: dict[str, Tensor], input_ids: Tensor, z_loss: float | None
) -> list[dict[str, Tensor]]:
    """Per instance: parameter name -> gradient of its own summed next-token loss."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    out = []
    for ids in input_ids:
        logits = model(ids[None])[0, :-1]
        loss = F.cross_entropy(logits, ids[1:], reduction="sum")
        if z_loss is not None:
            loss = loss + z_loss * logits.logsumexp(-1).pow(2).sum()
        names = [n for n, _ in model.named_parameters()]
        grads = torch.autograd.grad(loss, list(model.parameters()))
        out.append(dict(zip(names, grads, strict=True)))
    return out


def layer_params(model: Transformer, layer: str) -> list[str]:
    """The parameter names of a captured module, in the store's flattened order."""
    return [f"{layer}.{n}" for n, _ in model.get_submodule(layer).named_parameters(recurse=False)]


def check_against_oracle(
    store: Path, recorded: list[RecordedStep], z_loss: float | None, first_step: int = 0
) -> int:
    """Every stored gradient equals the oracle; returns how many (example, layer) pairs."""
    reader = StoreReader(store)
    chunk = reader.load_all()
    oracle_model = MODEL.build(init_device="cpu")
    assert reader.steps[first_step:] == list(range(first_step, first_step + len(recorded)))
    compared = 0
    for k, step in enumerate(recorded):
        rows = (chunk.steps == first_step + k).nonzero().flatten()
        assert chunk.example_ids[rows].tolist() == step.index.tolist()
        oracle = instance_grads(oracle_model, step.params, step.input_ids, z_loss)
        for layer in reader.layer_names:
            names = layer_params(oracle_model, layer)
            stored = chunk.layers[layer].materialize()[rows]
            for i, grads in enumerate(oracle):
                expected = torch.cat([grads[n].flatten() for n in names])
                err = rel_error(stored[i], expected)
                assert err <= FP32_TOL, f"step {k} example {i} layer {layer}: {err:.2e}"
                compared += 1
    return compared


@pytest.mark.slow
@pytest.mark.parametrize("z_loss", [None, 1e-2])
def test_trainer_run_stores_exact_gradients_keyed_by_instance_index(
    tmp_path: Path, z_loss: float | None
) -> None:
    store = tmp_path / "grads"
    settings = CaptureSettings.from_options(store_dir=str(store), layers="all", curvature=False)
    trainer = fit(
        tmp_path,
        {"tda": GradientCaptureCallback(settings), "recorder": StepRecorder()},
        steps=3,
        save_folder=tmp_path / "run",
        z_loss=z_loss,
    )
    recorder = trainer.callbacks["recorder"]
    assert isinstance(recorder, StepRecorder)
    assert len(recorder.steps) == 3
    layers = StoreReader(store).layer_names
    assert {"embeddings", "lm_head.w_out", "lm_head.norm", "blocks.0.attention.w_q"} <= set(layers)
    assert check_against_oracle(store, recorder.steps, z_loss) == 3 * BATCH * len(layers)

    # The ids are OLMo-core's instance indices: the dataset returns the stored tokens there.
    dataset = dataset_config(tmp_path).build()
    dataset.prepare()
    for step in recorder.steps:
        for index, ids in zip(step.index.tolist(), step.input_ids, strict=True):
            assert torch.equal(torch.as_tensor(dataset[index]["input_ids"]), ids)


@pytest.mark.slow
def test_activation_checkpointing_stores_exact_gradients_under_the_plain_names(
    tmp_path: Path,
) -> None:
    """``ac_config`` wraps every block in torch's checkpoint wrapper: the store names the
    layers as the model without it does, and its gradients stay exact (the blocks'
    forwards run again in the backward)."""
    store = tmp_path / "grads"
    settings = CaptureSettings.from_options(store_dir=str(store), layers="all", curvature=False)
    full = TransformerActivationCheckpointingMode.full
    trainer = fit(
        tmp_path,
        {"tda": GradientCaptureCallback(settings), "recorder": StepRecorder()},
        steps=2,
        save_folder=tmp_path / "run",
        activation_checkpointing=TransformerActivationCheckpointingConfig(mode=full),
    )
    model = trainer.train_module.model
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())
    plain = list(LayerSelection(kind="all").resolve(MODEL.build(init_device="cpu")))
    assert StoreReader(store).layer_names == plain
    recorder = trainer.callbacks["recorder"]
    assert isinstance(recorder, StepRecorder)
    assert check_against_oracle(store, recorder.steps, None) == 2 * BATCH * len(plain)


@pytest.fixture
def gloo_world_of_one() -> Iterator[None]:
    """A one-process gloo group: OLMo-core then checkpoints asynchronously by default."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.usefixtures("gloo_world_of_one")
def test_resume_from_a_checkpoint_counts_every_step_once(tmp_path: Path) -> None:
    store = tmp_path / "grads"
    settings = CaptureSettings.from_options(store_dir=str(store))
    first = tmp_path / "first"
    trainer = fit(tmp_path, {"tda": GradientCaptureCallback(settings)}, 3, first, checkpoints=True)
    checkpointer = trainer.callbacks["checkpointer"]
    assert isinstance(checkpointer, CheckpointerCallback) and checkpointer.save_async
    # Kept in the store when OLMo-core took the step-2 checkpoint (2 steps done).
    checkpoint = first / "step2"
    assert (store / "rank-0" / "curvature-before-step2.safetensors").exists()
    assert StoreReader(store).steps == [0, 1, 2]

    # Resume from step 2 as if the run had died after step 3: the store drops its step 2
    # and the curvature restarts from the checkpoint's copy (steps 0 and 1).
    recorder = StepRecorder()
    fit(
        tmp_path,
        {"tda": GradientCaptureCallback(settings), "recorder": recorder},
        4,
        tmp_path / "second",
        load_path=checkpoint,
        checkpoints=True,
    )
    resumed = recorder.steps
    assert len(resumed) == 2
    assert StoreReader(store).steps == [0, 1, 2, 3]
    assert check_against_oracle(store, resumed, None, first_step=2) > 0
    ids = StoreReader(store).load_all().example_ids
    assert len(set(ids.tolist())) == 4 * BATCH, "an epoch's instances, each once"
    for factors in load_curvature(store).values():
        assert factors.tokens.item() == 4 * BATCH * SEQ


@pytest.mark.usefixtures("gloo_world_of_one")
def test_ephemeral_checkpoints_take_their_statistics_along(tmp_path: Path) -> None:
    """An ephemeral checkpoint every step, each removed once the next is saved: the store
    drops the K-FAC statistics it kept for the removed ones (each is the size of all the
    statistics) and keeps those of the checkpoints still on disk. Saved and removed in the
    training thread, so that what the store sees at each save does not race the removals
    (asynchronous ones are caught up with at a later save)."""
    store = tmp_path / "grads"
    settings = CaptureSettings.from_options(store_dir=str(store))
    checkpointer = CheckpointerCallback(
        save_interval=100, ephemeral_save_interval=1, pre_train_checkpoint=False, save_async=False
    )
    saves = tmp_path / "saves"
    callbacks = {"tda": GradientCaptureCallback(settings)}
    fit(
        tmp_path,
        callbacks,
        5,
        saves,
        checkpoints=True,
        checkpointer=checkpointer,
        async_bookkeeping=False,
    )
    held = {int(p.name[len("step") :]) for p in saves.glob("step*")}
    kept = {int(p.name.split("step")[-1].split(".")[0]) for p in store.glob("rank-0/*before-step*")}
    assert {1, 2} & held == set() and 5 in held
    assert {1, 2} & kept == set()  # removed long before the run ended
    assert held <= kept  # a checkpoint on disk can still be resumed from


def test_mean_reduction_outside_the_trainer(tmp_path: Path) -> None:
    """A plain ``model(ids, labels=labels)`` call averages over label tokens."""
    torch.manual_seed(0)
    model = MODEL.build(init_device="cpu")
    model.init_weights(max_seq_len=SEQ)
    ids = torch.randint(1, VOCAB, (3, SEQ))
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    labels[1, :4] = -100  # a masked prompt: those tokens carry no loss
    settings = CaptureSettings.from_options(store_dir=str(tmp_path), layers="all", curvature=False)
    session = CaptureSession(settings, model=model, normalization=OLMoCoreLossNormalization())
    session.engine.set_example_ids(torch.tensor([7, 8, 9]))
    model(ids, labels=labels).loss.backward()
    session.step()
    session.end()

    chunk = StoreReader(tmp_path).load_all()
    assert chunk.example_ids.tolist() == [7, 8, 9]
    names = [n for n, _ in model.named_parameters()]
    for i in range(3):
        keep = labels[i] != -100
        loss = F.cross_entropy(model(ids[i : i + 1])[0][keep], labels[i][keep], reduction="sum")
        grads = dict(zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True))
        for layer in chunk.layers:
            expected = torch.cat([grads[n].flatten() for n in layer_params(model, layer)])
            assert rel_error(chunk.layers[layer].materialize()[i], expected) <= FP32_TOL


def test_fused_loss_refused_only_when_it_hides_a_captured_layer() -> None:
    fused = LMLossImplementation.fused_linear
    config = replace(MODEL, lm_head=replace(MODEL.lm_head, loss_implementation=fused))
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=SEQ, max_sequence_length=SEQ, optim=AdamWConfig()
    ).build(config.build(init_device="cpu"), device=torch.device("cpu"))
    with pytest.raises(UnsupportedTrainingSetup, match="use LMLossImplementation"):
        check_train_module(module, LayerSelection())
    check_train_module(module, LayerSelection(exclude="lm_head"))


def test_a_mixture_of_experts_is_refused() -> None:
    """OLMo-core's MoE routers add batch-wide load-balancing and z-losses (on by default)
    and their experts are grouped weights, not hooked modules: refused at ``pre_train``'s
    check, naming the cause."""
    config = TransformerConfig.llama_like_moe(
        d_model=32,
        vocab_size=VOCAB,
        n_layers=1,
        n_heads=2,
        num_experts=2,
        top_k=1,
        expert_hidden_size=32,
        dropless=True,
    )
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=SEQ, max_sequence_length=SEQ, optim=AdamWConfig()
    ).build(config.build(init_device="cpu"), device=torch.device("cpu"))
    with pytest.raises(UnsupportedTrainingSetup, match="MoETransformer is a mixture of experts"):
        check_train_module(module, LayerSelection())


def test_the_transformers_entry_points_refuse_an_olmo_core_model_before_writing(
    tmp_path: Path,
) -> None:
    """``capture_examples`` and ``score_examples`` run a transformers causal LM's forward:
    an OLMo-core ``Transformer`` is refused up front, naming the way that works, and no
    store is begun."""
    from tda_plugins import capture_examples, score_examples

    model = MODEL.build(init_device="cpu")
    rows = [{"input_ids": list(range(1, 9))}]
    with pytest.raises(TypeError, match=r"recipes/olmo_core_capture\.py"):
        capture_examples(model, rows, tmp_path / "queries", progress=False)
    assert not (tmp_path / "queries").exists()
    with pytest.raises(TypeError, match="not Transformer"):
        score_examples(model, rows, rows, progress=False)


def test_settings_must_be_capture_settings() -> None:
    with pytest.raises(TypeError, match="CaptureSettings"):
        GradientCaptureCallback({"store_dir": "grads"})  # type: ignore[arg-type]


class _SpellingTokenizer:
    """Decodes token ids as ``t<id>`` words (all the capture needs of a tokenizer)."""

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"t{i}" for i in ids)


def test_a_tokenizer_stores_each_instances_text(tmp_path: Path) -> None:
    """With a tokenizer the store holds every captured instance's decoded tokens under its
    instance index; without one (the other tests) it holds no texts."""
    store = tmp_path / "grads"
    settings = CaptureSettings.from_options(store_dir=str(store), curvature=False)
    trainer = fit(
        tmp_path,
        {
            "tda": GradientCaptureCallback(settings, tokenizer=_SpellingTokenizer()),
            "recorder": StepRecorder(),
        },
        steps=2,
        save_folder=tmp_path / "run",
    )
    recorder = trainer.callbacks["recorder"]
    assert isinstance(recorder, StepRecorder)
    expected = {
        index: _SpellingTokenizer().decode(ids.tolist())
        for step in recorder.steps
        for index, ids in zip(step.index.tolist(), step.input_ids, strict=True)
    }
    assert StoreReader(store).texts() == expected
