"""What a capture was configured with: stores and queries must agree on it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tda_plugins.grads.projection import ProjectionConfig


@dataclass(frozen=True)
class CaptureConfig:
    """The facts that make two captures comparable.

    Attributes:
        layers: captured module names, in model order.
        projection: the projection applied in the hook, or ``None`` for exact gradients.
        loss_convention: what each stored per-example gradient is the gradient of:
            ``"sum"`` = the example's own loss summed over its predicted tokens.
    """

    layers: tuple[str, ...]
    projection: ProjectionConfig | None
    loss_convention: str = "sum"

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "projection": None if self.projection is None else asdict(self.projection),
            "loss_convention": self.loss_convention,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> CaptureConfig:
        projection = value.get("projection")
        return cls(
            layers=tuple(value["layers"]),
            projection=None if projection is None else ProjectionConfig(**projection),
            loss_convention=value["loss_convention"],
        )

    def differences(self, other: CaptureConfig) -> list[str]:
        """Human-readable list of what differs (empty when compatible)."""
        out = []
        if self.layers != other.layers:
            only_here = sorted(set(self.layers) - set(other.layers))[:3]
            only_there = sorted(set(other.layers) - set(self.layers))[:3]
            out.append(f"layers differ (only in one: {only_here}, only in the other: {only_there})")
        if self.projection != other.projection:
            out.append(f"projection differs ({self.projection} vs {other.projection})")
        if self.loss_convention != other.loss_convention:
            out.append(
                f"loss convention differs ({self.loss_convention!r} vs {other.loss_convention!r})"
            )
        return out
