"""A PEFT model loaded for inference (``PeftModel.from_pretrained`` without
``is_trainable=True``: every adapter frozen) captures and scores as its trainable twin
does; its adapters are frozen again afterwards."""

from __future__ import annotations

from pathlib import Path

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
