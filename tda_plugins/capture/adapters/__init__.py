"""Per-layer-type adapters, registered on import (one file per module type)."""

from tda_plugins.capture.adapters import conv1d, embedding, linear, norm
from tda_plugins.capture.adapters.base import (
    DEFAULT_REGISTRY,
    AdapterRegistry,
    LayerAdapter,
    register_adapter,
)

__all__ = [
    "DEFAULT_REGISTRY",
    "AdapterRegistry",
    "LayerAdapter",
    "conv1d",
    "embedding",
    "linear",
    "norm",
    "register_adapter",
]
