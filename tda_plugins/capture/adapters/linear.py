"""``nn.Linear``: ``y = W a + b``, per-example ``dW_i = sum_t g_it a_it^T``, bias appended."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tda_plugins.capture.adapters.base import LayerAdapter, register_adapter
from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.blocks import accumulation_dtype
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.parameters import ParameterLayout
from tda_plugins.grads.tokens import TokenFactors


def trainable(module: nn.Module, names: tuple[str, ...]) -> dict[str, nn.Parameter]:
    """The named direct parameters of ``module`` that exist and require grad."""
    params = {n: getattr(module, n, None) for n in names}
    return {n: p for n, p in params.items() if isinstance(p, nn.Parameter) and p.requires_grad}


def as_tokens(t: Tensor) -> Tensor:
    """``(B, ..., N) -> (B, T, N)`` with ``T`` the product of the middle dimensions."""
    return t.reshape(t.shape[0], -1, t.shape[-1])


@register_adapter(nn.Linear)
class LinearAdapter(LayerAdapter):
    """Weight ``(N_o, N_i)``; the materialized gradient is ``(N_o, N_i [+1 for bias])``.

    A layer whose weight is frozen but whose bias trains (BitFit) is captured as the
    materialized ``(B, N_o)`` bias gradient ``sum_t g_it``.
    """

    family = "linear"

    def captured_parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        return trainable(module, ("weight", "bias"))

    def capture(self, module: nn.Module, x: Tensor, grad_output: Tensor) -> PerExampleGrad:
        params = self.captured_parameters(module)
        g = as_tokens(grad_output)
        if "weight" not in params:
            return DenseGrad(g.to(accumulation_dtype(g)).sum(dim=1))
        return TokenFactors(as_tokens(x.detach()), g, bias="bias" in params)

    def parameter_layout(self, module: nn.Module) -> ParameterLayout:
        params = self.captured_parameters(module)
        if "weight" not in params:
            return ParameterLayout(params["bias"].numel(), (("bias", 0, params["bias"].numel()),))
        n_i = self.weight_layout(params["weight"]).shape[1]
        if "bias" not in params:
            return ParameterLayout(n_i, (("weight", 0, n_i),))
        return ParameterLayout(n_i + 1, (("weight", 0, n_i), ("bias", n_i, n_i + 1)))

    def weight_layout(self, t: Tensor) -> Tensor:
        """``(..., N_o, N_i)`` <-> the weight's own layout (an involution)."""
        return t

    def unflatten(self, module: nn.Module, flat: Tensor) -> dict[str, Tensor]:
        params = self.captured_parameters(module)
        if "weight" not in params:
            return {"bias": flat}
        n_o, n_i = self.weight_layout(params["weight"]).shape
        full = flat.reshape(*flat.shape[:-1], n_o, n_i + int("bias" in params))
        out = {"weight": self.weight_layout(full[..., :n_i])}
        if "bias" in params:
            out["bias"] = full[..., n_i]
        return out

    def flatten(self, module: nn.Module, values: dict[str, Tensor]) -> Tensor:
        params = self.captured_parameters(module)
        if "weight" not in params:
            return values["bias"].flatten()
        weight = self.weight_layout(values["weight"])
        if "bias" in params:
            weight = torch.cat([weight, values["bias"].unsqueeze(1)], dim=1)
        return weight.flatten()
