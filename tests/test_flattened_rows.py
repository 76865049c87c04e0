"""Layers called on the batch's tokens flattened to ``(B*T, N)`` rows (``capture/rows.py``).

OPT's MLP (``fc1``, ``fc2``) and the norm before it run on ``hidden_states.reshape(-1, H)``,
as an MoE's router and shared expert do: captured per example, they equal one backward per
unpadded example (fp64, right and left padding, full and PEFT LoRA models). A layer called
on flattened tokens in another order (sequence-first), or on a subset of them (an MoE
expert's routed tokens), is refused, naming the layer.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from torch import Tensor, nn

from tda_plugins import (
    CaptureEngine,
    LayerSelection,
    RecordCollector,
    causal_lm_example_losses,
    per_example_gradients,
)
from tda_plugins.capture.rows import UnsplittableRows
from tests.models import ATTENTION, VOCAB, lm_batch, tiny_causal_lm, with_lora
from tests.oracle import loop_oracle, max_rel_error

FP64_TOL = 1e-6
RIGHT_PAD = (10, 7, 5)
FLATTENED = ("fc1", "fc2", "final_layer_norm")


def tiny_opt() -> nn.Module:
    """A 2-layer OPT whose word embeddings (16 wide) are projected in and out of its 32-wide
    blocks (OPT-350m's layout), fp64, eval mode.

    The attention's key bias is frozen: its gradient is zero in exact arithmetic (it adds
    the same ``q . b`` to every score of a query, which the softmax ignores; OPT's positions
    are learned, not rotary), so a relative error there would measure only roundoff."""
    tiny_causal_lm("llama")  # registers the tiny models' attention with transformers
    config = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=16,
        pad_token_id=0,
        dropout=0.0,
        attention_dropout=0.0,
        attn_implementation=ATTENTION,
    )
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(config).double().eval()
    for name, p in model.named_parameters():
        if name.endswith("k_proj.bias"):
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("left_pad", [False, True], ids=["right-pad", "left-pad"])
@pytest.mark.parametrize("kind", ["linear", "all"])
def test_opt_matches_loop_oracle(kind: str, left_pad: bool) -> None:
    """Every captured layer, the flattened MLP and its norm among them, equals one backward
    per unpadded example."""
    model, batch = tiny_opt(), lm_batch(lengths=RIGHT_PAD, left_pad=left_pad)
    got = per_example_gradients(model, batch, layers=LayerSelection(kind=kind))
    flattened = [n for n in got if ".layers." in n and n.split(".")[-2] in FLATTENED]
    assert len(flattened) == (8 if kind == "linear" else 12)  # fc1/fc2 (+ norm) x 2 blocks
    assert max_rel_error(got, loop_oracle(model, batch, list(got))) <= FP64_TOL


def test_opt_lora_matches_loop_oracle() -> None:
    """LoRA adapters on the flattened MLP: their calls are flattened too."""
    model, batch = with_lora(tiny_opt()), lm_batch(lengths=RIGHT_PAD)
    got = per_example_gradients(model, batch)
    assert any(".fc1.lora_A." in n for n in got)
    assert max_rel_error(got, loop_oracle(model, batch, list(got))) <= FP64_TOL


def test_opt_positional_embedding_is_named_uncaptured(caplog: pytest.LogCaptureFixture) -> None:
    """OPT's learned positions (an ``nn.Embedding`` subclass with its own ``forward``, which
    computes the ids) have no adapter: layers='all' leaves them out, and the callbacks'
    warning names their class."""
    from tda_plugins.capture.layers import warn_uncaptured

    model = tiny_opt()
    with CaptureEngine(model, layers=LayerSelection(kind="all")) as engine:
        assert not any("embed_positions" in n for n in engine.layer_names)
        with caplog.at_level(logging.WARNING):
            warn_uncaptured(model, engine.captured_layers, "the store")
    assert "OPTLearnedPositionalEmbedding" in caplog.text


class _Reordered(nn.Module):
    """A toy causal LM whose output layer runs on the tokens flattened ``(B*T, N)`` in a
    given order: ``"sequence"`` (position by position, sequence-first) or ``"routed"`` (the
    first ``B*T - 1`` tokens, as an MoE expert gets a routed subset)."""

    def __init__(self, order: str):
        super().__init__()
        self.order = order
        self.embed = nn.Embedding(VOCAB, 8)
        self.proj = nn.Linear(8, VOCAB)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        b, t = input_ids.shape
        h = self.embed(input_ids)
        if self.order == "sequence":
            return self.proj(h.transpose(0, 1).reshape(t * b, -1)).reshape(t, b, -1).transpose(0, 1)
        rows = self.proj(h.reshape(b * t, -1)[:-1])
        return torch.cat([rows, rows[-1:]]).reshape(b, t, -1)


@pytest.mark.parametrize(
    "order, reason", [("sequence", "row-major"), ("routed", "neither one row per example")]
)
def test_tokens_in_another_order_or_a_subset_are_refused(order: str, reason: str) -> None:
    """Sequence-first rows (caught in the backward of a batch with padding: the gradient is
    not zero at the rows row-major order puts the padding at) and a routed subset (caught
    at the forward call) are refused, naming the layer, before any record is made."""
    model, collector = _Reordered(order).double(), RecordCollector()
    batch = lm_batch(lengths=RIGHT_PAD)
    engine = CaptureEngine(model, layers=LayerSelection(kind="linear"), consumers=[collector])
    with engine, pytest.raises(UnsplittableRows, match=reason) as info:
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        causal_lm_example_losses(logits, batch["labels"]).sum().backward()
    assert "'proj'" in str(info.value) and "exclude it" in str(info.value)
    assert not collector.records
