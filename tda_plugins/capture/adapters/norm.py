"""LayerNorm and RMSNorm scales: ``y = w * xhat (+ b)``, per-example ``dw_i = sum_t xhat_it g_it``.

Captured materialized (the scale gradient is a vector, smaller than any factor).
``xhat`` is the module's own output at unit scale and zero bias, computed by the module
itself, so every RMSNorm variant (Llama/Qwen2 cast-then-scale, OLMo-2 scale-then-cast,
``(1 + w)`` forms) is handled with its own rounding: ``xhat = y(w=1, b=0) - y(w=0, b=0)``,
the second term left out for a module whose output at zero parameters is zero.
Transformers' RMSNorm classes are matched by the class-name suffix ``RMSNorm``.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn
from torch.func import functional_call

from tda_plugins.capture.adapters.base import LayerAdapter, register_adapter
from tda_plugins.capture.adapters.linear import trainable
from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.blocks import accumulation_dtype
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.parameters import ParameterLayout


@register_adapter(nn.LayerNorm, nn.RMSNorm, suffixes=("RMSNorm",))
class NormAdapter(LayerAdapter):
    """Flattened per-example gradient: ``[weight, bias]``, each where trainable."""

    family = "norm"

    def __init__(self) -> None:
        # module -> whether its output at zero parameters is zero (``w * xhat + b`` forms),
        # so that ``xhat = y(w=1, b=0)`` exactly and the second call can be left out
        self._zero_at_zero: WeakKeyDictionary[nn.Module, bool] = WeakKeyDictionary()

    def captured_parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        return trainable(module, ("weight", "bias"))

    def _normalized(self, module: nn.Module, x: Tensor) -> Tensor:
        params = dict(module.named_parameters(recurse=False))
        at_zero = {n: torch.zeros_like(p) for n, p in params.items()}
        at_unit = {**at_zero, "weight": torch.ones_like(params["weight"])}
        with torch.no_grad():
            xhat = functional_call(module, at_unit, (x,))
            if not self._is_zero_at_zero(module):  # (1 + w) forms
                xhat = xhat - functional_call(module, at_zero, (x,))
            return xhat

    def _is_zero_at_zero(self, module: nn.Module) -> bool:
        """Whether ``module`` outputs zeros at zero parameters, tried once on the host
        (no device read inside a hook) with a fixed non-constant row (a constant one
        normalizes to zero in any form); a module that cannot run there counts as not."""
        if module not in self._zero_at_zero:
            params = dict(module.named_parameters(recurse=False))
            zeros = {n: torch.zeros(p.shape) for n, p in params.items()}
            shape = params["weight"].shape
            probe = torch.linspace(-1.0, 2.0, shape.numel()).reshape(1, *shape)
            try:
                with torch.no_grad():
                    zero = not bool(functional_call(module, zeros, (probe,)).any())
            except RuntimeError:  # buffers on another device
                zero = False
            self._zero_at_zero[module] = zero
        return self._zero_at_zero[module]

    def capture(self, module: nn.Module, x: Tensor, grad_output: Tensor) -> PerExampleGrad:
        acc = accumulation_dtype(grad_output)
        g = grad_output.to(acc)
        params = self.captured_parameters(module)
        batch, n = x.shape[0], next(iter(params.values())).numel()
        parts = []
        if "weight" in params:
            xhat = self._normalized(module, x.detach()).to(acc)
            parts.append((xhat * g).reshape(batch, -1, n).sum(1))
        if "bias" in params:
            parts.append(g.reshape(batch, -1, n).sum(1))
        return DenseGrad(torch.cat(parts, dim=1))

    def parameter_layout(self, module: nn.Module) -> ParameterLayout:
        columns, start = [], 0
        for name, p in self.captured_parameters(module).items():
            columns.append((name, start, start + p.numel()))
            start += p.numel()
        return ParameterLayout(start, tuple(columns))

    def unflatten(self, module: nn.Module, flat: Tensor) -> dict[str, Tensor]:
        params = self.captured_parameters(module)
        parts = flat.split([p.numel() for p in params.values()], dim=-1)
        return {
            name: part.reshape(*flat.shape[:-1], *p.shape)
            for (name, p), part in zip(params.items(), parts, strict=True)
        }

    def flatten(self, module: nn.Module, values: dict[str, Tensor]) -> Tensor:
        return torch.cat([values[name].flatten() for name in self.captured_parameters(module)])
