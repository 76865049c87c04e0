"""What a capture was configured with: stores and queries must agree on it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tda_plugins.capture.layers import lora_adapter_names
from tda_plugins.grads.parameters import ParameterLayout
from tda_plugins.grads.projection import ProjectionConfig


@dataclass(frozen=True)
class CaptureConfig:
    """The facts that make two captures comparable.

    Attributes:
        layers: captured module names, in model order.
        projection: the projection applied in the hook, or ``None`` for exact gradients.
        loss_convention: what each stored per-example gradient is the gradient of:
            ``"sum"`` = the example's own loss summed over its predicted tokens.
        parameters: layer name -> where its parameters sit in its unprojected gradient
            (what scoring needs to leave some of them out); ``None`` where not known (a
            store written before they were recorded). Not compared (``==``,
            :meth:`differences`): captures of the same layers and shapes have the same.
        tied: the groups of captured layers that share a parameter (a tied embedding and
            head), each in model order: their per-example gradients add up to that
            parameter's, which scoring must count as one (section 7.1 of docs/design.md).
            Empty where none, or in a store written before ties were recorded.
        head_layers: the names of the modules that compute the model's vocabulary-wide
            output, its LM head (:func:`~tda_plugins.capture.layers.head_layers`); empty
            where it has none or is not known: K-FAC statistics keep the diagonal of their
            vocabulary-wide output factor. Not compared and not stored.
    """

    layers: tuple[str, ...]
    projection: ProjectionConfig | None
    loss_convention: str = "sum"
    parameters: Mapping[str, ParameterLayout] | None = field(default=None, compare=False)
    tied: tuple[tuple[str, ...], ...] = field(default=(), compare=False)
    head_layers: frozenset[str] = field(default=frozenset(), compare=False)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layers": list(self.layers),
            "projection": None if self.projection is None else asdict(self.projection),
            "loss_convention": self.loss_convention,
        }
        if self.parameters is not None:
            out["parameters"] = {name: p.to_json() for name, p in self.parameters.items()}
        if self.tied:
            out["tied"] = [list(unit) for unit in self.tied]
        return out

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> CaptureConfig:
        projection = value.get("projection")
        parameters = value.get("parameters")
        return cls(
            layers=tuple(value["layers"]),
            projection=None if projection is None else ProjectionConfig(**projection),
            loss_convention=value["loss_convention"],
            parameters=None
            if parameters is None
            else {name: ParameterLayout.from_json(p) for name, p in parameters.items()},
            tied=tuple(tuple(unit) for unit in value.get("tied", [])),
        )

    def differences(self, other: CaptureConfig) -> list[str]:
        """Human-readable list of what differs (empty when compatible)."""
        out = []
        if self.layers != other.layers:
            only_here = sorted(set(self.layers) - set(other.layers))[:3]
            only_there = sorted(set(other.layers) - set(self.layers))[:3]
            out.append(f"layers differ (only in one: {only_here}, only in the other: {only_there})")
        return out + self._gradient_differences(other)

    def query_differences(self, queries: CaptureConfig) -> list[str]:
        """:meth:`differences` for queries scored against this training capture: they
        must hold every layer it holds, and may hold more (scores are sums over this
        capture's layers, so the others are not read; see :meth:`extra_query_layers`)."""
        missing = [name for name in self.layers if name not in set(queries.layers)]
        out = [f"the queries lack layers the store holds ({missing[:3]})"] if missing else []
        ours, theirs = lora_adapter_names(self.layers), lora_adapter_names(queries.layers)
        if missing and ours and theirs and not ours & theirs:
            out.append(
                f"the store's PEFT adapter is named {sorted(ours)[0]!r}, the queries' "
                f"{sorted(theirs)[0]!r} (PEFT loads an adapter as 'default' unless told): "
                "capture the queries with --like STORE (like=), which loads it under the "
                "store's name"
            )
        return out + self._gradient_differences(queries)

    def extra_query_layers(self, queries: CaptureConfig) -> list[str]:
        """The layers of ``queries`` this capture does not hold, in their order."""
        return [name for name in queries.layers if name not in set(self.layers)]

    def _gradient_differences(self, other: CaptureConfig) -> list[str]:
        """What makes two captures' gradients of one layer incomparable."""
        out = []
        if self.projection != other.projection:
            out.append(f"projection differs ({self.projection} vs {other.projection})")
        if self.loss_convention != other.loss_convention:
            out.append(
                f"loss convention differs ({self.loss_convention!r} vs {other.loss_convention!r})"
            )
        return out
