"""The workloads every benchmark runs: models from configs, token rows, captured layers, the
floor passes, and the score conventions; and the Llama models of the in-training
workloads (a ``Trainer`` loop, ours and the peers').

Models are transformers causal LMs built from configs (random init, seed 0, dropout off,
tied input/output embeddings), so the captured layers are exactly the attention and MLP
linear layers: no embedding, no head. On the CPU, fp32 ~10M-parameter GPT-2 and Llama
models; on a CUDA GPU also bf16 and the ~0.5B-parameter ``qwen2`` (Qwen2-0.5B's shape).
Each example's loss is its own *summed* next-token cross-entropy; a score is
``<g_query, P g_train>`` with higher = more helpful.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import causal_lm, llama, token_rows, with_lora
from torch import Tensor, nn

from tda_plugins import LayerSelection, causal_lm_example_losses

#: The four measured configurations; ``"graddot_proj"`` is factor projection k per side.
METHODS = ("graddot", "graddot_proj", "kfac", "ekfac")
#: The model's floating dtype, by command-line name.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    """A transformers causal LM from its config, at full size and as a tiny smoke model
    (``note``: what a report says of its layers)."""

    config_cls: str
    model_cls: str
    full: dict[str, Any]
    tiny: dict[str, Any]
    note: str = ""

    def config(self, *, tiny: bool) -> dict[str, Any]:
        """The config keyword arguments of the full or the tiny model."""
        return dict(self.tiny if tiny else self.full)

    def text(self, *, tiny: bool) -> str:
        """``Config(key=value, ...)`` as a report shows it, and the note."""
        shape = ", ".join(f"{k}={v}" for k, v in self.config(tiny=tiny).items())
        return f"`{self.config_cls}({shape})`; {self.note}"


MODELS: dict[str, ModelSpec] = {
    "gpt2": ModelSpec(
        "GPT2Config",
        "GPT2LMHeadModel",
        full=dict(vocab_size=2048, n_embd=384, n_layer=5, n_head=6),
        tiny=dict(vocab_size=64, n_embd=16, n_layer=1, n_head=2),
    ),
    "llama": ModelSpec(
        "LlamaConfig",
        "LlamaForCausalLM",
        full=llama(2048, hidden=384, intermediate=1024, layers=5, heads=6),
        tiny=llama(64, hidden=16, intermediate=32, layers=1, heads=2),
    ),
    # Qwen2-0.5B's shape (about 494M parameters, 358M of them in the captured layers), for
    # the CUDA table: bf16, sequences of 512 tokens
    "qwen2": ModelSpec(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        full=llama(
            151936, hidden=896, intermediate=4864, layers=24, heads=14, num_key_value_heads=2
        ),
        tiny=llama(64, hidden=16, intermediate=32, layers=1, heads=2, num_key_value_heads=1),
    ),
}


@dataclass(frozen=True)
class Shape:
    """Sizes of one run: model size, sequences, tokens, micro-batch, projection k, and
    where it runs: ``device`` (``"cpu"``, ``"cuda"``) and the model's ``dtype`` (a key of
    :data:`DTYPES`)."""

    model: str
    tiny: bool = False
    train: int = 256
    queries: int = 8
    seq: int = 128
    batch: int = 8
    k: int = 16
    device: str = "cpu"
    dtype: str = "fp32"

    def config(self) -> dict[str, Any]:
        """The model's config keyword arguments."""
        return MODELS[self.model].config(tiny=self.tiny)


