"""The transformers/TRL ``GradientCaptureCallback`` inside real ``Trainer`` and ``SFTTrainer`` runs.

Every run trains a tiny Llama built from a config (``tests.models``) on CPU in fp32 and
checks what the store holds against a reference that never touches the engine: the
weights of each step (``tests.trainers.WeightSnapshots``) loaded into an fp64 copy of the
model, one backward per example of its own summed token loss on its unpadded tokens, with
the labels the trainer actually used (``tests.trainers.RecordingCollator``). Covered:

1. ``Trainer`` with gradient accumulation 1, 2 and 4, without and with gradient
   checkpointing (non-reentrant and reentrant): exact gradients for every layer, and each
   step holds exactly its micro-batches' examples.
2. TRL ``SFTTrainer`` (fused LM head, completion-only loss, TRL's own tokenization with a
   local tokenizer) on the full model and on a PEFT LoRA model; the fused head's
   ``lm_head``, which no hook sees.
3. Resuming from a checkpoint (after a crash, or after a finished run, and from a
   checkpoint outside the new run's output_dir): the store and the K-FAC statistics
   equal those of an uninterrupted run.
4. Evaluation and generation during and after training record nothing; under NEFTune the
   store holds the gradients of the noisy forward each step ran.
5. Bad configurations (packing, padding-free, a selection matching nothing, another run's
   store, a compiled model) fail at ``on_train_begin``, before any step.
6. LESS: the trainer's Adam moments are saved and ``less`` scores the store.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from tda_plugins import LayerSelection, LayerSelectionError, capture_examples
from tda_plugins.capture.adapters import DEFAULT_REGISTRY
from tda_plugins.integrations.transformers import GradientCaptureCallback
from tda_plugins.integrations.transformers.setup import unwrap_optimizer
from tda_plugins.methods import method_by_name
from tda_plugins.precondition import load_curvature
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tda_plugins.store import StoreError, StoreReader
from tests.models import tiny_causal_lm, with_lora
from tests.stores import capture_store
from tests.trainers import (
    PAD_ID,
    RESTORE_BEST,
    RecordingCollator,
    WeightSnapshots,
    assert_steps_hold_their_micro_batches,
    assert_store_matches_oracle,
    pad_rows,
    prompt_completion_pairs,
    stored_ids_per_step,
    token_rows,
    training_args,
    word_tokenizer,
)

ROWS = 24
ALL = LayerSelection(kind="all")


def llama() -> nn.Module:
    """The tiny Llama in fp32 (``Trainer`` puts it in train mode)."""
    return tiny_causal_lm("llama", torch.float32)


def fp64_llama() -> nn.Module:
    """The oracle's model: the same architecture in fp64 (weights are loaded per step)."""
    return tiny_causal_lm("llama", torch.float64)


def fp64_lora_llama() -> nn.Module:
    """The oracle's LoRA model (r=4 on every linear; weights are loaded per step)."""
    return with_lora(tiny_causal_lm("llama", torch.float64))


@dataclass
class Run:
    """A finished (or failed) training run and what the test recorded of it."""

    trainer: Trainer
    collator: RecordingCollator
    snapshots: WeightSnapshots
    store_dir: Path
    error: BaseException | None = None
    #: For prompt/completion data: token ids -> the completion-only labels expected.
    expected_labels: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    @property
    def store(self) -> StoreReader:
        return StoreReader(self.store_dir)


def train(
    tmp_path: Path,
    model: nn.Module | None = None,
    capture: dict[str, Any] | None = None,
    rows: int = ROWS,
    extra_callbacks: Sequence[TrainerCallback] = (),
    store: str = "store",
    output: str = "out",
    resume_from: str | Path | None = None,
    expect_failure: bool = False,
    eval_dataset: Dataset | None = None,
    **overrides: Any,
) -> Run:
    """``Trainer`` on ``rows`` token rows with ``GradientCaptureCallback(**capture)``
    (default: every layer) writing to ``tmp_path/store``. With ``expect_failure`` an
    exception of ``train()`` is kept in ``Run.error`` instead of raised."""
    store_dir = tmp_path / store
    collator = RecordingCollator()
    snapshots = WeightSnapshots()
    callback = GradientCaptureCallback(store_dir=str(store_dir), **(capture or {"layers": "all"}))
    trainer = Trainer(
        model=model if model is not None else llama(),
        args=training_args(tmp_path / output, **overrides),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(rows)]),
        eval_dataset=eval_dataset,
        data_collator=collator,
        callbacks=[snapshots, *extra_callbacks, callback],
    )
    run = Run(trainer, collator, snapshots, store_dir)
    resume = None if resume_from is None else str(resume_from)
    return finish(run, lambda: trainer.train(resume_from_checkpoint=resume), expect_failure)


def finish(run: Run, train_call: Callable[[], object], expect_failure: bool) -> Run:
    """Run ``train_call``; keep its exception in ``run.error`` if one is expected."""
    try:
        train_call()
    except Exception as error:
        if not expect_failure:
            raise
        run.error = error
    return run


# -- 1. Trainer: exact per-example gradients -----------------------------------------------


