"""``nn.Embedding``: row ``ids_it`` of the per-example gradient receives ``g_it``; a scaled
word embedding (``nn.Embedding`` times ``embed_scale``) receives ``embed_scale * g_it``; a
learned positional embedding that looks up ``position_ids + offset`` (OPT, BioGPT) is an
embedding of those ids."""

from __future__ import annotations

import inspect
from typing import Any, cast

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


#: transformers' learned positional embeddings whose ``forward(attention_mask,
#: cache_length=0, position_ids=None)`` is ``nn.Embedding``'s at ``position_ids + offset``,
#: the positions counted from the attention mask where ``position_ids`` is not given.
OFFSET_POSITIONS = (
    "transformers.models.opt.modeling_opt.OPTLearnedPositionalEmbedding",
    "transformers.models.biogpt.modeling_biogpt.BioGptLearnedPositionalEmbedding",
)


@register_adapter(names=OFFSET_POSITIONS)
class OffsetPositionAdapter(EmbeddingAdapter):
    """The ids a learned positional embedding looks up: the call's ``position_ids`` plus
    the module's ``offset``, or, without them, the module's own rule (the attention mask's
    running count, minus one, from ``cache_length`` on)."""

    def layer_input(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Tensor:
        call = inspect.signature(module.forward).bind(*args, **kwargs)
        call.apply_defaults()
        positions = call.arguments["position_ids"]
        if positions is None:
            mask = call.arguments["attention_mask"]
            positions = (torch.cumsum(mask, dim=1) * mask - 1).long()
            positions = positions[:, call.arguments["cache_length"] :]
        return positions + cast(int, module.offset)
