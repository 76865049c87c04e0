"""The capture engine is exact on real transformers architectures.

Every test builds tiny GPT-2 (HF ``Conv1D``), Llama, Qwen2 or OLMo-2 models from configs
(``tests.models``) and compares the engine's per-example gradients with a reference that
never touches the engine (``tests.oracle``, or a ``torch.func`` oracle written here): one
backward per unpadded example, or ``vmap`` over ``grad``. Covered: layer selection on
full and PEFT LoRA models, right and left padding, fp32 and bf16 capture, gradient
accumulation with the trainer's mean loss, both kinds of gradient checkpointing, modules
called twice in one forward, and frozen parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from transformers.modeling_layers import GradientCheckpointingLayer

from tda_plugins import (
    CaptureEngine,
    LayerSelection,
    MicroBatchRecord,
    RecordCollector,
    causal_lm_example_losses,
    per_example_gradients,
)
from tda_plugins.session.batch import canonical_grads
from tests.models import ARCHS, lm_batch, tiny_causal_lm, with_lora
from tests.oracle import func_oracle, loop_oracle, max_rel_error

FP64_TOL = 1e-6
FP32_TOL = 1e-4
# bf16 keeps 8 significant bits (unit roundoff 2**-8 ~ 4e-3), and every matmul, softmax
# and norm of the forward and backward rounds again: an ordinary bf16 autograd backward
# of these models is itself 0.6-1.7e-2 away from the fp64 gradient of the same weights.
# 5e-2 leaves headroom for that, while a capture error (a token paired with the wrong
# output gradient, a dropped or misassigned example, a missing scale) is of order 1.
BF16_TOL = 5e-2
RIGHT_PAD = (10, 7, 5)
ALL = LayerSelection(kind="all")
SELECTIONS = {"all": ALL, "default": None}


# -- what a selection promises -----------------------------------------------------------


def is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` or transformers' ``Conv1D`` (GPT-2)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def used_trainable_names(model: nn.Module, batch: Mapping[str, Tensor]) -> set[str]:
    """Trainable parameters that a plain backward of ``batch``'s loss reaches."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(summed_loss(model, batch), [p for _, p in named], allow_unused=True)
    return {n for (n, _), g in zip(named, grads, strict=True) if g is not None}


def linear_names(model: nn.Module) -> set[str]:
    """Trainable parameters owned only by linear layers (tied to nothing else)."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    return {
        n
        for n, p in model.named_parameters()
        if p.requires_grad and all(is_linear_like(m) for m in owners[id(p)])
    }


def lora_names(model: nn.Module) -> set[str]:
    """The PEFT LoRA adapter weights (``lora_A`` / ``lora_B``)."""
    return {n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def expected_names(model: nn.Module, batch: Mapping[str, Tensor], kind: str) -> set[str]:
    """What ``SELECTIONS[kind]`` promises on a model without LoRA."""
    return used_trainable_names(model, batch) if kind == "all" else linear_names(model)


# -- running the engine ------------------------------------------------------------------


def summed_loss(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """Sum over examples of each example's summed next-token loss."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return causal_lm_example_losses(model(**inputs).logits, batch["labels"]).sum()


def engine_gradients(
    model: nn.Module, batch: Mapping[str, Tensor], layers: LayerSelection | None = None
) -> dict[str, Tensor]:
    """Per-example gradients captured from an ordinary ``loss.backward()`` of the summed loss.

    Unlike :func:`per_example_gradients` this runs the backward a training loop runs, which
    reentrant checkpointing needs. ``.grad`` is cleared afterwards.
    """
    collector = RecordCollector()
    with CaptureEngine(model, layers=layers, consumers=[collector]):
        summed_loss(model, batch).backward()
    model.zero_grad(set_to_none=True)
    assert len(collector.records) == 1, f"{len(collector.records)} records for one backward"
    return canonical_grads(model, collector.records[0])


def fp64_copy(model: nn.Module) -> nn.Module:
    """The same weights in fp64, for an oracle of a lower-precision model."""
    return copy.deepcopy(model).double()


# -- 1. full models, fp64 ----------------------------------------------------------------