CHECKPOINTING = {
    "plain": (1, None),
    "accumulation4": (4, None),
    "accumulation4-checkpointing": (4, {}),
    "reentrant-checkpointing": (2, {"use_reentrant": True}),
}


@pytest.mark.parametrize("case", CHECKPOINTING)
def test_trainer_stores_each_examples_exact_gradient(tmp_path: Path, case: str) -> None:
    """Every stored gradient (all layers: linear, embedding, RMSNorm) equals the fp64 oracle
    of that example's own summed loss at its step's weights, whatever the accumulation
    (the trainer divides by the window's token count) and under gradient checkpointing
    (transformers' default non-reentrant, and reentrant); steps 0..2 each hold exactly
    their ``2 x accumulation`` examples, none twice."""
    accumulation, checkpointing = CHECKPOINTING[case]
    run = train(
        tmp_path,
        gradient_accumulation_steps=accumulation,
        gradient_checkpointing=checkpointing is not None,
        gradient_checkpointing_kwargs=checkpointing,
    )
    assert run.trainer.model.is_gradient_checkpointing == (checkpointing is not None)
    assert run.snapshots.steps_begun == 3
    assert run.store.num_examples == 3 * 2 * accumulation
    assert_steps_hold_their_micro_batches(run.store, run.collator, accumulation, steps=3)
    report = assert_store_matches_oracle(
        run.store_dir, run.snapshots, run.collator.examples(), fp64_llama
    )
    assert report.compared == run.store.num_examples * len(run.store.layer_names)


