"""One rank of OLMo-core ``Trainer`` runs with ``DataSelectionCallback`` under data
parallelism: the subject of a selection test in ``tests/test_olmo_core_distributed.py``.

:func:`main`, on every rank of a two-rank launch (``tests/ranks_worker.py``), trains the
tiny OLMo-2 transformer of ``tests/olmo_core_dist_worker.py`` (fp32, CPU, gloo, two
micro-batches per rank, AdamW) on the token file ``write_tokens`` put in ``FOLDER``, three
times in one process group, each through OLMo-core's own ``dp_config``: ``ddp``
(``replicate``), ``fsdp`` (``fully_shard``: DTensor parameters sharded on dim 0) and
``hsdp`` (two replicas of a one-rank shard: placements ``(Replicate(), Shard(0))``), with
half of each step's global batch dropped; then ``ddp-defaults`` and ``fsdp-defaults``: the
callback's default settings (``step_cosine`` in Adam's metric, which weighs every pair of
the global batch). Each rank saves ``FOLDER/<run>/rank<r>.pt``: its
instance indices and tokens per step, the full parameters each step started from, the full
``.grad`` after selection, and the global selection outcome per step. :func:`train` with
``"single"`` (``"single-defaults"``) is the one-process run on the same data and global
batch size. Last, :func:`refusal` runs ``ddp`` selection on the label-masked tokens in
``FOLDER/masked``, whose ranks hold unequal label tokens, and saves the refusal's message
as ``FOLDER/masked/refusal<r>.pt``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback
from olmo_core.train.train_module import (
    TransformerTrainModule,
)
from torch import Tensor
from torch.distributed.tensor import DTensor

from tda_plugins.integrations.olmo_core import DataSelectionCallback
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tests.olmo_core_dist_worker import (
    SEQ,
    STEPS,
    VOCAB,
    loader_and_module,
    save_each_mode,
)
from tests.selection_helpers import PINNED

MODES = ("ddp", "fsdp", "hsdp")
#: The folder of the label-masked tokens :func:`refusal` trains on.
MASKED = "masked"
#: The runs with the callback's default settings (``<mode>-defaults``).
DEFAULTS = ("ddp-defaults", "fsdp-defaults")
FRACTION = 0.5
#: The callback's options per settings variant (``<mode>`` or ``<mode>-<variant>``).
VARIANTS: dict[str, dict[str, Any]] = {"": {"fraction": FRACTION, **PINNED}, "defaults": {}}
TARGET = np.random.default_rng(11).integers(1, VOCAB, size=(3, SEQ)).tolist()


def _full(t: Tensor) -> Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


@dataclass
class Audit(Callback):
    """Per step: the instances and full parameters (``pre_step``), the full ``.grad`` after
    the selection (``pre_optim_step``, after the selection callback)."""

    indices: list[Tensor] = field(default_factory=list)
    input_ids: list[Tensor] = field(default_factory=list)
    params: list[dict[str, Tensor]] = field(default_factory=list)
    grads: list[dict[str, Tensor]] = field(default_factory=list)

    def _model(self) -> torch.nn.Module:
        train_module = self.trainer.train_module
        assert isinstance(train_module, TransformerTrainModule)
        return train_module.model

    def pre_step(self, batch: dict[str, Any]) -> None:
        self.indices.append(batch["index"].clone())
        self.input_ids.append(batch["input_ids"].clone())
        self.params.append({n: _full(p) for n, p in self._model().named_parameters()})

    def pre_optim_step(self) -> None:
        self.grads.append(
            {n: _full(p.grad) for n, p in self._model().named_parameters() if p.grad is not None}
        )


def train(folder: Path, run: str) -> dict[str, Any]:
    """:data:`STEPS` steps with selection (``run``: ``<mode>`` or ``<mode>-<variant>`` of
    :data:`VARIANTS`); what the rank saves."""
    mode, _, variant = run.partition("-")
    torch.manual_seed(0)
    loader, module = loader_and_module(folder, mode)
    selection = DataSelectionCallback(TARGET, **VARIANTS[variant])
    audit = Audit()
    config = TrainerConfig(
        save_folder=str(folder / run / "run"),
        max_duration=Duration.steps(STEPS),
        metrics_collect_interval=1,
        no_checkpoints=True,
    ).with_callbacks({"selection": selection, "audit": audit})
    config.build(module, loader).fit()
    assert selection.session is not None
    params = selection.session.engine.captured_layers
    return {
        "indices": audit.indices,
        "input_ids": audit.input_ids,
        "params": audit.params,
        "grads": audit.grads,
        "history": [h.summary() for h in selection.history],
        "example_ids": [h.example_ids for h in selection.history],
        "layers": sorted(params),
        "routes": dict(selection.session.selector.surgery.routes),
        "sharded": selection.session.sharded,
    }


def refusal(folder: Path) -> str:
    """``ddp`` selection on ``folder/masked``'s label-masked tokens: the message of its
    refusal ('' where it trained)."""
    try:
        train(folder / MASKED, "ddp")
    except UnsupportedTrainingSetup as error:
        return str(error)
    return ""


def main(folder: Path) -> None:
    save_each_mode(folder, MODES + DEFAULTS, train)
    message = refusal(folder)
    torch.save({"message": message}, folder / MASKED / f"refusal{dist.get_rank()}.pt")
