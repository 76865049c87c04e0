"""What K-FAC statistics each captured layer keeps, decided from its module and the capture.

A layer's curvature is a Kronecker product of two factors in its gradient's layout
(docs/design.md section 8), each kept dense (a symmetric ``n x n`` sum), diagonal (an
``n`` vector: the one-hot side of an embedding, the vocabulary side of a tied head) or not
at all (``n = 0``: a norm scale's gradient is one vector with a single dense factor):

| layer | ``A`` (input side) | ``S`` (output side) | gradient layout |
|---|---|---|---|
| linear, Conv1D, LoRA | dense ``N_i'`` | dense ``N_o`` | ``(N_o, N_i')``: rows ``S`` |
| the head use of a tied weight | dense ``d`` | diagonal ``V`` | ``(V, d)``: rows ``S`` |
| an untied vocabulary-wide head | dense ``d`` | diagonal ``V`` | ``(V, d)``: rows ``S`` |
| embedding | diagonal ``V`` (token counts) | dense ``d`` | ``(V, d)``: rows ``A`` |
| norm scales (and a BitFit bias) | none | dense ``D`` (per-example ``g g^T``) | ``(D,)`` |

Factor projection keeps the projected factors of linear layers and embeddings (both dense
``k x k``: a projected embedding is per-token factors like a linear layer's) and norm
scales in full; a dense projection leaves no factors. An untied head keeps its output
factor dense only when asked (``curvature_head``: ``V x V``). A weight shared by an embedding and a
linear head (``tie_word_embeddings``) is one *unit*: both uses keep statistics and are
preconditioned together (:mod:`~tda_plugins.precondition.units`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.capture.adapters.linear import LinearAdapter
from tda_plugins.capture.layers import tied_units
from tda_plugins.grads.projection import ProjectionConfig, projected_tie

#: How a factor is kept: a dense symmetric matrix, its diagonal, or not at all.
Form = Literal["dense", "diagonal", "none"]

#: Why a layer holds no statistics: a dense projection leaves no factors.
NOT_FACTORED = "no Kronecker factors (dense projection)"
CURVATURE_OFF = "curvature off"

Layers = Mapping[str, tuple[nn.Module, LayerAdapter]]


@dataclass(frozen=True)
class FactorSpec:
    """The statistics one layer keeps; unpacks as its two widths ``(n_a, n_s)``.

    Attributes:
        a: width of the input-side factor ``A`` (0: none).
        s: width of the output-side factor ``S``.
        a_form: how ``A`` is kept (``"dense"``, ``"diagonal"`` or ``"none"``).
        s_form: how ``S`` is kept.
        unit: the layers that share this one's parameter, this one included (model
            order); empty for an untied layer.
    """

    a: int
    s: int
    a_form: Form = "dense"
    s_form: Form = "dense"
    unit: tuple[str, ...] = ()

    def __iter__(self) -> Iterator[int]:
        return iter((self.a, self.s))

    @classmethod
    def of(cls, value: FactorSpec | tuple[int, int]) -> FactorSpec:
        """``value`` itself, or dense factors of the widths of an ``(n_a, n_s)`` pair."""
        return value if isinstance(value, FactorSpec) else cls(*value)

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The tensor shapes of ``A`` and ``S``: ``(n, n)`` dense, ``(n,)`` diagonal, ``(0,)``
        none."""
        return _shape(self.a, self.a_form), _shape(self.s, self.s_form)

    @property
    def numel(self) -> int:
        """Entries held (``n_a^2 + n_s^2`` for two dense factors)."""
        return sum(_numel(shape) for shape in self.shapes())

    @property
    def dense_widths(self) -> list[int]:
        """Widths of the dense factors (the ones reduced in blocks of rows)."""
        return [n for n, f in ((self.a, self.a_form), (self.s, self.s_form)) if f == "dense"]


