"""The gradient store: crash-safe shards of per-example gradients, one directory per rank."""

from tda_plugins.store.layout import FORMAT_VERSION, StoreError
from tda_plugins.store.memory import memory_store
from tda_plugins.store.reader import StoreChunk, StoreReader
from tda_plugins.store.writer import GradientStore

__all__ = [
    "FORMAT_VERSION",
    "GradientStore",
    "StoreChunk",
    "StoreError",
    "StoreReader",
    "memory_store",
]
