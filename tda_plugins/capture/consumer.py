"""The interface through which the engine hands finished micro-batches to consumers."""

from __future__ import annotations

from typing import ClassVar

from tda_plugins.capture.config import CaptureConfig
from tda_plugins.capture.records import MicroBatchRecord


class CaptureConsumer:
    """Receives captured gradients. Override the events you need; all default to no-ops.

    Lifecycle: :meth:`on_attach` when the engine resolves its layers (an error there
    stops the attach before any hook exists), :meth:`on_micro_batch` after each
    micro-batch's backward, then :meth:`on_optimizer_step` when the trainer signals an
    optimizer step (with that step's records if :attr:`wants_step_records`), then
    :meth:`on_end` once when capture ends, and :meth:`on_detach` when the engine's hooks
    are removed (after an end, or instead of one).
    """

    #: Ask the engine to keep each step's records until :meth:`on_optimizer_step`.
    wants_step_records: ClassVar[bool] = False

    def on_attach(self, config: CaptureConfig) -> None:
        """The engine attached with this configuration."""

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        """A micro-batch's backward finished; ``record`` holds its per-example gradients."""

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        """Optimizer step ``step`` is about to happen; ``records`` are its micro-batches
        (empty unless :attr:`wants_step_records`)."""

    def on_end(self) -> None:
        """Capture ended (training finished or the engine was closed)."""

    def on_detach(self) -> None:
        """The engine removed its hooks: finish any background work on what was delivered."""


class RecordCollector(CaptureConsumer):
    """Keeps every record in memory (tests, one-off captures)."""

    def __init__(self) -> None:
        self.records: list[MicroBatchRecord] = []

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        self.records.append(record)
