"""One rank of OLMo-core ``Trainer`` runs with ``InfluenceLoggingCallback`` under data
parallelism: the subject of an influence test in ``tests/test_olmo_core_distributed.py``.

:func:`main`, on every rank of a two-rank launch (``tests/ranks_worker.py``), trains the
tiny OLMo-2 transformer of ``tests/olmo_core_dist_worker.py`` (fp32, CPU, gloo, AdamW at a
non-zero learning rate, two micro-batches per rank) on the token file ``write_tokens`` put
in ``FOLDER``, once per mode of :data:`MODES` in one process group, through OLMo-core's own
``dp_config`` (``ddp``: ``replicate``; ``fsdp``: ``fully_shard``), scoring every step
against :data:`QUERIES` (GradDot, every layer). Each rank saves
``FOLDER/<mode>/rank<r>.pt``: the influence metrics it logged per step, its instance indices
per step, and the report it wrote (its files' paths; none on rank 1). :func:`train` with
``mode="single"`` is the one-process run on the same data and global batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback
from torch import Tensor

from tda_plugins.integrations.olmo_core import InfluenceLoggingCallback
from tests.olmo_core_dist_worker import (
    SEQ,
    STEPS,
    VOCAB,
    loader_and_module,
    save_each_mode,
)

MODES = ("ddp", "fsdp")
QUERIES = np.random.default_rng(3).integers(1, VOCAB, size=(2, SEQ)).tolist()


@dataclass
class InfluenceLog(Callback):
    """The influence metrics the trainer logs, by step, and each step's instance indices."""

    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    indices: list[Tensor] = field(default_factory=list)

    def pre_step(self, batch: dict[str, Any]) -> None:
        self.indices.append(batch["index"].clone())

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        influence = {k: v for k, v in metrics.items() if k.startswith("influence/")}
        if influence:
            self.metrics.setdefault(step, {}).update(influence)


def train(folder: Path, mode: str) -> dict[str, Any]:
    """:data:`STEPS` steps with the influence callback; what the rank saves."""
    torch.manual_seed(0)
    loader, module = loader_and_module(folder, mode)
    influence = InfluenceLoggingCallback(QUERIES, method="graddot", layers="all")
    log = InfluenceLog()
    config = TrainerConfig(
        save_folder=str(folder / mode / "run"),
        max_duration=Duration.steps(STEPS),
        metrics_collect_interval=1,
        no_checkpoints=True,
    ).with_callbacks({"influence": influence, "log": log})
    config.build(module, loader).fit()
    report = {kind: str(path) for kind, path in influence.report.items()}
    return {"metrics": log.metrics, "indices": log.indices, "report": report}


def main(folder: Path) -> None:
    save_each_mode(folder, MODES, train)
