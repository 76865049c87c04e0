"""Dropout in training: the callbacks warn at the start of training that their gradients
are the dropped-out forward's (queries and targets are taken without it), naming what
drops out and the way out; a run without dropout gets no such warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import transformers
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import Trainer

from tda_plugins.integrations.transformers import (
    DataSelectionCallback,
    GradientCaptureCallback,
    InfluenceLoggingCallback,
)
from tda_plugins.session.dropout import active_dropout
from tests.models import VOCAB, tiny_causal_lm
from tests.trainers import pad_rows, token_rows, training_args


def lora(dropout: float) -> torch.nn.Module:
    model = tiny_causal_lm("llama", torch.float32)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=dropout)
    return get_peft_model(model, config)


def test_what_drops_out_is_found() -> None:
    """PEFT's lora_dropout modules, a model's own dropout modules (GPT-2's defaults) and a
    config's functional attention dropout (Llama) are found; none where every p is 0."""
    assert active_dropout(tiny_causal_lm("llama")) == []
    assert active_dropout(lora(0.0)) == []
    found = active_dropout(lora(0.1))
    assert len(found) == 4 and all("lora_dropout" in f and "(p=0.1)" in f for f in found)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2)
    )
    assert "transformer.drop (p=0.1)" in active_dropout(gpt2)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            attention_dropout=0.1,
        )
    )
    assert active_dropout(llama) == ["config.attention_dropout=0.1"]


CALLBACKS = {
    "influence": (
        lambda tmp: InfluenceLoggingCallback(
            queries=[{"input_ids": r} for r in token_rows(2, seed=9)],
            report_dir=str(tmp / "report"),
        ),
        "the logged influence scores",
    ),
    "capture": (
        lambda tmp: GradientCaptureCallback(store_dir=str(tmp / "store")),
        "the store and its scores",
    ),
    "selection": (
        lambda tmp: DataSelectionCallback([{"input_ids": r} for r in token_rows(2, seed=9)]),
        "the selection's scores",
    ),
}


@pytest.mark.parametrize("dropout", [0.1, 0.0])
@pytest.mark.parametrize("kind", CALLBACKS)
def test_callbacks_warn_of_dropout_at_the_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, dropout: float
) -> None:
    make, what = CALLBACKS[kind]
    trainer = Trainer(
        model=lora(dropout),
        args=training_args(tmp_path / "out", max_steps=1),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(2)]),
        data_collator=pad_rows,
        callbacks=[make(tmp_path)],
    )
    with caplog.at_level(logging.WARNING, logger="tda_plugins"):
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if "trains with dropout" in r.getMessage()]
    if dropout == 0:
        assert warned == []
        return
    assert len(warned) == 1
    assert "lora_dropout.default (p=0.1)" in warned[0] and "lora_dropout=0" in warned[0]
    assert f"{what} use the gradients" in warned[0]