class NoisyEmbeddings(TrainerCallback):
    """Keeps the embedding output each training forward ran on, after NEFTune's noise
    (its hook is registered before ``on_train_begin``, so it runs before this one), by
    the example's unpadded token ids (pad id 0 never occurs inside a row)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, ...], Tensor] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        kwargs["model"].get_input_embeddings().register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        for ids, row in zip(inputs[0], output, strict=True):
            length = int((ids != PAD_ID).sum())
            self.rows[tuple(ids[:length].tolist())] = row[:length].detach().clone()

    def oracle_model(self, build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        """``build`` with its embedding output replaced by the recorded noisy values (still
        the embedding's output, so its weight's gradient is the one the step took)."""

        def noisy(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
            recorded = self.rows[tuple(inputs[0][0].tolist())][None].to(output)
            return output + (recorded - output).detach()

        def model() -> nn.Module:
            built = build()
            built.get_input_embeddings().register_forward_hook(noisy)
            return built

        return model


def test_under_neftune_the_store_holds_the_gradients_of_the_noisy_forward(
    tmp_path: Path,
) -> None:
    """With ``neftune_noise_alpha`` (the README's claim), every stored gradient is that of
    the noisy forward the step trained on: the oracle replays the recorded noisy
    embeddings; the same oracle without the noise is far off, so the noise mattered."""
    noisy = NoisyEmbeddings()
    run = train(tmp_path, neftune_noise_alpha=5.0, extra_callbacks=[noisy])
    examples = run.collator.examples()
    assert len(noisy.rows) == run.store.num_examples == 6
    assert_store_matches_oracle(
        run.store_dir, run.snapshots, examples, noisy.oracle_model(fp64_llama)
    )
    with pytest.raises(AssertionError, match="relative error"):
        assert_store_matches_oracle(run.store_dir, run.snapshots, examples, fp64_llama)


def training_output_fields(model: nn.Module) -> list[set[str]]:
    """Filled with the output fields of every forward call of ``model`` under grad."""
    seen: list[set[str]] = []

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            seen.append({k for k, v in output.items() if v is not None})

    model.register_forward_hook(keep)
    return seen


# -- 2. TRL SFTTrainer ---------------------------------------------------------------------


def sft_train(
    tmp_path: Path,
    model: nn.Module,
    capture: dict[str, Any],
    rows: int = 16,
    record_batches: bool = True,
    expect_failure: bool = False,
    **overrides: Any,
) -> Run:
    """``SFTTrainer`` on prompt/completion text (completion-only loss, TRL's own tokenization
    with a local word tokenizer), fused LM head, packing off unless ``overrides`` say so.
    ``record_batches``: wrap TRL's collator in a :class:`RecordingCollator` (else TRL
    picks its own collator, as packing needs)."""
    pairs = prompt_completion_pairs(rows)
    store_dir = tmp_path / "store"
    collator = RecordingCollator(DataCollatorForLanguageModeling(pad_token_id=PAD_ID))
    snapshots = WeightSnapshots()
    options: dict[str, Any] = dict(packing=False, gradient_accumulation_steps=2)
    options.update(overrides)
    trainer = SFTTrainer(
        model=model,
        args=training_args(tmp_path / "out", config_cls=SFTConfig, **options),
        train_dataset=Dataset.from_list([p.row() for p in pairs]),
        processing_class=word_tokenizer(),
        data_collator=collator if record_batches else None,
        callbacks=[snapshots, GradientCaptureCallback(store_dir=str(store_dir), **capture)],
    )
    run = Run(trainer, collator, snapshots, store_dir)
    run.expected_labels = {p.tokens(): p.labels() for p in pairs}
    return finish(run, trainer.train, expect_failure)


def assert_completion_only_labels(run: Run) -> None:
    """TRL trained on labels that are -100 exactly on the prompt tokens (and padding)."""
    examples = run.collator.examples()
    assert examples
    for ids, labels in examples.values():
        assert labels.tolist() == run.expected_labels[tuple(ids.tolist())]


SFT_MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], nn.Module], dict[str, Any]]] = {
    # TRL's fused LM head reads lm_head.weight without calling lm_head (see the bug test).
    "full": (llama, fp64_llama, {"layers": "all", "exclude": r"^lm_head$"}),
    "lora": (lambda: with_lora(llama()), fp64_lora_llama, {}),
}


@pytest.mark.parametrize("kind", SFT_MODELS)
def test_sft_trainer_stores_each_examples_exact_gradient(tmp_path: Path, kind: str) -> None:
    """SFTTrainer (fused LM head: the loss arrives through ``output.log_probs``; gradient
    checkpointing on, SFTConfig's default; accumulation 2) on prompt/completion data:
    the labels mask exactly the prompt, and every stored gradient equals the oracle of
    the example's own summed completion loss. Full model: every layer but ``lm_head``;
    LoRA: the default selection, the ``lora_A``/``lora_B`` adapters only."""
    build, oracle_model, capture = SFT_MODELS[kind]
    model = build()
    fields = training_output_fields(model)
    run = sft_train(tmp_path, model, capture)
    assert fields and all("log_probs" in f for f in fields), "the fused LM head was not used"
    assert run.trainer.model.is_gradient_checkpointing
    assert_completion_only_labels(run)
    if kind == "lora":
        assert run.store.layer_names and all(
            ".lora_A." in n or ".lora_B." in n for n in run.store.layer_names
        )
    assert_steps_hold_their_micro_batches(run.store, run.collator, accumulation=2, steps=3)
    assert_store_matches_oracle(run.store_dir, run.snapshots, run.collator.examples(), oracle_model)


def test_sft_full_model_stores_only_layers_it_captured(tmp_path: Path) -> None:
    """Bug: TRL's fused LM head computes the logits from ``lm_head.weight`` without calling
    ``lm_head``, so no hook ever sees it. With the default selection (linear, which includes
    ``lm_head``) the run must either refuse before step 0, naming ``lm_head``, or store only
    layers it captured, all readable and exact. Today the store lists ``lm_head`` but no
    shard holds it: reading the store fails with ``KeyError: 'lm_head'``."""
    run = sft_train(tmp_path, llama(), {}, expect_failure=True)
    if run.error is not None:
        assert run.snapshots.steps_begun == 0
        assert "lm_head" in str(run.error)
        return
    assert_store_matches_oracle(run.store_dir, run.snapshots, run.collator.examples(), fp64_llama)


# -- 3. resuming from a checkpoint ---------------------------------------------------------


class SimulatedCrash(RuntimeError):
    """Raised by :class:`CrashAtStep`."""


class CrashAtStep(TrainerCallback):
    """Kills training at the start of optimizer step ``step`` (steps before it are done)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise SimulatedCrash(f"crash at step {self.step}")


def assert_same_store(got: StoreReader, ref: StoreReader) -> None:
    """Same layers, same (step, example id) sequence, bitwise-equal gradients."""
    assert got.layer_names == ref.layer_names
    a, b = got.load_all(), ref.load_all()
    assert a.steps.tolist() == b.steps.tolist()
    assert a.example_ids.tolist() == b.example_ids.tolist()
    for layer in ref.layer_names:
        assert torch.equal(a.layers[layer].materialize(), b.layers[layer].materialize()), layer


def assert_same_curvature(got: Path, ref: Path) -> None:
    """Same K-FAC sums and token counts for the same layers."""
    a, b = load_curvature(got), load_curvature(ref)
    assert a and sorted(a) == sorted(b)
    for layer in b:
        assert torch.equal(a[layer].tokens, b[layer].tokens), layer
        assert torch.allclose(a[layer].a_sum, b[layer].a_sum, rtol=1e-12, atol=0), layer
        assert torch.allclose(a[layer].g_sum, b[layer].g_sum, rtol=1e-12, atol=0), layer


RESUMABLE: dict[str, Any] = dict(
    max_steps=4, save_strategy="steps", save_steps=2, gradient_accumulation_steps=2
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The 4-step run every resumed run must reproduce."""
    return train(tmp_path_factory.mktemp("uninterrupted"), **RESUMABLE)


def crash_at_step_3(tmp_path: Path) -> Run:
    """Steps 0..2 done (step 2 already in the store), checkpoint-2 saved, then a crash."""
    run = train(tmp_path, extra_callbacks=[CrashAtStep(3)], expect_failure=True, **RESUMABLE)
    assert isinstance(run.error, SimulatedCrash)
    assert run.store.steps == [0, 1, 2]
    return run


@pytest.mark.parametrize("first_run", ["crashed", "finished"])
def test_resumed_run_stores_what_an_uninterrupted_run_stores(
    tmp_path: Path, uninterrupted: Run, first_run: str
) -> None:
    """A run that crashed at the start of step 3 (step 2 already in the store) or that
    finished all 4 steps, resumed from ``checkpoint-2`` with a fresh callback on the same
    store: the store holds steps 0..3 once each, bitwise equal to an uninterrupted run's,
    and the K-FAC statistics (restored from the copy the store kept for step 2, not
    double-counted) equal the uninterrupted run's."""
    if first_run == "crashed":
        crash_at_step_3(tmp_path)
    else:
        assert train(tmp_path, **RESUMABLE).store.steps == [0, 1, 2, 3]
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (uninterrupted.store_dir / "rank-0" / "curvature-before-step2.safetensors").exists()

    resumed = train(tmp_path, resume_from=checkpoint, **RESUMABLE)
    assert resumed.snapshots.steps_begun == 2  # steps 2 and 3 only
    assert resumed.store.steps == [0, 1, 2, 3]
    assert_same_store(resumed.store, uninterrupted.store)
    assert_same_curvature(resumed.store_dir, uninterrupted.store_dir)


def test_a_run_checkpointed_at_its_last_step_keeps_one_copy_of_its_statistics(
    uninterrupted: Run,
) -> None:
    """The Trainer saves a checkpoint at the last step (step 4 of 4 here, as every run with
    a save strategy does), and the run then ends: the final K-FAC statistics are the
    step-4 checkpoint's file, not a second copy of its bytes."""
    folder = uninterrupted.store_dir / "rank-0"
    final = (folder / "curvature.safetensors").stat()
    assert final.st_ino == (folder / "curvature-before-step4.safetensors").stat().st_ino
    assert final.st_ino != (folder / "curvature-before-step2.safetensors").stat().st_ino


def test_resume_from_a_checkpoint_outside_output_dir(tmp_path: Path, uninterrupted: Run) -> None:
    """``trainer.train(resume_from_checkpoint=<path>)`` accepts a checkpoint anywhere: a
    crashed run resumed from its ``checkpoint-2`` by a trainer writing to a new output_dir
    continues the store exactly like an uninterrupted run, K-FAC statistics included (the
    store keeps them per checkpointed step, independent of where checkpoints live)."""
    crash_at_step_3(tmp_path)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    resumed = train(tmp_path, output="retry-out", resume_from=checkpoint, **RESUMABLE)
    assert resumed.store.steps == [0, 1, 2, 3]
    assert_same_store(resumed.store, uninterrupted.store)
    assert_same_curvature(resumed.store_dir, uninterrupted.store_dir)


def test_checkpoints_the_trainer_deletes_take_their_statistics_along(tmp_path: Path) -> None:
    """save_total_limit=2 with a checkpoint every step: the store keeps the K-FAC
    statistics of checkpoints 3 and 4 alone, the ones the trainer still holds (each is the
    size of all the statistics), and a run resumed from checkpoint-3 still ends with the
    store and statistics the whole run ended with."""
    rotating = {**RESUMABLE, "save_steps": 1, "save_total_limit": 2}
    run = train(tmp_path, **rotating)
    held = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    assert held == ["checkpoint-3", "checkpoint-4"]
    snapshots = sorted(p.name for p in (run.store_dir / "rank-0").glob("curvature-*"))
    assert snapshots == ["curvature-before-step3.safetensors", "curvature-before-step4.safetensors"]
    whole = tmp_path / "whole"
    shutil.copytree(run.store_dir, whole)
    resumed = train(tmp_path, resume_from=tmp_path / "out" / "checkpoint-3", **rotating)
    assert resumed.snapshots.steps_begun == 1
    assert_same_store(resumed.store, StoreReader(whole))
    assert_same_curvature(resumed.store_dir, whole)


# -- 4. evaluation and generation ----------------------------------------------------------


class GenerateAtStepEnd(TrainerCallback):
    """Greedy ``model.generate`` after every optimizer step (while capture is attached)."""

    def __init__(self) -> None:
        self.generated: list[torch.Tensor] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        prompt = torch.tensor([[5, 6, 7]])
        self.generated.append(kwargs["model"].generate(prompt, max_new_tokens=3, do_sample=False))


def test_evaluation_and_generation_record_nothing(tmp_path: Path) -> None:
    """Evaluation after every step and generation after every step during training, then
    both again after training: the store equals that of the same run without them (same
    examples per step, same gradients), and is untouched by the calls after training."""
    plain = train(tmp_path, store="plain-store", output="plain-out")
    generate = GenerateAtStepEnd()
    eval_rows = Dataset.from_list([{"input_ids": r} for r in token_rows(6, seed=1)])
    run = train(
        tmp_path,
        extra_callbacks=[generate],
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=2,
        eval_dataset=eval_rows,
    )
    assert len(generate.generated) == 3
    assert sum("eval_loss" in entry for entry in run.trainer.state.log_history) == 3
    assert_same_store(run.store, plain.store)

    stored = stored_ids_per_step(run.store)
    run.trainer.evaluate()
    run.trainer.model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert stored_ids_per_step(run.store) == stored
    assert run.store.num_examples == 3 * 2


def test_a_run_that_restores_its_best_checkpoint_ends_the_store_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """load_best_model_at_end, the eval loss rising over the run (random rows): the
    trainer puts back checkpoint-1 after 3 steps. The store, its K-FAC statistics and Adam
    moments are then those of the same run stopped after 1 step, and queries taken from
    the restored model are accepted as the model the store ends with."""
    eval_rows = Dataset.from_list([{"input_ids": r} for r in token_rows(6, seed=1)])
    with caplog.at_level("WARNING"):
        run = train(tmp_path, eval_dataset=eval_rows, **RESTORE_BEST)
    restored = Path(str(run.trainer.state.best_model_checkpoint)).name
    assert restored == "checkpoint-1" and run.trainer.state.global_step == 3
    assert "restored checkpoint-1, the weights after 1 of the run's 3" in caplog.text
    assert "K-FAC statistics and Adam moments saved with that checkpoint" in caplog.text
    stopped = train(tmp_path, store="stopped-store", output="stopped-out", max_steps=1)
    assert_same_store(run.store, stopped.store)
    assert_same_curvature(run.store_dir, stopped.store_dir)
    got, expected = (
        load_file(run.store_dir / "optimizer.safetensors"),
        load_file(stopped.store_dir / "optimizer.safetensors"),
    )
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert run.store.end_weights() == stopped.store.end_weights()
    query = {"input_ids": token_rows(1, seed=5)[0]}
    queries = capture_examples(run.trainer.model, [query], tmp_path / "q", layers="all")
    run.store.require_compatible(queries)


def test_a_restored_checkpoint_without_optimizer_state_leaves_the_moments_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With save_only_model the restored checkpoint has no optimizer.pt: the store ends
    there all the same, without Adam moments (the last step's would not match its
    weights), and says that LESS cannot score it."""
    eval_rows = Dataset.from_list([{"input_ids": r} for r in token_rows(6, seed=1)])
    with caplog.at_level("WARNING"):
        run = train(tmp_path, eval_dataset=eval_rows, save_only_model=True, **RESTORE_BEST)
    assert run.store.steps == [0]
    assert "LESS cannot score it" in caplog.text
    assert not (run.store_dir / "optimizer.safetensors").exists()


def test_an_optimizer_without_adam_moments_ends_the_run_without_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Adamax has betas and eps but keeps exp_inf, not exp_avg_sq: the run ends normally,
    its store whole, with a warning that LESS cannot score it (which LESS then says)."""
    model = llama()
    store = tmp_path / "store"
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path / "out"),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(6)]),
        data_collator=pad_rows,
        optimizers=(torch.optim.Adamax(model.parameters(), lr=1e-2), None),
        callbacks=[GradientCaptureCallback(store_dir=str(store), curvature=False)],
    )
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "the optimizer (Adamax) keeps no Adam moments" in caplog.text
    assert StoreReader(store).steps == [0, 1, 2]
    with pytest.raises(StoreError, match="LESS needs the Adam moments"):
        method_by_name("less").score(StoreReader(store), StoreReader(store))


