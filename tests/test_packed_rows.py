"""Batches that pack several sequences into one row are refused at their forward.

A padding-free collator's row is several examples; capturing it as one would store the
pack's summed gradient under the pack's id. The engine refuses it at the first forward,
before its backward (so before any optimizer step); a padded batch whose padding
positions carry odd ``position_ids`` (as generation code sets them) is one example a row
and is captured as usual.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DataCollatorWithFlattening

from tda_plugins import CaptureEngine, LayerSelection
from tda_plugins.store import GradientStore, StoreReader
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import summed_loss

LINEAR = LayerSelection("linear")


def flattened(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """transformers' padding-free collation of ``rows``: one row, restarting positions."""
    batch = DataCollatorWithFlattening()([{"input_ids": r} for r in rows])
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seq_lens_q"])
def test_a_packed_row_is_refused_before_its_backward(tmp_path: Path, boundaries: str) -> None:
    model = tiny_causal_lm("llama")
    batch = flattened([[5, 9, 14, 3], [7, 30, 12]])
    assert batch["input_ids"].shape[0] == 1  # the two examples share one row
    if boundaries == "cu_seq_lens_q":
        batch = {k: v for k, v in batch.items() if k != "position_ids"}
        batch["cu_seq_lens_q"] = torch.tensor([0, 4, 7], dtype=torch.int32)
        expected = "receives cu_seq_lens_q"
    else:
        expected = r"position_ids restart within row 0 \(at token 4: 3 -> 0\)"
    store = GradientStore(tmp_path / "store")
    with CaptureEngine(model, layers=LINEAR, consumers=[store]) as engine:
        with pytest.raises(ValueError, match=expected) as refused:
            summed_loss(model, batch)
        engine.end()
    assert "DataCollatorWithFlattening" in str(refused.value)  # the way out
    assert all(p.grad is None for p in model.parameters())
    assert StoreReader(tmp_path / "store").num_examples == 0


def test_positions_of_padding_are_not_read_as_a_restart(tmp_path: Path) -> None:
    """Left padding with generation-style ``position_ids`` (each pad at 1, the first real
    token at 0) is one example a row: captured, with the gradients of the same batch whose
    pads sit at 0."""
    model = tiny_causal_lm("llama", dtype=torch.float64)
    plain = lm_batch(3, 8, lengths=(8, 5, 3), left_pad=True, seed=4)
    odd = dict(
        plain, position_ids=plain["position_ids"].masked_fill(plain["attention_mask"] == 0, 1)
    )
    assert bool((odd["position_ids"][:, 1:] < odd["position_ids"][:, :-1]).any())
    grads = {}
    for name, batch in (("plain", plain), ("odd", odd)):
        with CaptureEngine(model, layers=LINEAR, consumers=[GradientStore(tmp_path / name)]) as e:
            summed_loss(model, batch).backward()
            model.zero_grad(set_to_none=True)
            e.optimizer_step()
            e.end()
        grads[name] = StoreReader(tmp_path / name).load_all()
    assert grads["odd"].example_ids.tolist() == grads["plain"].example_ids.tolist()
    for layer, g in grads["plain"].layers.items():
        torch.testing.assert_close(grads["odd"].layers[layer].materialize(), g.materialize())
