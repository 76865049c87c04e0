"""What a store's fingerprint tells about a quantized base (QLoRA): a difference in the
base's quantization names the way out, and a quantized base's packed integer weights are
hashed but not reported as a dtype to capture queries in."""

from __future__ import annotations

import torch
from torch import nn

from tda_plugins.store.fingerprint import (
    fingerprint_differences,
    model_fingerprint,
    weights_differences,
    weights_digest,
)
from tests.models import tiny_causal_lm, with_lora


def test_a_quantized_base_against_an_unquantized_one_names_the_way_out() -> None:
    trained, queried = tiny_causal_lm("llama", torch.float32), tiny_causal_lm("llama")
    trained.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    differences = fingerprint_differences(model_fingerprint(trained), model_fingerprint(queried))
    assert differences[0].startswith("model config quantization_config=")
    assert "--model QUANTIZED_BASE --adapter ADAPTER" in differences[1]
    assert fingerprint_differences(model_fingerprint(queried), model_fingerprint(queried)) == []


def packed(model: nn.Module) -> nn.Module:
    """``model`` with each LoRA base layer's weight replaced by uint8 codes of its shape
    (as bitsandbytes packs a quantized weight)."""
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if isinstance(base, nn.Linear):
            codes = torch.randint(0, 255, base.weight.shape, dtype=torch.uint8)
            base.weight = nn.Parameter(codes, requires_grad=False)
    return model


def test_packed_base_weights_are_hashed_but_no_dtype_of_the_queries() -> None:
    """A LoRA store on a packed base: its dtypes are the adapters' (float32) alone, so
    fp32 queries of the same adapters on the unquantized base are refused as another base
    model, not told to capture in the float32 they already use."""
    model = with_lora(tiny_causal_lm("llama", torch.float32))
    layers = [
        n for n, _ in model.named_modules() if n.endswith(("lora_A.default", "lora_B.default"))
    ]
    unquantized = weights_digest(model, layers)
    quantized = weights_digest(packed(model), layers)
    assert quantized.dtypes == unquantized.dtypes == ("float32",)
    assert quantized.whole == unquantized.whole and quantized.base != unquantized.base
    reasons = weights_differences(quantized, unquantized)
    assert len(reasons) == 1 and "another base model" in reasons[0]
