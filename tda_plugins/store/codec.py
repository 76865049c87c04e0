"""How each gradient representation is written to and read from a safetensors shard.

Keys are ``"<layer>::<field>"``; the shard's metadata names each layer's representation.
One encoder and one read-back format per representation, registered here (no pickle
anywhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import singledispatch

from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.embedding import EmbeddingFactors
from tda_plugins.grads.tokens import TokenFactors


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


@dataclass(frozen=True)
class _Format:
    """How one stored representation is read back.

    Attributes:
        decode: its stored tensors and string attributes -> the representation.
        token_fields: its fields with a token axis (axis 1): micro-batches of different
            lengths stack with zero tokens appended to the shorter ones (zero tokens add
            nothing to any product); every other axis must agree.
    """

    decode: Callable[[dict[str, Tensor], dict[str, str]], PerExampleGrad]
    token_fields: frozenset[str]


_FORMATS = {
    "token_factors": _Format(
        lambda t, a: TokenFactors(t["a"], t["g"], bias=a["bias"] == "1"),
        frozenset({"a", "g"}),
    ),
    "embedding_factors": _Format(
        lambda t, a: EmbeddingFactors(t["ids"], t["g"], int(a["num_embeddings"])),
        frozenset({"ids", "g"}),
    ),
    "dense": _Format(lambda t, a: DenseGrad(t["values"]), frozenset()),
}


def _format(kind: str) -> _Format:
    if kind not in _FORMATS:
        raise ValueError(f"unknown gradient representation {kind!r} in store shard")
    return _FORMATS[kind]


def decode(kind: str, tensors: dict[str, Tensor], attrs: dict[str, str]) -> PerExampleGrad:
    """Inverse of :func:`encode`."""
    return _format(kind).decode(tensors, attrs)


def stacked_shape(kind: str, field: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of field ``field`` of representation ``kind`` for several micro-batches
    stacked along the example axis (axis 0), from each one's stored shape (as
    :func:`~tda_plugins.grads.dense.stack_examples` stacks them): a token field's
    axis 1 is the longest one's."""
    token = field in _format(kind).token_fields
    tails = {shape[2:] if token else shape[1:] for shape in shapes}
    if len(tails) != 1:
        raise ValueError(
            f"the micro-batches' {field!r} tensors of a {kind} layer have shapes {shapes}, "
            "which do not stack: the store mixes captures of different layer shapes"
        )
    head = (max(shape[1] for shape in shapes),) if token else ()
    return (sum(shape[0] for shape in shapes), *head, *tails.pop())


def compact(grads: PerExampleGrad, keep_tokens: bool) -> PerExampleGrad:
    """The smaller of factorized and materialized storage (docs/design.md section 3.5), unless
    ``keep_tokens`` asks for per-token factors (needed for token-level scores)."""
    if keep_tokens or not isinstance(grads, TokenFactors):
        return grads
    if grads.tokens * (grads.in_dim + grads.out_dim) <= grads.dim:
        return grads
    return DenseGrad(grads.materialize().to(grads.g.dtype))
