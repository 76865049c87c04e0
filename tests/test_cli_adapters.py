"""``tda capture`` on a PEFT adapter: the directory ``trainer.save_model`` writes, a trainer
``checkpoint-<n>`` folder, or ``--adapter`` beside the base model.

Oracle: a LoRA run trained at learning rate 0 leaves the weights as they were, so the
gradient of each training example captured from the saved adapter must equal the one the
training callback stored for it (same layers, same weights, same loss convention).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, Trainer

from tda_plugins import GradientCaptureCallback
from tda_plugins.store import StoreReader
from tests.models import tiny_causal_lm, with_lora
from tests.stores import rel_error
from tests.test_cli import assert_one_line_error, run_main
from tests.trainers import FP32_TOL, pad_rows, token_rows, training_args, word_tokenizer, words

ROWS = token_rows(4)


@dataclass
class LoraRun:
    base: Path
    adapter: Path
    checkpoint: Path
    store: Path
    queries: Path


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> LoraRun:
    """A base model saved to disk, a 2-step LoRA run of it at learning rate 0 with the
    capture callback, its adapter saved and its checkpoint at step 2."""
    tmp = tmp_path_factory.mktemp("adapters")
    base = tmp / "base"
    tiny_causal_lm("llama", torch.float32).save_pretrained(base)
    word_tokenizer().save_pretrained(base)
    model = with_lora(AutoModelForCausalLM.from_pretrained(base))
    trainer = Trainer(
        model=model,
        args=training_args(
            tmp / "out", learning_rate=0.0, max_steps=2, save_strategy="steps", save_steps=2
        ),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in ROWS]),
        data_collator=pad_rows,
        processing_class=word_tokenizer(),
        callbacks=[GradientCaptureCallback(store_dir=str(tmp / "store"), curvature=False)],
    )
    trainer.train()
    trainer.save_model(str(tmp / "adapter"))
    queries = tmp / "queries.jsonl"
    queries.write_text("".join(json.dumps({"text": words(r)}) + "\n" for r in ROWS))
    return LoraRun(base, tmp / "adapter", tmp / "out" / "checkpoint-2", tmp / "store", queries)


def _by_id(store: StoreReader) -> dict[int, dict[str, torch.Tensor]]:
    chunk = store.load_all()
    flat = {name: g.materialize() for name, g in chunk.layers.items()}
    return {
        i: {n: t[row] for n, t in flat.items()} for row, i in enumerate(chunk.example_ids.tolist())
    }


@pytest.mark.parametrize("source", ["adapter as --model", "checkpoint as --model", "--adapter"])
def test_an_adapter_captures_the_training_stores_layers_and_gradients(
    lora_run: LoraRun, tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str
) -> None:
    model_args = {
        "adapter as --model": ["--model", lora_run.adapter],
        "checkpoint as --model": ["--model", lora_run.checkpoint],
        "--adapter": ["--model", lora_run.base, "--adapter", lora_run.adapter],
    }[source]
    out = tmp_path / "queries"
    code, _, err = run_main(
        capsys, "capture", *model_args, "--data", lora_run.queries, "--out", out, "--no-curvature"
    )
    assert code == 0, err
    train, queries = StoreReader(lora_run.store), StoreReader(out)
    assert queries.layer_names == train.layer_names
    assert all("lora_" in name for name in queries.layer_names)
    stored, captured = _by_id(train), _by_id(queries)
    assert captured.keys() == stored.keys()  # the same texts, the same content-hash ids
    for example_id, layers in captured.items():
        for name, grad in layers.items():
            assert rel_error(grad, stored[example_id][name]) <= FP32_TOL, (example_id, name)
    code, _, err = run_main(
        capsys,
        "attribute",
        *("--store", lora_run.store, "--queries", out, "--method", "graddot"),
        *("--out", tmp_path / "scores"),
    )
    assert code == 0, err  # the same model: the fingerprints agree


def test_adapter_errors_name_the_way_out(
    lora_run: LoraRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--data", lora_run.queries, "--out", tmp_path / "q"]
    code, _, err = run_main(
        capsys, "capture", "--model", lora_run.base, "--adapter", lora_run.base, *common
    )
    assert_one_line_error(code, err, "capture", "holds no PEFT adapter")
    code, _, err = run_main(
        capsys, "capture", "--model", lora_run.adapter, "--adapter", lora_run.adapter, *common
    )
    assert_one_line_error(code, err, "capture", "is an adapter too")
    remote = tmp_path / "remote-adapter"
    remote.mkdir()
    config = json.loads((lora_run.adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "some-org/some-model"
    (remote / "adapter_config.json").write_text(json.dumps(config))
    code, _, err = run_main(capsys, "capture", "--model", remote, *common)
    assert_one_line_error(code, err, "capture", "not a local model directory", "--adapter")


def test_a_named_adapter_is_loaded_under_the_name_its_store_holds(
    lora_run: LoraRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that named its adapter (``get_peft_model(..., adapter_name="sft")``) stores
    ``lora_A.sft`` layers, and PEFT saves it in ``<dir>/sft``; loaded again it is named
    ``default`` unless told. ``tda capture --like`` loads it under the store's name (the
    same layers and gradients); the Python call, given the ``default``-named model, is
    refused naming both names and the way to load it."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from tda_plugins import capture_examples

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(lora_run.base),
        LoraConfig(r=4, target_modules=["q_proj"]),
        adapter_name="sft",
    )
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path / "out", learning_rate=0.0, max_steps=1),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in ROWS[:2]]),
        data_collator=pad_rows,
        processing_class=word_tokenizer(),
        callbacks=[GradientCaptureCallback(store_dir=str(tmp_path / "store"), curvature=False)],
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    train = StoreReader(tmp_path / "store")
    assert all(name.endswith(".sft") for name in train.layer_names)
    out = tmp_path / "queries"
    data = ["--data", lora_run.queries, "--out", out, "--like", tmp_path / "store"]
    code, _, err = run_main(capsys, "capture", "--model", tmp_path / "adapter" / "sft", *data)
    assert code == 0, err
    queries = StoreReader(out)
    assert queries.layer_names == train.layer_names
    stored, captured = _by_id(train), _by_id(queries)
    for example_id, layers in stored.items():  # the training rows are among the queries
        for name, grad in layers.items():
            assert rel_error(captured[example_id][name], grad) <= FP32_TOL, (example_id, name)
    default = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(lora_run.base),
        tmp_path / "adapter" / "sft",
        is_trainable=True,
    )
    with pytest.raises(ValueError, match="adapter 'sft', the model those of \\['default'\\]"):
        capture_examples(
            default,
            lora_run.queries,
            tmp_path / "refused",
            tokenizer=word_tokenizer(),
            like=tmp_path / "store",
            progress=False,
        )
    plain = tmp_path / "plain"
    code, _, err = run_main(
        capsys,
        "capture",
        "--model",
        tmp_path / "adapter" / "sft",
        *("--data", lora_run.queries, "--out", plain, "--no-curvature"),
    )
    assert code == 0, err  # loaded as 'default': its layers are lora_A.default
    code, _, err = run_main(
        capsys,
        "attribute",
        *("--store", tmp_path / "store", "--queries", plain, "--method", "graddot"),
        *("--out", tmp_path / "scores"),
    )
    assert_one_line_error(code, err, "attribute", "adapter is named 'sft'", "--like STORE")


def test_queries_on_another_base_or_in_another_dtype_are_refused_naming_it(
    lora_run: LoraRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The adapter's weights alone do not fix its gradients: the same adapter on another
    base model of the same config (other frozen weights) computes other ones, and was
    accepted. It is refused, naming the base; queries of the right model in another dtype
    are refused naming the dtypes and the option; the right base in the store's dtype is
    accepted."""
    other = tmp_path / "other-base"
    tiny_causal_lm("llama", torch.float32, seed=1).save_pretrained(other)
    word_tokenizer().save_pretrained(other)
    like = ["--data", lora_run.queries, "--like", lora_run.store]
    cases = {
        "other base": (["--model", other, "--adapter", lora_run.adapter], "another base model"),
        "float64": (
            ["--model", lora_run.adapter, "--dtype", "float64"],
            "the queries' weights are float64, the store's float32",
        ),
        "right": (["--model", lora_run.adapter], None),
    }
    for name, (model, refusal) in cases.items():
        out = tmp_path / f"q-{name.replace(' ', '-')}"
        code, _, err = run_main(capsys, "capture", *model, *like, "--out", out)
        assert code == 0, err
        attribute = ["--store", lora_run.store, "--queries", out, "--method", "graddot"]
        code, _, err = run_main(capsys, "attribute", *attribute, "--out", tmp_path / f"s-{name}")
        if refusal is None:
            assert code == 0, err
        else:
            assert_one_line_error(code, err, "attribute", refusal)