@pytest.mark.parametrize("kind", SELECTIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_captured_parameters_are_what_the_selection_promises(arch: str, kind: str) -> None:
    """kind='all': every trainable parameter the loss reaches (linear, embedding, norms,
    GPT-2's tied ``wte``/``lm_head`` as one); default: the linear layers' parameters
    except those tied to a non-linear module."""
    model, batch = tiny_causal_lm(arch), lm_batch(lengths=RIGHT_PAD)
    got = per_example_gradients(model, batch, layers=SELECTIONS[kind])
    assert set(got) == expected_names(model, batch, kind)


@pytest.mark.parametrize("kind", SELECTIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_right_padding_matches_func_oracle(arch: str, kind: str) -> None:
    """Right-padded batch: equal to torch.func's vmap over per-example grads."""
    model, batch = tiny_causal_lm(arch), lm_batch(lengths=RIGHT_PAD)
    got = per_example_gradients(model, batch, layers=SELECTIONS[kind])
    assert max_rel_error(got, func_oracle(model, batch, list(got))) <= FP64_TOL


@pytest.mark.parametrize("kind", SELECTIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_right_padding_matches_loop_oracle(arch: str, kind: str) -> None:
    """Right-padded batch: equal to one backward per unpadded example."""
    model, batch = tiny_causal_lm(arch), lm_batch(lengths=RIGHT_PAD)
    got = per_example_gradients(model, batch, layers=SELECTIONS[kind])
    assert max_rel_error(got, loop_oracle(model, batch, list(got))) <= FP64_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padding_matches_loop_oracle(arch: str) -> None:
    """Left-padded batch: padding contributes nothing, so each example's gradient equals
    its unpadded backward."""
    model, batch = tiny_causal_lm(arch), lm_batch(lengths=RIGHT_PAD, left_pad=True)
    got = per_example_gradients(model, batch, layers=ALL)
    assert max_rel_error(got, loop_oracle(model, batch, list(got))) <= FP64_TOL


# -- 2. PEFT LoRA ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_default_selection_is_exactly_the_adapters(arch: str) -> None:
    """On a PEFT model the default selection is every lora_A/lora_B weight and nothing else
    (no frozen base weight)."""
    model = with_lora(tiny_causal_lm(arch))
    got = per_example_gradients(model, lm_batch(lengths=RIGHT_PAD))
    assert set(got) == lora_names(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_matches_loop_oracle(arch: str) -> None:
    """LoRA adapter gradients equal one backward per unpadded example."""
    model, batch = with_lora(tiny_causal_lm(arch)), lm_batch(lengths=RIGHT_PAD)
    got = per_example_gradients(model, batch)
    assert max_rel_error(got, loop_oracle(model, batch, list(got))) <= FP64_TOL


# -- 3. lower precision ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_matches_fp64_oracle(arch: str) -> None:
    """An fp32 model's captured gradients are within fp32 rounding of the exact ones."""
    model, batch = tiny_causal_lm(arch, torch.float32), lm_batch(lengths=RIGHT_PAD)
    got = per_example_gradients(model, batch, layers=ALL)
    assert max_rel_error(got, loop_oracle(fp64_copy(model), batch, list(got))) <= FP32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_matches_fp64_oracle(arch: str) -> None:
    """A bf16 model's captured gradients are within bf16 rounding of the exact ones."""
    model, batch = tiny_causal_lm(arch, torch.bfloat16), lm_batch(lengths=RIGHT_PAD)
    got = per_example_gradients(model, batch, layers=ALL)
    assert max_rel_error(got, loop_oracle(fp64_copy(model), batch, list(got))) <= BF16_TOL


# -- 4. gradient accumulation ------------------------------------------------------------

STEPS = 2
MICRO_BATCHES = 4
# Different padding per micro-batch, so each has its own number of label tokens.
MICRO_LENGTHS = ((10, 7, 5), (10, 10, 3), (6, 10, 9), (10, 10, 10))


@dataclass
class AccumulationRun:
    """What a 2-step x 4-micro-batch SGD loop with the HF mean loss left behind.

    Attributes:
        model: the trained model (names the records' parameters).
        records: the engine's records, in order.
        expected: per micro-batch, the oracle's per-example summed-loss gradients at that
            step's weights, divided by the micro-batch's number of label tokens.
        accumulated: per optimizer step, ``.grad`` right before ``optimizer.step()``.
    """

    model: nn.Module
    records: list[MicroBatchRecord]
    expected: list[dict[str, Tensor]]
    accumulated: list[dict[str, Tensor]]


@pytest.fixture(scope="module", params=ARCHS)
def accumulation_run(request: pytest.FixtureRequest) -> AccumulationRun:
    """Train ``request.param`` for 2 SGD steps of 4 micro-batches each, with the engine on."""
    arch = request.param
    model = tiny_causal_lm(arch).train()
    # The oracle runs on a separate copy: a forward of the hooked model would be captured.
    reference = tiny_causal_lm(arch)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    collector = RecordCollector()
    expected: list[dict[str, Tensor]] = []
    accumulated: list[dict[str, Tensor]] = []
    with CaptureEngine(model, layers=ALL, consumers=[collector]) as engine:
        for step in range(STEPS):
            reference.load_state_dict(model.state_dict())
            for k in range(MICRO_BATCHES):
                batch = lm_batch(lengths=MICRO_LENGTHS[k], seed=step * MICRO_BATCHES + k)
                model(**batch).loss.backward()  # HF: mean over the shifted non -100 labels
                tokens = (batch["labels"][:, 1:] != -100).sum()
                oracle = loop_oracle(reference, batch, names)
                expected.append({n: g / tokens for n, g in oracle.items()})
            accumulated.append({n: p.grad.clone() for n, p in model.named_parameters()})
            engine.optimizer_step()
            optimizer.step()
            optimizer.zero_grad()
    return AccumulationRun(model, collector.records, expected, accumulated)


def test_accumulation_gives_one_record_per_micro_batch_with_its_step(
    accumulation_run: AccumulationRun,
) -> None:
    """Each backward is one record, labelled with the optimizer step it belongs to."""
    steps = [r.step for r in accumulation_run.records]
    assert steps == [s for s in range(STEPS) for _ in range(MICRO_BATCHES)]


def test_accumulation_records_match_mean_loss_oracle(accumulation_run: AccumulationRun) -> None:
    """Each record holds every example's share of the mean loss's gradient at the weights
    of its own step: its summed-loss gradient over the micro-batch's label tokens.

    fp32 tolerance on an fp64 model: HF's loss upcasts logits with ``.float()``, which
    rounds an fp64 model's logits, and so the captured output gradients, to fp32.
    """
    run = accumulation_run
    errors = [
        max_rel_error(canonical_grads(run.model, record), expected)
        for record, expected in zip(run.records, run.expected, strict=True)
    ]
    assert max(errors) <= FP32_TOL


def test_accumulation_records_sum_to_accumulated_grad(accumulation_run: AccumulationRun) -> None:
    """Summed over the examples of a step's micro-batches, the records give exactly the
    ``.grad`` the optimizer steps with (every parameter is captured with kind='all')."""
    run = accumulation_run
    errors = []
    for step, accumulated in enumerate(run.accumulated):
        totals: dict[str, Tensor] = {}
        for record in (r for r in run.records if r.step == step):
            for name, g in canonical_grads(run.model, record).items():
                totals[name] = totals.get(name, 0) + g.sum(dim=0)
        errors.append(max_rel_error(totals, accumulated))
    assert max(errors) <= FP64_TOL


# -- 5. gradient checkpointing -----------------------------------------------------------


def checkpointed_for_training(model: nn.Module, reentrant: bool) -> nn.Module:
    """``model`` in train mode with HF activation checkpointing on every block.

    HF's ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` is its
    deprecated alias) calls ``enable_input_require_grads`` itself, which reentrant
    checkpointing needs when the embeddings are frozen (LoRA).
    """
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": reentrant}
    )
    return model.train()


def block_linears(model: nn.Module) -> list[nn.Module]:
    """The linear layers inside the checkpointable transformer blocks (each runs once per
    forward of its block, and again when recomputed)."""
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return [m for block in blocks for m in block.modules() if is_linear_like(m)]


def count_calls(modules: list[nn.Module]) -> list[int]:
    """A live counter of the forward calls of ``modules``."""
    calls = [0]

    def count(*_: object) -> None:
        calls[0] += 1

    for module in modules:
        module.register_forward_hook(count)
    return calls


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("arch", ARCHS)
def test_checkpointing_matches_loop_oracle(arch: str, reentrant: bool, lora: bool) -> None:
    """Under both kinds of checkpointing the capture, taken from the training backward,
    equals the oracle of the same weights without checkpointing."""
    base = tiny_causal_lm(arch)
    reference = with_lora(base) if lora else base
    model = checkpointed_for_training(copy.deepcopy(reference), reentrant)
    batch = lm_batch(lengths=RIGHT_PAD)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():  # train mode changes nothing else: no dropout anywhere
        assert torch.equal(model(**inputs).logits, reference(**inputs).logits)
    linears = block_linears(model)
    calls = count_calls(linears)
    got = engine_gradients(model, batch, layers=None if lora else ALL)
    # Non-reentrant recomputation stops once it has the saved tensors it needs, so a
    # block's last layers may not run again: count any rerun as checkpointing at work.
    assert calls[0] > len(linears), "no layer was recomputed: checkpointing is not active"
    assert max_rel_error(got, loop_oracle(reference, batch, list(got))) <= FP64_TOL


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_per_example_gradients_on_checkpointed_lora_model(reentrant: bool) -> None:
    """The one-call API on a checkpointed LoRA model (the usual SFT setup) returns every
    adapter weight's exact per-example gradient, not a partial or empty result."""
    reference = with_lora(tiny_causal_lm("llama"))
    model = checkpointed_for_training(copy.deepcopy(reference), reentrant)
    batch = lm_batch(lengths=RIGHT_PAD)
    got = per_example_gradients(model, batch)
    assert set(got) == lora_names(model)
    assert max_rel_error(got, loop_oracle(reference, batch, list(got))) <= FP64_TOL


# -- 6. a module called twice in one forward ---------------------------------------------


class ReusedLayers(nn.Module):
    """One embedding, one LayerNorm and one linear, each called twice per forward; the
    embedding's second call sees a context of another length than the input."""

    def __init__(self, vocab: int = 16, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: Tensor, context_ids: Tensor) -> Tensor:
        h = self.embed(input_ids) + self.embed(context_ids).mean(dim=1, keepdim=True)
        h = torch.tanh(self.mix(self.norm(h)))
        h = torch.tanh(self.mix(self.norm(h)))
        return self.head(h)


def reused_example_losses(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """``(B,)`` summed token cross-entropies against ``batch["targets"]``."""
    logits = model(batch["input_ids"], batch["context_ids"])
    return F.cross_entropy(logits.transpose(1, 2), batch["targets"], reduction="none").sum(1)


def reused_func_oracle(model: nn.Module, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``vmap`` over ``grad`` of one example's loss, through ``functional_call``."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def example_loss(w: dict[str, Tensor], ids: Tensor, context: Tensor, targets: Tensor):
        logits = functional_call(model, w, (ids[None], context[None]))
        return F.cross_entropy(logits[0], targets, reduction="sum")

    return vmap(grad(example_loss), in_dims=(None, 0, 0, 0))(
        params, batch["input_ids"], batch["context_ids"], batch["targets"]
    )


def test_reused_modules_match_func_oracle() -> None:
    """The gradients of every call of a module add up per example (linear, embedding, norm)."""
    torch.manual_seed(0)
    model = ReusedLayers().double()
    batch = {
        "input_ids": torch.randint(0, 16, (4, 6)),
        "context_ids": torch.randint(0, 16, (4, 3)),
        "targets": torch.randint(0, 16, (4, 6)),
    }
    got = per_example_gradients(model, batch, loss_fn=reused_example_losses, layers=ALL)
    assert max_rel_error(got, reused_func_oracle(model, batch)) <= FP64_TOL


# -- 7. frozen parameters ----------------------------------------------------------------


def freeze_every_other_layer(model: nn.Module) -> nn.Module:
    """Freeze all parameters of every second parameter-owning module (about half)."""
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    for module in owners[::2]:
        module.requires_grad_(False)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_default_selection_skips_frozen_layers(arch: str) -> None:
    """Frozen layers are not captured; the trainable linear layers all are."""
    model = freeze_every_other_layer(tiny_causal_lm(arch))
    got = per_example_gradients(model, lm_batch(lengths=RIGHT_PAD))
    assert set(got) == linear_names(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_partly_frozen_model_matches_loop_oracle(arch: str) -> None:
    """Gradients that flow through frozen layers reach the trainable ones unchanged."""
    model, batch = freeze_every_other_layer(tiny_causal_lm(arch)), lm_batch(lengths=RIGHT_PAD)
    got = per_example_gradients(model, batch)
    assert max_rel_error(got, loop_oracle(model, batch, list(got))) <= FP64_TOL


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])  # the architectures with linear biases
def test_all_captures_trainable_bias_of_frozen_weight(arch: str) -> None:
    """kind='all' captures every trainable parameter, also the bias of a layer whose weight
    is frozen (BitFit-style training); dropping it silently would understate the gradient."""
    model, batch = tiny_causal_lm(arch), lm_batch(lengths=RIGHT_PAD)
    for module in model.modules():
        if is_linear_like(module) and module.bias is not None:
            module.weight.requires_grad_(False)
    got = per_example_gradients(model, batch, layers=ALL)
    assert set(got) == used_trainable_names(model, batch)
