"""Activation checkpointing through torch's ``checkpoint_wrapper`` does not rename layers.

OLMo-core's ``ac_config`` and FSDP activation checkpointing through accelerate wrap each
block in a ``CheckpointWrapper``, so that ``named_modules()`` puts
``_checkpoint_wrapped_module`` in every name inside it. A store captured from such a run
must name its layers as the same model without the wrappers does (the model as saved,
loaded again to capture the queries), so that the two stores score against each other.
The oracle is the unwrapped model: the same layer names, the same gradients.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)

from tda_plugins import attribute, capture_examples, per_example_gradients
from tda_plugins.capture import LayerSelection
from tda_plugins.capture.names import canonical_name
from tda_plugins.store import StoreReader
from tests.models import lm_batch, tiny_causal_lm
from tests.trainers import token_rows


def wrapped_blocks(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every decoder block in a (non-reentrant) checkpoint wrapper
    and no KV cache (a block recomputed in the backward would append to it again, which is
    why transformers' own gradient checkpointing turns it off too)."""
    wrapped = copy.deepcopy(model)
    wrapped.config.use_cache = False
    blocks = wrapped.model.layers
    apply_activation_checkpointing(wrapped, check_fn=lambda m: any(m is b for b in blocks))
    names = [n for n, _ in wrapped.named_modules()]
    assert any("_checkpoint_wrapped_module" in n for n in names), "nothing was wrapped"
    return wrapped


@pytest.fixture
def models() -> tuple[nn.Module, nn.Module]:
    plain = tiny_causal_lm("llama")
    return plain, wrapped_blocks(plain)


def test_canonical_name_drops_only_wrapper_segments() -> None:
    assert canonical_name("blocks.0._checkpoint_wrapped_module.attention.w_q") == (
        "blocks.0.attention.w_q"
    )
    assert canonical_name("model.layers.1.mlp.up_proj") == "model.layers.1.mlp.up_proj"


@pytest.mark.parametrize("kind", ["linear", "all"])
def test_wrapped_layers_have_the_plain_models_names(
    models: tuple[nn.Module, nn.Module], kind: str
) -> None:
    plain, wrapped = models
    selection = LayerSelection(kind=kind)  # type: ignore[arg-type]
    assert list(selection.resolve(wrapped)) == list(selection.resolve(plain))
    blocks = LayerSelection(kind=kind, last_n_blocks=1)  # type: ignore[arg-type]
    assert list(blocks.resolve(wrapped)) == list(blocks.resolve(plain))


def test_a_wrapped_store_scores_against_queries_of_the_plain_model(
    models: tuple[nn.Module, nn.Module], tmp_path: Path
) -> None:
    plain, wrapped = models
    rows = [{"input_ids": r} for r in token_rows(6)]
    train = capture_examples(wrapped, rows, tmp_path / "train", layers="all", progress=False)
    queries = capture_examples(plain, rows[:3], tmp_path / "q", layers="all", progress=False)
    reference = capture_examples(plain, rows, tmp_path / "ref", layers="all", progress=False)
    assert train.layer_names == reference.layer_names
    got, expected = train.load_all(), reference.load_all()
    for name in reference.layer_names:
        torch.testing.assert_close(
            got.layers[name].materialize(), expected.layers[name].materialize()
        )
    scores = attribute(train, queries, "graddot")  # the weight digests agree layer by layer
    oracle = attribute(StoreReader(tmp_path / "ref"), queries, "graddot")
    torch.testing.assert_close(scores.values, oracle.values)


def test_per_example_gradients_of_a_wrapped_model_keep_its_parameter_names(
    models: tuple[nn.Module, nn.Module],
) -> None:
    plain, wrapped = models
    batch = lm_batch(lengths=(10, 7, 4))
    got = per_example_gradients(wrapped, batch, layers=LayerSelection(kind="linear"))
    expected = per_example_gradients(plain, batch, layers=LayerSelection(kind="linear"))
    assert {canonical_name(n) for n in got} == set(expected)
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[canonical_name(name)])
