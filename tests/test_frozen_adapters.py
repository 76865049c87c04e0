"""A PEFT model loaded for inference (``PeftModel.from_pretrained`` without
``is_trainable=True``: every adapter frozen) captures and scores as its trainable twin
does; its adapters are frozen again afterwards."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from tda_plugins import capture_examples, score_examples
from tests.models import tiny_causal_lm, with_lora
from tests.trainers import token_rows

ROWS = [{"input_ids": r} for r in token_rows(4)]


def _loaded(adapter: Path, trainable: bool) -> torch.nn.Module:
    return PeftModel.from_pretrained(tiny_causal_lm("llama"), adapter, is_trainable=trainable)


def _adapter_grads(store: Path) -> torch.Tensor:
    from tda_plugins.store import StoreReader

    reader = StoreReader(store)
    chunk = reader.load_all()
    return torch.cat([chunk.layers[n].materialize() for n in reader.layer_names], dim=1)


def test_a_frozen_adapter_is_captured_like_its_trainable_twin(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    with_lora(tiny_causal_lm("llama")).save_pretrained(adapter)
    options = {"batch_size": 2, "progress": False, "curvature": False}
    trained = capture_examples(_loaded(adapter, True), ROWS, tmp_path / "trained", **options)
    frozen_model = _loaded(adapter, False)
    assert not any(p.requires_grad for p in frozen_model.parameters())
    like = {"like": trained, **options}
    capture_examples(frozen_model, ROWS, tmp_path / "frozen", **like)
    torch.testing.assert_close(_adapter_grads(tmp_path / "frozen"), _adapter_grads(trained.root))
    scores = score_examples(frozen_model, ROWS, ROWS[:1], progress=False)
    twin = score_examples(_loaded(adapter, True), ROWS, ROWS[:1], progress=False)
    torch.testing.assert_close(scores.values, twin.values)
    assert not any(p.requires_grad for p in frozen_model.parameters())


def _saved_head_adapter(folder: Path) -> Path:
    """A LoRA adapter whose run also trained a copy of ``lm_head`` (``modules_to_save``)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    model = get_peft_model(tiny_causal_lm("llama"), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def test_a_frozen_adapters_saved_module_copy_trains_again_for_the_capture(
    tmp_path: Path,
) -> None:
    """The ``modules_to_save`` copy trained beside the adapters: loaded for inference, it
    takes gradients for the capture as the adapters do (``layers="all"`` then scores it
    as the trainable twin does), and is frozen again afterwards."""
    adapter = _saved_head_adapter(tmp_path / "adapter")
    frozen_model = _loaded(adapter, False)
    options = {"layers": "all", "progress": False}
    scores = score_examples(frozen_model, ROWS, ROWS[:1], **options)
    twin_model = _loaded(adapter, True)
    assert any(p.requires_grad for n, p in twin_model.named_parameters() if "lm_head" in n)
    twin = score_examples(twin_model, ROWS, ROWS[:1], **options)
    torch.testing.assert_close(scores.values, twin.values)
    assert not any(p.requires_grad for p in frozen_model.parameters())


def test_trainable_parameters_the_capture_leaves_out_are_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The default layers of a LoRA model are its adapters; a trained ``lm_head`` copy
    beside them is then left out of the scores and the store, which each name it (as the
    training callbacks do) rather than drop it without a word."""
    model = _loaded(_saved_head_adapter(tmp_path / "adapter"), True)
    head = "base_model.model.lm_head.modules_to_save.default.weight"
    with caplog.at_level(logging.WARNING, logger="tda_plugins"):
        score_examples(model, ROWS, ROWS[:1], progress=False)
    assert f"not captured ({head}), so the scores leave" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tda_plugins"):
        capture_examples(model, ROWS, tmp_path / "store", progress=False, curvature=False)
    assert f"not captured ({head}), so the store's rows leave" in caplog.text
