"""Layers called on the batch's tokens flattened to ``(B*T, N)`` rows (``capture/rows.py``).

OPT's MLP (``fc1``, ``fc2``) and the norm before it run on ``hidden_states.reshape(-1, H)``,
as an MoE's router and shared expert do: captured per example, they equal one backward per
unpadded example (fp64, right and left padding, full and PEFT LoRA models), and so do its
learned positions (``OffsetPositionAdapter``). A layer called
on flattened tokens in another order (sequence-first), or on a subset of them (an MoE
expert's routed tokens), is refused, naming the layer.
"""

from __future__ import annotations

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
from tda_plugins.capture.rows import EVERY, FIRST, UnsplittableRows
from tda_plugins.session.batch import canonical_grads
from tests.models import ATTENTION, VOCAB, lm_batch, tiny_causal_lm, with_lora
from tests.oracle import loop_oracle, max_rel_error

FP64_TOL = 1e-6
RIGHT_PAD = (10, 7, 5)
FLATTENED = ("fc1", "fc2", "final_layer_norm")


def _tiny(config_name: str, model_name: str, **options: object) -> nn.Module:
    """A 2-layer, 32-wide causal LM of that transformers config and class, fp64, eval mode.

    The attention's key bias is frozen: its gradient is zero in exact arithmetic (it adds
    the same ``q . b`` to every score of a query, which the softmax ignores; these models'
    positions are learned, not rotary), so a relative error there would measure only
    roundoff."""
    tiny_causal_lm("llama")  # registers the tiny models' attention with transformers
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        attn_implementation=ATTENTION,
        **options,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).double().eval()
    for name, p in model.named_parameters():
        if name.endswith("k_proj.bias"):
            p.requires_grad_(False)
    return model


def tiny_opt() -> nn.Module:
    """OPT, its word embeddings (16 wide) projected in and out of its blocks (OPT-350m's
    layout)."""
    return _tiny(
        "OPTConfig",
        "OPTForCausalLM",
        ffn_dim=48,
        word_embed_proj_dim=16,
        dropout=0.0,
        attention_dropout=0.0,
    )


@pytest.mark.parametrize("left_pad", [False, True], ids=["right-pad", "left-pad"])
@pytest.mark.parametrize("kind", ["linear", "all"])
def test_opt_matches_loop_oracle(kind: str, left_pad: bool) -> None:
    """Every captured layer, the flattened MLP and its norm among them, equals one backward
    per unpadded example."""
    model, batch = tiny_opt(), lm_batch(lengths=RIGHT_PAD, left_pad=left_pad)
    got = per_example_gradients(model, batch, layers=LayerSelection(kind=kind))
    flattened = [n for n in got if ".layers." in n and n.split(".")[-2] in FLATTENED]
    assert len(flattened) == (8 if kind == "linear" else 12)  # fc1/fc2 (+ norm) x 2 blocks
    assert ("model.decoder.embed_positions.weight" in got) == (kind == "all")
    assert max_rel_error(got, loop_oracle(model, batch, list(got))) <= FP64_TOL


def test_opt_lora_matches_loop_oracle() -> None:
    """LoRA adapters on the flattened MLP: their calls are flattened too."""
    model, batch = with_lora(tiny_opt()), lm_batch(lengths=RIGHT_PAD)
    got = per_example_gradients(model, batch)
    assert any(".fc1.lora_A." in n for n in got)
    assert max_rel_error(got, loop_oracle(model, batch, list(got))) <= FP64_TOL


def test_opt_positions_given_by_the_caller_match_loop_oracle() -> None:
    """OPT's learned positions (looked up at ``position_ids + 2``) under layers='all': with
    ``position_ids`` passed by the caller (here each example's counted from 3), the ids
    captured are those, not the ones the attention mask would count."""
    model, batch = tiny_opt(), lm_batch(lengths=RIGHT_PAD)
    positions = batch["attention_mask"].cumsum(dim=1) + 2
    got = per_example_gradients(
        model, {**batch, "position_ids": positions}, layers=LayerSelection(kind="all")
    )
    assert "model.decoder.embed_positions.weight" in got
    params = dict(model.named_parameters())
    want: dict[str, list[Tensor]] = {n: [] for n in got}
    for row, keep in enumerate(batch["attention_mask"].bool()):
        ids, labels = batch["input_ids"][row][keep][None], batch["labels"][row][keep][None]
        logits = model(input_ids=ids, position_ids=positions[row][keep][None]).logits
        loss = causal_lm_example_losses(logits, labels).sum()
        for n, g in zip(got, torch.autograd.grad(loss, [params[n] for n in got]), strict=True):
            want[n].append(g)
    assert max_rel_error(got, {n: torch.stack(v) for n, v in want.items()}) <= FP64_TOL


