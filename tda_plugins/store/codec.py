"""How each gradient representation is written to and read from a safetensors shard.

Keys are ``"<layer>::<field>"``; the shard's metadata names each layer's representation.
One encoder/decoder pair per representation, registered here (no pickle anywhere).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import singledispatch

from torch import Tensor

from tda_plugins.grads.factors import DenseGrad, EmbeddingFactors, PerExampleGrad, TokenFactors

_DECODERS: dict[str, Callable[[dict[str, Tensor], dict[str, str]], PerExampleGrad]] = {}


@singledispatch
def encode(grads: PerExampleGrad) -> tuple[str, dict[str, Tensor], dict[str, str]]:
    """``grads`` -> (representation name, tensors, string attributes)."""
    raise TypeError(f"no store encoding for {type(grads).__name__}")


@encode.register
def _(grads: TokenFactors) -> tuple[str, dict[str, Tensor], dict[str, str]]:
    return "token_factors", {"a": grads.a, "g": grads.g}, {"bias": str(int(grads.bias))}


@encode.register
def _(grads: EmbeddingFactors) -> tuple[str, dict[str, Tensor], dict[str, str]]:
    return (
        "embedding_factors",
        {"ids": grads.ids, "g": grads.g},
        {"num_embeddings": str(grads.num_embeddings)},
    )


@encode.register
def _(grads: DenseGrad) -> tuple[str, dict[str, Tensor], dict[str, str]]:
    return "dense", {"values": grads.values}, {}


def decode(kind: str, tensors: dict[str, Tensor], attrs: dict[str, str]) -> PerExampleGrad:
    """Inverse of :func:`encode`."""
    if kind not in _DECODERS:
        raise ValueError(f"unknown gradient representation {kind!r} in store shard")
    return _DECODERS[kind](tensors, attrs)


_DECODERS["token_factors"] = lambda t, a: TokenFactors(t["a"], t["g"], bias=a["bias"] == "1")
_DECODERS["embedding_factors"] = lambda t, a: EmbeddingFactors(
    t["ids"], t["g"], int(a["num_embeddings"])
)
_DECODERS["dense"] = lambda t, a: DenseGrad(t["values"])


def compact(grads: PerExampleGrad, keep_tokens: bool) -> PerExampleGrad:
    """The smaller of factorized and materialized storage (DESIGN.md section 3), unless
    ``keep_tokens`` asks for per-token factors (needed for token-level scores)."""
    if keep_tokens or not isinstance(grads, TokenFactors):
        return grads
    if grads.tokens * (grads.in_dim + grads.out_dim) <= grads.dim:
        return grads
    return DenseGrad(grads.materialize().to(grads.g.dtype))
