"""transformers' GPT-2 ``Conv1D``: a linear layer storing its weight as ``(N_i, N_o)``.

Matched by qualified class name so the engine never imports transformers.
"""

from __future__ import annotations

from torch import Tensor

from tda_plugins.capture.adapters.base import register_adapter
from tda_plugins.capture.adapters.linear import LinearAdapter


@register_adapter(names=("transformers.pytorch_utils.Conv1D",))
class Conv1DAdapter(LinearAdapter):
    """Same factors as ``nn.Linear``; the weight gradient is transposed to ``(N_i, N_o)``."""

    def weight_layout(self, t: Tensor) -> Tensor:
        return t.transpose(-1, -2)
