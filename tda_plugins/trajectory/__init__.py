"""The optimizer trajectory of a training run, recorded beside its gradient store.

:class:`TrajectoryRecorder` (a capture consumer, switched on by
``CaptureSettings(record_trajectory=True)``) writes each optimizer step's learning rates,
Adam hyperparameters, clipping factor, examples with their loss scales and the captured
layers' Adam second moments; :class:`TrajectoryReader` reads them back, checked, for
trajectory-aware attribution (``adamw_influence``).
"""

from tda_plugins.trajectory.adam import AdamTerms
from tda_plugins.trajectory.reader import TrajectoryReader
from tda_plugins.trajectory.record import AdamGroup, LayerUpdate, StepRecord
from tda_plugins.trajectory.recorder import TrajectoryRecorder
from tda_plugins.trajectory.writer import TrajectoryWriter

__all__ = [
    "AdamGroup",
    "AdamTerms",
    "LayerUpdate",
    "StepRecord",
    "TrajectoryReader",
    "TrajectoryRecorder",
    "TrajectoryWriter",
]