def row_oracle(model: nn.Module, batch: dict[str, Tensor], names: list[str]) -> dict[str, Tensor]:
    """Each row of ``batch`` alone, padded as it is there: its summed next-token loss's
    gradient (a padded position that predicts a real token counts, as in the batch)."""
    params = dict(model.named_parameters())
    out: dict[str, list[Tensor]] = {n: [] for n in names}
    for row in range(batch["input_ids"].shape[0]):
        inputs = {k: v[row : row + 1] for k, v in batch.items()}
        loss = causal_lm_example_losses(model(**inputs).logits, inputs["labels"]).sum()
        for n, g in zip(names, torch.autograd.grad(loss, [params[n] for n in names]), strict=True):
            out[n].append(g[0] if g.dim() > params[n].dim() else g)
    return {n: torch.stack(v) for n, v in out.items()}


@pytest.mark.parametrize("labels_seen", [False, True], ids=["loss-outside", "labels-in-forward"])
def test_padded_positions_the_loss_reaches_are_not_refused(labels_seen: bool) -> None:
    """Left padding with labels masked at the padding only (a left-padding collator's): the
    last padded position predicts the first real token, so the loss reaches it and its
    gradient is not zero; the order check leaves it out (by its target where the forward
    sees the labels, else as padding followed by a real token) and the rows match each
    row's own backward."""
    model, batch = tiny_opt(), lm_batch(lengths=RIGHT_PAD, left_pad=True)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    collector = RecordCollector()
    with CaptureEngine(model, consumers=[collector]) as engine:
        inputs = batch if labels_seen else {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits
        causal_lm_example_losses(logits, batch["labels"]).sum().backward()
        engine.flush()
    got = canonical_grads(model, collector.records[0])
    assert max_rel_error(got, row_oracle(model, batch, list(got))) <= FP64_TOL


class _Reordered(nn.Module):
    """A toy causal LM whose output layer ``proj`` runs on the batch's ``(B, T, 8)``
    hidden states, then, for ``order``, once more on rows that are not the examples':
    ``"sequence"`` the tokens flattened position by position (sequence-first); ``"routed"``
    the first ``B*T - 1`` tokens; ``"routed-B"`` the first ``B`` (a routed subset whose
    count is the batch's); ``"one-row"`` one token; ``"images"`` the forward's
    ``(B, 3, 8)`` ``pixel_values`` (a vision tower's images and patches, ``B`` images by
    chance). From micro-batch ``permute_from`` on,
    ``"slot-order"`` gives it every token in reverse (an expert given every token, in
    routing-slot order)."""

    def __init__(self, order: str, permute_from: int = 0):
        super().__init__()
        self.order, self.permute_from, self.calls = order, permute_from, 0
        self.embed = nn.Embedding(VOCAB, 8)
        self.proj = nn.Linear(8, VOCAB)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        pixel_values: Tensor | None = None,
    ) -> Tensor:
        b, t = input_ids.shape
        h = self.embed(input_ids)
        self.calls += 1
        if self.order == "sequence":
            return self.proj(h.transpose(0, 1).reshape(t * b, -1)).reshape(t, b, -1).transpose(0, 1)
        if self.order == "slot-order":
            order = torch.arange(b * t)
            if self.calls > self.permute_from:
                order = order.flip(0)
            rows = self.proj(h.reshape(b * t, -1)[order])
            return rows[order.argsort()].reshape(b, t, -1)
        odd = {
            "routed": lambda: h.reshape(b * t, -1)[:-1],
            "routed-B": lambda: h.reshape(b * t, -1)[:b],
            "one-row": lambda: h.reshape(b * t, -1)[:1],
            "images": lambda: pixel_values,
        }[self.order]()
        return self.proj(h) + 0 * self.proj(odd).sum()


@pytest.mark.parametrize(
    "order, reason",
    [
        ("sequence", "neither one row per example"),
        ("routed", "neither one row per example"),
        ("routed-B", "neither one row per example"),
        ("one-row", "neither one row per example"),
        ("images", "neither one row per example"),
    ],
)
def test_rows_that_are_not_the_examples_are_refused(order: str, reason: str) -> None:
    """Rows that are not the examples are refused at the call, naming the layer, whatever
    their count, before any record is made: ``B*T`` rows of a layer no declared module
    calls on row-major tokens (here sequence-first), a routed subset, ``B`` rows of a 2-D
    input where the batch has tokens, one row of a 2-D call, and, in a forward with
    images, ``B`` rows of another length than the tokens'."""
    model, collector = _Reordered(order).double(), RecordCollector()
    batch = lm_batch(lengths=RIGHT_PAD)
    images = (
        {"pixel_values": torch.randn(3, 3, 8, dtype=torch.float64)} if order == "images" else {}
    )
    engine = CaptureEngine(model, layers=LayerSelection(kind="linear"), consumers=[collector])
    with engine, pytest.raises(UnsplittableRows, match=reason) as info:
        engine.set_example_ids(torch.arange(3))
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], **images)
        causal_lm_example_losses(logits, batch["labels"]).sum().backward()
    assert "'proj'" in str(info.value) and "exclude it" in str(info.value)
    assert not collector.records