def form_of(factor: Tensor) -> Form:
    """How a stored factor is kept, from its shape: ``(0,)`` none, ``(n,)`` diagonal,
    ``(n, n)`` dense."""
    if factor.numel() == 0:
        return "none"
    return "diagonal" if factor.dim() == 1 else "dense"


def _shape(n: int, form: Form) -> tuple[int, ...]:
    return {"dense": (n, n), "diagonal": (n,), "none": (0,)}[form]


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def tie_problem(unit: tuple[str, ...], layers: Layers, projection: ProjectionConfig | None) -> str:
    """Why a tied unit cannot be preconditioned as one (``""`` when it can): exactly an
    embedding ``(V, d)`` and a bias-free linear head with that weight, unprojected."""
    families = sorted(layers[n][1].family for n in unit)
    names = " and ".join(unit)
    if families != ["embedding", "linear"]:
        return (
            f"a weight shared by {names} ({', '.join(families)}): only an embedding tied "
            "to a linear head has a combined K-FAC form"
        )
    if projection is not None:
        return projected_tie(unit, projection)
    for name in unit:
        module, adapter = layers[name]
        if isinstance(adapter, LinearAdapter) and "bias" in adapter.captured_parameters(module):
            return (
                f"{name} has a trainable bias beside the weight it ties to another layer; "
                "its gradient's layout differs from the embedding's"
            )
    return ""


def factor_spec(
    name: str,
    layers: Layers,
    *,
    projection: ProjectionConfig | None,
    unit: tuple[str, ...] = (),
    curvature_head: bool = False,
    heads: frozenset[str] = frozenset(),
) -> FactorSpec | str:
    """The statistics layer ``name`` of ``layers`` keeps, or why it keeps none.

    ``unit``: the layers it shares its parameter with (supported ones, see
    :func:`tie_problem`). A layer of the model's LM head (``heads``:
    :func:`~tda_plugins.capture.layers.head_layers`), untied and with its vocabulary-wide
    output side not projected, keeps that factor's diagonal, as a tied head does, so that
    no ``vocab x vocab`` matrix is summed or decomposed; ``curvature_head``: keep it dense
    instead."""
    module, adapter = layers[name]
    if projection is not None and projection.kind == "dense":
        return NOT_FACTORED
    params = adapter.captured_parameters(module)
    if adapter.family == "embedding":
        if projection is not None:  # factor projection: projected per-token factors
            return FactorSpec(projection.k_a, projection.k_g)
        vocab_rows, width = params["weight"].shape
        return FactorSpec(vocab_rows, width, "diagonal", "dense", unit)
    if not isinstance(adapter, LinearAdapter) or "weight" not in params:
        # captured materialized (norm scales, a BitFit bias): one vector per example
        return FactorSpec(0, sum(p.numel() for p in params.values()), "none", "dense")
    n_o, n_i = adapter.weight_layout(params["weight"]).shape
    a, s = n_i + int("bias" in params), n_o
    if projection is not None:  # a side no wider than its k stays exact
        a, s = min(a, projection.k_a), min(s, projection.k_g)
    if unit:
        return FactorSpec(a, s, "dense", "diagonal", unit)
    if name in heads and s == n_o and not curvature_head:
        return FactorSpec(a, s, "dense", "diagonal")
    return FactorSpec(a, s)


def layer_specs(
    layers: Layers,
    *,
    projection: ProjectionConfig | None,
    curvature_head: bool = False,
    heads: frozenset[str] = frozenset(),
) -> dict[str, FactorSpec | str]:
    """:func:`factor_spec` of every layer of ``layers``, tied units validated together."""
    units = tied_units(layers)
    out: dict[str, FactorSpec | str] = {}
    for name in layers:
        unit = units.get(name, ())
        problem = tie_problem(unit, layers, projection) if unit else ""
        out[name] = problem or factor_spec(
            name,
            layers,
            projection=projection,
            unit=unit,
            curvature_head=curvature_head,
            heads=heads,
        )
    return out