# -- 5. bad configurations fail before the first step --------------------------------------


def assert_refused_before_any_step(run: Run, error: type[Exception], message: str) -> None:
    """``train()`` raised ``error`` naming ``message``; no optimizer step began and no
    training batch was even built."""
    assert isinstance(run.error, error), repr(run.error)
    assert message in str(run.error)
    assert run.snapshots.steps_begun == 0
    assert run.collator.batches == []


@pytest.mark.parametrize(
    "options, named",
    [({"packing": True, "max_length": 32}, "packing"), ({"padding_free": True}, "padding_free")],
    ids=["packing", "padding_free"],
)
def test_sft_batches_that_mix_examples_are_refused_at_train_begin(
    tmp_path: Path, options: dict[str, Any], named: str
) -> None:
    """SFTConfig(packing=True) and SFTConfig(padding_free=True) put several examples in one
    sequence: refused by name at on_train_begin, before step 0, weights untouched, no store."""
    model = llama()
    initial = copy.deepcopy(model.state_dict())
    options = {"max_length": None, **options}
    run = sft_train(tmp_path, model, {}, record_batches=False, expect_failure=True, **options)
    assert_refused_before_any_step(run, UnsupportedTrainingSetup, named)
    assert_same_weights(model, initial)
    assert not run.store_dir.exists()


