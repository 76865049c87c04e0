"""Each layer adapter against a ``torch.func`` oracle (fp64), one small module per type."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm, GemmaTextScaledWordEmbedding
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.xglm.modeling_xglm import XGLMScaledWordEmbedding
from transformers.pytorch_utils import Conv1D

from tda_plugins import LayerSelection, per_example_gradients
from tda_plugins.capture.adapters import DEFAULT_REGISTRY
from tda_plugins.capture.layers import warn_uncaptured
from tests.oracle import max_rel_error

B, T, D = 4, 5, 6


class Probe(nn.Module):
    """``layer`` followed by a fixed nonlinear readout, so output gradients vary per token."""

    def __init__(self, layer: nn.Module, width: int):
        super().__init__()
        self.layer = layer
        self.readout = nn.Linear(width, 3).requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.readout(torch.tanh(self.layer(x))))


def probe_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """``(B,)`` per-example loss: sum over tokens of a smooth function of the output."""
    out = model(batch["x"])
    return (out**2).reshape(out.shape[0], -1).sum(dim=1) + out.reshape(out.shape[0], -1)[:, 0]


def func_oracle(model: nn.Module, x: Tensor, loss: Callable = probe_loss) -> dict[str, Tensor]:
    """``vmap(grad)`` of each example's own loss w.r.t. the trainable parameters."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}

    def one(w: dict[str, Tensor], xi: Tensor) -> Tensor:
        call = lambda inp: functional_call(model, {**frozen, **w}, (inp,))  # noqa: E731
        return loss(_Wrapped(call), {"x": xi[None]})[0]

    return vmap(grad(one), in_dims=(None, 0))(params, x)


class _Wrapped:
    def __init__(self, fn: Callable[[Tensor], Tensor]):
        self.fn = fn

    def __call__(self, x: Tensor) -> Tensor:
        return self.fn(x)


#: Cases whose module computes its scale product in fp32 even in an fp64 model (the
#: oracle's own weight gradient then carries fp32 rounding).
FP32_INSIDE = {"gemma-rmsnorm-one-plus-w": 1e-6}


def _layers() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor], int]]:
    """name -> (layer factory, input factory, output width)."""
    dense = lambda: torch.randn(B, T, D, dtype=torch.float64)  # noqa: E731
    ids = lambda: torch.randint(0, 9, (B, T))  # noqa: E731
    return {
        "linear": (lambda: nn.Linear(D, 7), dense, 7),
        "linear-no-bias": (lambda: nn.Linear(D, 7, bias=False), dense, 7),
        "linear-2d-input": (lambda: nn.Linear(D, 7), lambda: torch.randn(B, D).double(), 7),
        "conv1d": (lambda: Conv1D(7, D), dense, 7),
        "embedding": (lambda: nn.Embedding(9, D), ids, D),
        "embedding-padding-idx": (lambda: nn.Embedding(9, D, padding_idx=2), ids, D),
        "layernorm": (lambda: nn.LayerNorm(D), dense, D),
        "layernorm-no-bias": (lambda: nn.LayerNorm(D, bias=False), dense, D),
        "torch-rmsnorm": (lambda: nn.RMSNorm(D), dense, D),
        "llama-rmsnorm": (lambda: LlamaRMSNorm(D), dense, D),
        "olmo2-rmsnorm": (lambda: Olmo2RMSNorm(D), dense, D),
        # y = (1 + w) xhat: not zero at zero parameters, so xhat needs both calls
        "gemma-rmsnorm-one-plus-w": (lambda: GemmaRMSNorm(D), dense, D),
        # nn.Embedding times sqrt(hidden): a 0-d buffer (Gemma), a plain number (XGLM)
        "gemma-scaled-embedding": (
            lambda: GemmaTextScaledWordEmbedding(9, D, padding_idx=2, embed_scale=D**0.5),
            ids,
            D,
        ),
        "xglm-scaled-embedding": (
            lambda: XGLMScaledWordEmbedding(9, D, padding_idx=2, embed_scale=D**0.5),
            ids,
            D,
        ),
    }


@pytest.mark.parametrize("name", list(_layers()))
def test_layer_matches_func_oracle(name: str) -> None:
    """Per-example weight (and bias) gradients of each layer type equal ``vmap(grad)``."""
    make_layer, make_input, width = _layers()[name]
    torch.manual_seed(0)
    model = Probe(make_layer(), width).double()
    with torch.no_grad():  # non-trivial norm scales, so a wrong xhat cannot hide behind w=1
        for p in model.layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = make_input()
    got = per_example_gradients(model, {"x": x}, probe_loss, LayerSelection(kind="all"))
    ref = func_oracle(model, x)
    assert set(got) == set(ref)
    assert max_rel_error(got, ref) <= FP32_INSIDE.get(name, 1e-10)


def test_unsupported_type_by_name_is_an_error() -> None:
    """Asking for a module type without an adapter names the type and the fix."""
    model = Probe(nn.Conv2d(3, 3, 1), 3)
    with pytest.raises(ValueError, match=r"no adapter for module type\(s\) \['Conv2d'\].*register"):
        LayerSelection(kind="all", types=("Conv2d",)).resolve(model)


class Positions(nn.Embedding):
    """An embedding of each token's position, not of its input (as OPT's positional
    embedding): ``nn.Embedding``'s adapter would put its gradient on the wrong rows."""

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(torch.arange(ids.shape[-1]).expand_as(ids))


class Renamed(nn.Embedding):
    """A subclass that keeps ``nn.Embedding``'s forward."""


def test_a_subclass_with_a_forward_of_its_own_is_not_captured_as_its_base(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A subclass inherits its base's adapter only with its base's forward; one whose
    trainable weight no adapter captures is named, with the ways out that exist (not
    "layers='all'", which it already is)."""
    assert DEFAULT_REGISTRY.lookup(Renamed(9, D)) is DEFAULT_REGISTRY.lookup(nn.Embedding(9, D))
    assert DEFAULT_REGISTRY.lookup(Positions(9, D)) is None
    model = nn.Sequential(Positions(9, D), nn.Linear(D, 3))
    layers = LayerSelection(kind="all").resolve(model)
    assert list(layers) == ["1"]
    with caplog.at_level(logging.WARNING, logger="tda_plugins"):
        warn_uncaptured(model, layers, "the scores")
    assert "0.weight" in caplog.text
    assert "no layer type captures Positions" in caplog.text and "register_adapter" in caplog.text
    assert "layers='all'" not in caplog.text