@pytest.fixture
def declared_row_major(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy model declared a module that calls its layers on row-major tokens."""
    from tda_plugins.capture import rows

    owners = {*rows.ROW_MAJOR_OWNERS, f"{_Reordered.__module__}.{_Reordered.__qualname__}"}
    monkeypatch.setattr(rows, "ROW_MAJOR_OWNERS", owners)


@pytest.mark.usefixtures("declared_row_major")
def test_a_declared_owner_whose_rows_are_not_row_major_is_caught_at_a_padded_batch() -> None:
    """Declared, but sequence-first: the gradient is not zero at the rows row-major order
    puts the padding at, and the layer is refused in the backward, naming it."""
    model, batch = _Reordered("sequence").double(), lm_batch(lengths=RIGHT_PAD)
    with CaptureEngine(model), pytest.raises(UnsplittableRows, match="row-major order puts"):
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        causal_lm_example_losses(logits, batch["labels"]).sum().backward()


@pytest.mark.usefixtures("declared_row_major")
def test_the_order_is_checked_again_every_sixteenth_micro_batch() -> None:
    """A layer whose rows come out of order only from micro-batch 5 on (its first 4 padded
    micro-batches checked and in order) is refused at micro-batch 16, the next sampled
    check: an MoE expert's token order depends on the data."""
    model = _Reordered("slot-order", permute_from=FIRST).double()
    batch = lm_batch(lengths=RIGHT_PAD)
    engine = CaptureEngine(model, layers=LayerSelection(kind="linear"))
    with engine, pytest.raises(UnsplittableRows, match="row-major order puts"):
        for _ in range(2 * EVERY):
            logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
            causal_lm_example_losses(logits, batch["labels"]).sum().backward()
    assert model.calls == EVERY + 1  # micro-batch 16, 0-based


@pytest.mark.parametrize("left_pad", [False, True], ids=["right-pad", "left-pad"])
def test_biogpt_every_layer_matches_loop_oracle(left_pad: bool) -> None:
    """BioGPT's learned positions (OPT's rule) and scaled word embedding, under
    layers='all', equal one backward per unpadded example."""
    model = _tiny(
        "BioGptConfig",
        "BioGptForCausalLM",
        intermediate_size=48,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        layerdrop=0.0,
    )
    batch = lm_batch(lengths=RIGHT_PAD, left_pad=left_pad)
    got = per_example_gradients(model, batch, layers=LayerSelection(kind="all"))
    assert {"biogpt.embed_positions.weight", "biogpt.embed_tokens.weight"} <= set(got)
    assert max_rel_error(got, loop_oracle(model, batch, list(got))) <= FP64_TOL


def test_a_forward_with_images_and_no_ids_is_refused() -> None:
    """A content hash of the tokens would name two examples of one text and other images
    alike: a forward carrying images needs explicit ids."""
    model, batch = _Reordered("images").double(), lm_batch(lengths=RIGHT_PAD)
    images = torch.randn(3, 3, 8, dtype=torch.float64)
    with CaptureEngine(model), pytest.raises(ValueError, match="give each example an id"):
        model(batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=images)


@pytest.mark.parametrize("left_pad", [False, True], ids=["right-pad", "left-pad"])
def test_qwen2_moe_shared_expert_matches_loop_oracle(left_pad: bool) -> None:
    """Qwen2-MoE's sparse block calls its shared expert and the expert's gate on the
    batch's tokens flattened row-major (its routed experts are fused weights, left out and
    warned of): every captured linear layer equals one backward per unpadded example."""
    model = _tiny(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_key_value_heads=2,
    ).float()  # the fused experts' grouped products take no fp64
    batch = lm_batch(lengths=RIGHT_PAD, left_pad=left_pad)
    got = per_example_gradients(model, batch, layers=LayerSelection(kind="linear"))
    assert any(".shared_expert_gate." in n for n in got)
    assert any(".shared_expert.down_proj." in n for n in got)
    assert max_rel_error(got, loop_oracle(model, batch, list(got))) <= 1e-4  # fp32 rounding