def test_a_flattening_collator_is_refused_at_train_begin(tmp_path: Path) -> None:
    """transformers' DataCollatorWithFlattening packs each batch into one row (a plain
    Trainer, no SFTConfig flag to read): refused by name before step 0, weights untouched,
    no store."""
    model = llama()
    initial = copy.deepcopy(model.state_dict())
    store = tmp_path / "store"
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path / "out"),
        train_dataset=Dataset.from_list([{"input_ids": r, "labels": r} for r in token_rows(4)]),
        data_collator=DataCollatorWithFlattening(),
        callbacks=[GradientCaptureCallback(store_dir=str(store), curvature=False)],
    )
    with pytest.raises(UnsupportedTrainingSetup, match="DataCollatorWithFlattening"):
        trainer.train()
    assert_same_weights(model, initial)
    assert not store.exists()


def test_selection_matching_nothing_is_refused_at_train_begin(tmp_path: Path) -> None:
    """``include="nothing"`` selects no layer: a LayerSelectionError that says so, before
    step 0, with the weights untouched."""
    model = llama()
    initial = copy.deepcopy(model.state_dict())
    run = train(tmp_path, model, capture={"include": "nothing"}, expect_failure=True)
    assert_refused_before_any_step(run, LayerSelectionError, "matched no layer")
    assert_same_weights(model, initial)
    assert not run.store_dir.exists()


