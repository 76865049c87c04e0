"""Capture: hooks, per-layer adapters, layer selection, example ids, records, consumers."""

from tda_plugins.capture.adapters import AdapterRegistry, LayerAdapter, register_adapter
from tda_plugins.capture.consumer import CaptureConsumer, RecordCollector
from tda_plugins.capture.engine import CaptureEngine
from tda_plugins.capture.identity import EXAMPLE_IDS_KEY, content_hash
from tda_plugins.capture.layers import LayerSelection, LayerSelectionError
from tda_plugins.capture.records import LayerRecord, MicroBatchRecord

__all__ = [
    "EXAMPLE_IDS_KEY",
    "AdapterRegistry",
    "CaptureConsumer",
    "CaptureEngine",
    "LayerAdapter",
    "LayerRecord",
    "LayerSelection",
    "LayerSelectionError",
    "MicroBatchRecord",
    "RecordCollector",
    "content_hash",
    "register_adapter",
]
