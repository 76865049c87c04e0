"""``nn.Embedding``: row ``ids_it`` of the per-example gradient receives ``g_it``; a scaled
word embedding (``nn.Embedding`` times ``embed_scale``) receives ``embed_scale * g_it``."""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from tda_plugins.capture.adapters.base import LayerAdapter, register_adapter
from tda_plugins.capture.adapters.linear import trainable
from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.embedding import EmbeddingFactors
from tda_plugins.grads.parameters import ParameterLayout


@register_adapter(nn.Embedding)
class EmbeddingAdapter(LayerAdapter):
    """Weight ``(V, D)``; factors are the ``(B, T)`` ids and ``(B, T, D)`` output gradients."""

    family = "embedding"

    def captured_parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        return trainable(module, ("weight",))

    def capture(self, module: nn.Module, x: Tensor, grad_output: Tensor) -> PerExampleGrad:
        ids = x.reshape(x.shape[0], -1).long()
        g = grad_output.reshape(*ids.shape, -1)
        padding_idx = getattr(module, "padding_idx", None)
        if padding_idx is not None:
            # nn.Embedding never updates its padding row: its gradient there is zero.
            g = torch.where((ids == padding_idx).unsqueeze(2), torch.zeros_like(g), g)
        return EmbeddingFactors(ids, g, num_embeddings=self._weight(module).shape[0])

    def _weight(self, module: nn.Module) -> nn.Parameter:
        return self.captured_parameters(module)["weight"]

    def parameter_layout(self, module: nn.Module) -> ParameterLayout:
        width = self._weight(module).shape[1]
        return ParameterLayout(width, (("weight", 0, width),))

    def unflatten(self, module: nn.Module, flat: Tensor) -> dict[str, Tensor]:
        return {"weight": flat.reshape(*flat.shape[:-1], *self._weight(module).shape)}

    def flatten(self, module: nn.Module, values: dict[str, Tensor]) -> Tensor:
        return values["weight"].flatten()


#: transformers' word embeddings whose ``forward`` is ``nn.Embedding``'s times
#: ``embed_scale`` (a number, or a 0-d tensor cast to the weight's dtype), and nothing
#: else (T5Gemma2's also replaces one token's rows, so it is not among them).
SCALED_WORD_EMBEDDINGS = tuple(
    f"transformers.models.{model}.modeling_{model}.{cls}"
    for model, cls in (
        ("biogpt", "BioGptScaledWordEmbedding"),
        ("gemma", "GemmaTextScaledWordEmbedding"),
        ("gemma2", "Gemma2TextScaledWordEmbedding"),
        ("gemma3", "Gemma3TextScaledWordEmbedding"),
        ("gemma3n", "Gemma3nTextScaledWordEmbedding"),
        ("minicpm3", "MiniCPM3ScaledWordEmbedding"),
        ("vaultgemma", "VaultGemmaTextScaledWordEmbedding"),
        ("xglm", "XGLMScaledWordEmbedding"),
    )
)


@register_adapter(names=SCALED_WORD_EMBEDDINGS)
class ScaledEmbeddingAdapter(EmbeddingAdapter):
    """``nn.Embedding(ids) * embed_scale``: the looked-up rows' gradient is the output's
    times the scale, in the dtype the forward multiplied in."""

    def capture(self, module: nn.Module, x: Tensor, grad_output: Tensor) -> PerExampleGrad:
        scale = cast(Tensor | float, module.embed_scale)  # a buffer, or a plain number
        if isinstance(scale, Tensor):
            scale = scale.to(self._weight(module).dtype)
        return super().capture(module, x, grad_output * scale)