def test_store_of_another_run_is_refused_at_train_begin(tmp_path: Path) -> None:
    """A fresh (not resumed) run into a store that holds another run's steps: a StoreError
    naming the held steps and the fix, before step 0; the first run's store is intact."""
    first = train(tmp_path, output="first-out")
    before = first.store.load_all()
    model = llama()
    initial = copy.deepcopy(model.state_dict())
    run = train(tmp_path, model, output="second-out", expect_failure=True)
    assert_refused_before_any_step(run, StoreError, "already holds steps 0..2")
    assert_same_weights(model, initial)
    after = first.store.load_all()
    assert after.example_ids.tolist() == before.example_ids.tolist()
    assert after.steps.tolist() == before.steps.tolist()


def test_compiled_model_is_refused_at_train_begin(tmp_path: Path) -> None:
    """``Trainer`` passes a ``torch.compile``'d model (an ``OptimizedModule``) through to
    the callbacks, which refuse it by name before anything is compiled or trained."""
    model = llama()
    initial = copy.deepcopy(model.state_dict())
    run = train(tmp_path, torch.compile(model), expect_failure=True)
    assert_refused_before_any_step(run, UnsupportedTrainingSetup, "torch.compile")
    assert_same_weights(model, initial)


def test_peft_prompt_tuning_is_refused_at_train_begin(tmp_path: Path) -> None:
    """PEFT prompt tuning's virtual tokens are concatenated to the batch's embeddings, not
    called per example through a layer: refused by name before any step, even with every
    layer asked for (which first failed inside PEFT's forward)."""
    from peft import PromptTuningConfig, get_peft_model

    model = get_peft_model(llama(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    initial = copy.deepcopy(model.state_dict())
    run = train(tmp_path, model, capture={"layers": "all"}, expect_failure=True)
    assert_refused_before_any_step(run, UnsupportedTrainingSetup, "is PROMPT_TUNING")
    assert "train a LoRA adapter" in str(run.error)
    assert_same_weights(model, initial)


def assert_same_weights(model: nn.Module, initial: dict[str, torch.Tensor]) -> None:
    """No optimizer step touched ``model``: its weights are still ``initial``."""
    current = model.state_dict()
    assert all(torch.equal(current[k], v) for k, v in initial.items())


# -- 6. LESS -------------------------------------------------------------------------------


def test_less_scores_a_trainer_store(tmp_path: Path) -> None:
    """After training with the trainer's AdamW, ``optimizer.safetensors`` holds exactly the
    optimizer's final moments of every captured layer, and ``less`` scores the store
    against queries captured with the same layers on the final model: one finite cosine
    per (training example, query)."""
    run = train(tmp_path)
    optimizer = unwrap_optimizer(run.trainer.optimizer)
    assert isinstance(optimizer, torch.optim.AdamW)
    saved = load_file(run.store_dir / "optimizer.safetensors")
    model = run.trainer.model
    for layer in run.store.layer_names:
        module = model.get_submodule(layer)
        adapter = DEFAULT_REGISTRY.lookup(module)
        assert adapter is not None
        params = adapter.captured_parameters(module)
        for moment in ("exp_avg", "exp_avg_sq"):
            values = {n: optimizer.state[p][moment] for n, p in params.items()}
            assert torch.equal(saved[f"{layer}::{moment}"], adapter.flatten(module, values))

    query_rows = token_rows(3, seed=7)
    queries = capture_store(
        model, [pad_rows([{"input_ids": r} for r in query_rows])], tmp_path / "queries", ALL
    )
    scores = method_by_name("less").score(run.store, queries)
    assert scores.values.shape == (run.store.num_examples, len(query_rows))
    assert torch.isfinite(scores.values).all()
    assert scores.values.abs().max() <= 1 + 1e-5  # cosines
    assert scores.values.abs().min() > 0


@pytest.mark.parametrize("on_embedding", [True, False])
def test_trainable_parameters_left_out_of_the_capture_are_named_with_the_way_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, on_embedding: bool
) -> None:
    """PEFT LoRA on ``embed_tokens`` trains ``lora_embedding_A/B``, raw parameters no
    per-example hook sees: the capture warns once, naming them and the fix (leave the
    embedding out of ``target_modules``), and selection, which could not correct their
    ``.grad``, refuses with the same fix. LoRA on the projections alone: no warning."""
    from peft import LoraConfig, get_peft_model

    from tda_plugins.integrations.transformers import DataSelectionCallback

    targets = ["q_proj", "embed_tokens"] if on_embedding else ["q_proj"]
    rows = [{"input_ids": r} for r in token_rows(4)]

    def trainer(callback: TrainerCallback, out: str) -> Trainer:
        model = get_peft_model(
            tiny_causal_lm("llama", torch.float32), LoraConfig(r=4, target_modules=targets)
        )
        return Trainer(
            model=model,
            args=training_args(tmp_path / out, max_steps=1),
            train_dataset=Dataset.from_list(rows),
            data_collator=pad_rows,
            callbacks=[callback],
        )

    with caplog.at_level("WARNING", logger="tda_plugins"):
        trainer(GradientCaptureCallback(store_dir=str(tmp_path / "store")), "capture").train()
    warned = [r.getMessage() for r in caplog.records if "not captured" in r.getMessage()]
    selection = trainer(DataSelectionCallback(rows[:1]), "selection")
    if not on_embedding:
        assert warned == []
        selection.train()
        return
    (message,) = warned
    assert "lora_embedding_A" in message and "leave the embedding out of target_modules" in message
    with pytest.raises(UnsupportedTrainingSetup, match="leave the embedding out of target_modules"):
        selection.train()


def test_peft_trainable_tokens_are_named_with_the_way_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """PEFT's ``trainable_token_indices`` (which TRL sets itself when a cloned chat
    template adds tokens) trains a delta the embedding uses raw: with every layer asked
    for, the capture warns and selection refuses, both naming it and a way in that
    works (the embedding trained whole), not ``layers='all'``, which was given."""
    from peft import LoraConfig, get_peft_model

    from tda_plugins.integrations.transformers import DataSelectionCallback

    rows = [{"input_ids": r} for r in token_rows(4)]
    lora = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 4])

    def trainer(callback: TrainerCallback, out: str) -> Trainer:
        return Trainer(
            model=get_peft_model(tiny_causal_lm("llama", torch.float32), lora),
            args=training_args(tmp_path / out, max_steps=1),
            train_dataset=Dataset.from_list(rows),
            data_collator=pad_rows,
            callbacks=[callback],
        )

    capture = GradientCaptureCallback(store_dir=str(tmp_path / "store"), layers="all")
    with caplog.at_level("WARNING", logger="tda_plugins"):
        trainer(capture, "capture").train()
    (message,) = [r.getMessage() for r in caplog.records if "not captured" in r.getMessage()]
    assert "trainable_tokens_delta" in message and "modules_to_save=['embed_tokens']" in message
    selection = trainer(DataSelectionCallback(rows[:1], layers="all"), "selection")
    with pytest.raises(UnsupportedTrainingSetup, match="trainable_token_indices"):
        selection.train()


