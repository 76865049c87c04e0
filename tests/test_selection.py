"""Layer selectors: each filter keeps what it promises; bad selections fail with a fix."""

from __future__ import annotations

import pytest
import torch

from tda_plugins import CaptureEngine, LayerSelection, LayerSelectionError
from tda_plugins.data_selection.target import _token_rows
from tests.models import tiny_causal_lm, with_lora


def _names(selection: LayerSelection, model: torch.nn.Module) -> list[str]:
    return list(selection.resolve(model))


def test_linear_kind_takes_every_trainable_linear() -> None:
    model = tiny_causal_lm("llama")
    expected = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert _names(LayerSelection("linear"), model) == expected
    assert "lm_head" in expected


def test_linear_kind_leaves_out_a_head_tied_to_the_embedding() -> None:
    model = tiny_causal_lm("gpt2")  # lm_head.weight is transformer.wte.weight
    names = _names(LayerSelection("linear"), model)
    assert "lm_head" not in names and "transformer.h.0.attn.c_attn" in names
    assert {"lm_head", "transformer.wte"} <= set(_names(LayerSelection("all"), model))


def test_including_a_tied_head_alone_is_an_error() -> None:
    with pytest.raises(LayerSelectionError, match=r"shares a parameter with.*wte"):
        LayerSelection("linear", include="lm_head").resolve(tiny_causal_lm("gpt2"))


def test_auto_is_lora_on_peft_models_and_linear_otherwise() -> None:
    lora = with_lora(tiny_causal_lm("llama"))
    names = _names(LayerSelection(), lora)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert _names(LayerSelection(), tiny_causal_lm("llama")) == _names(
        LayerSelection("linear"), tiny_causal_lm("llama")
    )


def test_lora_kind_on_a_plain_model_names_the_fix() -> None:
    with pytest.raises(LayerSelectionError, match="get_peft_model"):
        LayerSelection("lora").resolve(tiny_causal_lm("llama"))


def test_last_n_blocks_keeps_only_those_blocks() -> None:
    names = _names(LayerSelection("linear", last_n_blocks=1), tiny_causal_lm("llama"))
    assert names and all(n.startswith("model.layers.1.") for n in names)


def test_include_and_exclude_regexes() -> None:
    model = tiny_causal_lm("llama")
    names = _names(LayerSelection("linear", include=r"mlp", exclude=r"down_proj"), model)
    assert names and all("mlp" in n and "down_proj" not in n for n in names)


def test_types_filter_by_class_name_and_class() -> None:
    model = tiny_causal_lm("llama")
    by_name = _names(LayerSelection("all", types=("LlamaRMSNorm",)), model)
    assert by_name and all(n.endswith("norm") for n in by_name)
    by_class = _names(LayerSelection("all", types=(torch.nn.Embedding,)), model)
    assert by_class == ["model.embed_tokens"]


def test_frozen_layers_are_not_candidates() -> None:
    model = tiny_causal_lm("llama")
    model.model.layers[0].requires_grad_(False)
    names = _names(LayerSelection("linear"), model)
    assert names and not any(n.startswith("model.layers.0.") for n in names)


def test_no_match_names_the_filter_and_the_candidates() -> None:
    with pytest.raises(LayerSelectionError, match=r"matched no layer.*supported layers there"):
        LayerSelection("linear", include="nothing-like-this").resolve(tiny_causal_lm("llama"))


def test_bad_kind_and_block_count_are_refused() -> None:
    model = tiny_causal_lm("llama")
    with pytest.raises(LayerSelectionError, match="kind must be"):
        LayerSelection("conv").resolve(model)  # type: ignore[arg-type]
    with pytest.raises(LayerSelectionError, match="last_n_blocks must be >= 1"):
        LayerSelection(last_n_blocks=0).resolve(model)


def test_engine_attach_raises_before_any_hook_on_a_bad_selection() -> None:
    model = tiny_causal_lm("llama")
    engine = CaptureEngine(model, layers=LayerSelection("linear", include="nothing"))
    with pytest.raises(LayerSelectionError):
        engine.attach()
    assert not engine.attached


def test_non_module_is_refused() -> None:
    with pytest.raises(TypeError, match=r"needs an nn\.Module"):
        CaptureEngine("model")  # type: ignore[arg-type]


def test_target_token_rows_of_one_chunk_are_a_view() -> None:
    """The target's token factors of a one-chunk target view the captured tensors (no
    copy); several chunks are concatenated in order."""
    first, second = torch.randn(1, 4, 3), torch.randn(2, 4, 3)
    rows = _token_rows([first])
    assert rows.shape == (4, 3) and rows.data_ptr() == first.data_ptr()
    both = _token_rows([first, second])
    assert torch.equal(both, torch.cat([first.reshape(4, 3), second.reshape(8, 3)]))