def spec_model(spec: ModelSpec, *, tiny: bool, seq: int) -> nn.Module:
    """``spec``'s model for ``seq``-token rows, fp32 on the CPU: seed 0, sdpa attention,
    dropout off, tied embeddings, eval mode."""
    kwargs = spec.config(tiny=tiny)
    if spec.config_cls == "GPT2Config":
        kwargs |= dict(n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        kwargs |= dict(bos_token_id=0, eos_token_id=0)
    else:
        kwargs |= dict(max_position_embeddings=seq, tie_word_embeddings=True)
    model = causal_lm(spec.config_cls, spec.model_cls, attn_implementation="sdpa", **kwargs)
    return model.eval()


def build_model(shape: Shape) -> nn.Module:
    """The shape's model (:func:`spec_model`) on its device, in its dtype (initialized in
    fp32 on the CPU, so the same on every device)."""
    model = spec_model(MODELS[shape.model], tiny=shape.tiny, seq=shape.seq)
    return model.to(device=shape.device, dtype=DTYPES[shape.dtype])


@dataclass(frozen=True)
class Problem:
    """What an adapter gets: the model, the token rows and the layers to attribute.

    Attributes:
        model: causal LM in eval mode, in the shape's dtype on its device (the adapter
            may wrap or hook it).
        train: ``(N, T)`` int64 training token rows (no padding), on the model's device.
        queries: ``(M, T)`` int64 query token rows.
        layers: module names of the captured linear layers, in model order.
        batch: micro-batch size for every pass.
        k: factor projection size per side.
        work: scratch folder (stores, caches), emptied between runs.
    """

    model: nn.Module
    train: Tensor
    queries: Tensor
    layers: tuple[str, ...]
    batch: int
    k: int
    work: Path

    @property
    def device(self) -> torch.device:
        """Where the model and the rows are."""
        return self.train.device

    def head(self, train: int, queries: int) -> Problem:
        """The same problem on the first rows only (warm-up)."""
        return Problem(
            self.model,
            self.train[:train],
            self.queries[:queries],
            self.layers,
            self.batch,
            self.k,
            self.work,
        )


def make_problem(shape: Shape, work: Path) -> Problem:
    """Model, rows (train seed 1, queries seed 2: the first 8 queries of any count are the
    same rows) and the linear layers our engine captures (no embedding, no tied head)."""
    model = build_model(shape)
    vocab = int(shape.config()["vocab_size"])
    train = token_rows(shape.train, shape.seq, vocab, seed=1).to(shape.device)
    queries = token_rows(shape.queries, shape.seq, vocab, seed=2).to(shape.device)
    layers = tuple(LayerSelection(kind="linear").resolve(model))
    return Problem(model, train, queries, layers, shape.batch, shape.k, work)


def parameter_names(model: nn.Module, layers: tuple[str, ...]) -> list[str]:
    """``named_parameters`` keys of the weights and biases of ``layers``, in layer order
    (for libraries that select parameters by name)."""
    return [
        f"{layer}.{kind}"
        for layer in layers
        for kind in ("weight", "bias")
        if getattr(model.get_submodule(layer), kind, None) is not None
    ]


def row_batches(rows: Tensor, batch: int) -> Iterator[Tensor]:
    """Consecutive ``(b, T)`` slices of ``rows``."""
    for start in range(0, rows.shape[0], batch):
        yield rows[start : start + batch]


def example_losses(model: nn.Module, ids: Tensor) -> Tensor:
    """``(B,)`` each row's own summed next-token loss (all-ones mask, labels = inputs)."""
    return causal_lm_example_losses(model(input_ids=ids).logits, ids)


def floor_backward(problem: Problem) -> None:
    """Plain forward + backward over every training and query row, no attribution."""
    for ids in [
        *row_batches(problem.train, problem.batch),
        *row_batches(problem.queries, problem.batch),
    ]:
        example_losses(problem.model, ids).sum().backward()
        problem.model.zero_grad(set_to_none=True)


@torch.no_grad()
def floor_forward(problem: Problem) -> None:
    """Forward only over every training and query row."""
    for ids in [
        *row_batches(problem.train, problem.batch),
        *row_batches(problem.queries, problem.batch),
    ]:
        example_losses(problem.model, ids)


def linear_copy(model: nn.Module) -> nn.Module:
    """A :func:`linear_twin` of a copy of ``model`` (``model`` itself is left as it is)."""
    return linear_twin(copy.deepcopy(model))


def linear_twin(model: nn.Module) -> nn.Module:
    """``model`` with every transformers ``Conv1D`` replaced in place by the equivalent
    ``nn.Linear`` (weight transposed): same function, same gradients up to the transpose,
    for libraries that hook ``nn.Linear`` only."""
    from transformers.pytorch_utils import Conv1D

    for name, module in list(model.named_modules()):
        if isinstance(module, Conv1D):
            linear = nn.Linear(module.weight.shape[0], module.weight.shape[1])
            with torch.no_grad():
                linear.weight.copy_(module.weight.T)
                linear.bias.copy_(module.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)
    return model


# -- the in-training workloads: a Trainer loop on a Llama built from its config ----------

#: The Llama of the capture-in-training workloads (training_overhead.py, peer_capture.py,
#: trajectory_cost.py), untied head.
TRAINING_LLAMA = llama(
    8000, hidden=512, intermediate=1376, layers=6, heads=8, tie_word_embeddings=False
)
#: The Llama of the data-selection workloads (selection_overhead.py, peer_selection.py).
SELECTION_LLAMA = llama(
    8000, hidden=256, intermediate=688, layers=4, heads=4, tie_word_embeddings=False
)
#: The tiny Llama of their ``--quick`` smoke runs.
QUICK_LLAMA = llama(256, hidden=32, intermediate=64, layers=1, heads=2, tie_word_embeddings=False)
#: PEFT LoRA rank of the in-training LoRA runs (every linear layer but the head).
LORA_RANK = 8


def trainer_llama(config: dict[str, Any], *, seq: int) -> nn.Module:
    """The Llama of ``config`` for ``seq``-token rows: fp32, seed 0, sdpa, train mode."""
    model = causal_lm(
        "LlamaConfig",
        "LlamaForCausalLM",
        max_position_embeddings=seq,
        attn_implementation="sdpa",
        **config,
    )
    return model.train()


def lora_copy(base: nn.Module, rank: int = LORA_RANK) -> nn.Module:
    """An identical copy of ``base`` with PEFT LoRA of ``rank`` (adapters seeded)."""
    model = copy.deepcopy(base)
    torch.manual_seed(1)
    return with_lora(model, rank)


@dataclass(frozen=True)
class Mode:
    """A fine-tuning mode of the selection workloads: LoRA rank (None: full fine-tuning)
    and the selection callback's layer options."""

    name: str
    label: str
    lora_rank: int | None
    layers: dict[str, str]

    def copy(self, base: nn.Module) -> nn.Module:
        """An identical copy of ``base`` prepared for this mode (LoRA adapters seeded)."""
        return copy.deepcopy(base) if self.lora_rank is None else lora_copy(base, self.lora_rank)


MODES: dict[str, Mode] = {
    "lora": Mode("lora", "LoRA r=8 (selection over the adapters)", LORA_RANK, {}),
    "full": Mode("full", 'full fine-tuning (`layers="all"`)', None, {"layers": "all"}),
}


def step_rows(vocab: int, *, steps: int, batch: int, seq: int) -> Tensor:
    """``(steps * batch, seq)`` training token rows in ``[1, vocab)`` of a ``Trainer`` run
    (seed 4)."""
    return token_rows(steps * batch, seq, vocab, seed=4)