def test_a_modules_to_save_head_under_a_fused_loss_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """PEFT's ``modules_to_save=['lm_head']`` trains a copy of the head inside a wrapper;
    TRL's fused loss bypasses it as it does the plain head. With every layer asked for,
    the capture leaves the copy out with a warning and trains on (it stopped at the first
    micro-batch: the copy received no gradient through its module call)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        llama(), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    )
    with caplog.at_level("WARNING", logger="tda_plugins"):
        run = sft_train(tmp_path, model, {"layers": "all"}, rows=4, max_steps=1)
    copy = "base_model.model.lm_head.modules_to_save.default"
    assert run.store.steps == [0] and copy not in run.store.layer_names
    assert any(f"{copy} is left out" in r.getMessage() for r in caplog.records)


def test_an_embedding_tied_to_a_fused_head_is_named_with_a_way_out_that_works(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full fine-tune under SFTTrainer of a model whose head shares the input
    embedding's weight (SmolLM2's, Qwen2.5's), every layer asked for: TRL's fused head
    hides the head, so the shared weight cannot be captured whole. The warning (capture)
    and the refusal (selection) name it and a way out that works: transformers' Trainer
    or freezing it; not ``layers='all'``, which was given, nor label smoothing, which the
    capture refuses."""
    from tda_plugins.integrations.transformers import DataSelectionCallback

    def tied() -> nn.Module:
        return tiny_causal_lm("llama", torch.float32, tie_word_embeddings=True)

    with caplog.at_level("WARNING", logger="tda_plugins"):
        run = sft_train(tmp_path / "capture", tied(), {"layers": "all"}, rows=4, max_steps=1)
    assert not any("embed_tokens" in n for n in run.store.layer_names)
    (message,) = [r.getMessage() for r in caplog.records if "not captured" in r.getMessage()]
    assert "model.embed_tokens.weight" in message
    assert "transformers' Trainer" in message and "layers='all'" not in message
    trainer = SFTTrainer(
        model=tied(),
        args=training_args(tmp_path / "selection", config_cls=SFTConfig, max_steps=1),
        train_dataset=Dataset.from_list([p.row() for p in prompt_completion_pairs(4)]),
        processing_class=word_tokenizer(),
        callbacks=[DataSelectionCallback([{"input_ids": token_rows(1)[0]}], layers="all")],
    )
    with pytest.raises(UnsupportedTrainingSetup, match="transformers' Trainer") as refused:
        trainer.train()
    assert "label smoothing" not in str(refused.value)


@pytest.mark.parametrize(
    ("options", "left_out"),
    [
        ({"use_liger_kernel": True}, True),
        (
            {
                "use_liger_kernel": True,
                "liger_kernel_config": {"fused_linear_cross_entropy": False},
            },
            False,
        ),
        ({}, False),
    ],
    ids=["liger", "liger-without-fused-loss", "plain"],
)
def test_liger_fused_cross_entropy_leaves_the_head_out_at_train_begin(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, options: dict[str, Any], left_out: bool
) -> None:
    """Liger's fused linear cross-entropy (on by default with ``use_liger_kernel``) reads
    ``lm_head.weight`` without calling ``lm_head``, as TRL's fused head does: the head is
    left out of the layers at ``on_train_begin``, with a warning that names the fusion.
    (liger-kernel is not installed here: the arguments alone are what the check reads.)"""
    from tda_plugins.integrations.transformers.setup import adapt_settings
    from tda_plugins.session.settings import LayerSettings

    model = tiny_causal_lm("llama", torch.float32)
    args = training_args(tmp_path / "out", **options)
    with caplog.at_level("WARNING", logger="tda_plugins"):
        settings = adapt_settings(LayerSettings(), args, model)
    layers = settings.selection.resolve(model)
    assert ("lm_head" not in layers) is left_out
    warned = [r.getMessage() for r in caplog.records if "bypasses" in r.getMessage()]
    assert bool(warned) is left_out
    if left_out:
        assert "Liger's fused linear cross-entropy (use_liger_kernel) bypasses lm_head" in warned[0]


def test_a_fused_head_outside_the_selection_is_not_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A LoRA run under TRL's fused head (its most common use): the head has no adapter,
    so it is not among the captured layers, and nothing is said about leaving it out. A
    full fine-tuning run, whose head is captured, is still told."""
    from peft import LoraConfig, get_peft_model
    from trl import SFTConfig

    from tda_plugins.integrations.transformers.setup import adapt_settings
    from tda_plugins.session.settings import LayerSettings

    model = get_peft_model(tiny_causal_lm("llama", torch.float32), LoraConfig(r=2))
    args = training_args(tmp_path / "out", SFTConfig)
    with caplog.at_level("WARNING", logger="tda_plugins"):
        settings = adapt_settings(LayerSettings(), args, model)
    assert settings == LayerSettings()
    assert not [r for r in caplog.records if "bypasses" in r.getMessage()]
    with caplog.at_level("WARNING", logger="tda_plugins"):
        adapt_settings(LayerSettings(), args, tiny_causal_lm("llama", torch.float32))
    assert [r for r in caplog.records if "TRL's fused LM head bypasses" in r.getMessage()]


def fused_loss_forward(
    self: nn.Module, input_ids: Any = None, labels: Any = None, **kw: Any
) -> Any:
    """A causal LM forward that computes the logits from ``lm_head.weight`` directly, as a
    fused loss head does (Liger's, TRL's): ``lm_head`` is never called."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden = self.model(input_ids=input_ids, attention_mask=kw.get("attention_mask"))
    logits = torch.nn.functional.linear(hidden.last_hidden_state, self.lm_head.weight)
    if labels is None:
        return CausalLMOutputWithPast(logits=logits)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    )
    return CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize("callback", ["capture", "selection", "influence"])
def test_a_captured_layer_whose_weight_is_used_outside_its_call_stops_the_first_step(
    tmp_path: Path, callback: str
) -> None:
    """A fused loss head the setup checks do not know: ``lm_head`` captured, never called.
    Capture used to train the whole run into a store that could not be read, selection to
    fail with ``KeyError: 'lm_head'``, influence logging to leave the head out of its
    scores without a word. All three now stop in the first step, before the
    optimizer moves a weight, naming the layer and the way out."""
    import types

    from tda_plugins.integrations.transformers import (
        DataSelectionCallback,
        InfluenceLoggingCallback,
    )

    model = tiny_causal_lm("llama", torch.float32)
    model.forward = types.MethodType(fused_loss_forward, model)  # type: ignore[method-assign]
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    rows = [{"input_ids": r} for r in token_rows(4)]
    chosen: TrainerCallback = {
        "capture": lambda: GradientCaptureCallback(store_dir=str(tmp_path / "store")),
        "selection": lambda: DataSelectionCallback(rows[:1], layers="all"),
        "influence": lambda: InfluenceLoggingCallback(rows[:1], layers="linear"),
    }[callback]()
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path / "out"),
        train_dataset=Dataset.from_list(rows),
        data_collator=pad_rows,
        callbacks=[chosen],
    )
    with pytest.raises(Exception, match=r"layer 'lm_head' received no gradient .* step 1") as info:
        trainer.train()
    assert "LayerSelection(exclude=...)" in str(info.value)
    assert trainer.state.global_step == 0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in initial.items())
