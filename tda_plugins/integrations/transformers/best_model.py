"""``load_best_model_at_end``: the run ends on an earlier checkpoint's weights.

After its last step the ``Trainer`` loads the weights of the best checkpoint (by
``metric_for_best_model``) back into the model, before ``on_train_end``. The model the
user then attributes never saw the steps after that checkpoint, so a store that kept them
would score examples that had no part in it. The capture callback therefore ends the store
where the restored weights were checkpointed: the later steps leave the store (and the
trajectory), the K-FAC statistics are those saved with that checkpoint, and the Adam
moments LESS needs are read from the checkpoint's ``optimizer.pt`` (the live optimizer
holds the last step's), all with one warning that says so. The influence logging
callback likewise ends its report with the log it saved in that checkpoint.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import TrainerState, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, TRAINER_STATE_NAME

from tda_plugins.parallel.dtensor import is_dtensor
from tda_plugins.precondition.adam import AdamMoments
from tda_plugins.session.capture import CaptureSession, has_adam_moments

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoredCheckpoint:
    """The checkpoint whose weights the trainer put back: its folder, and the optimizer
    steps those weights were trained with (its ``global_step``)."""

    path: Path
    step: int


def restored_checkpoint(args: TrainingArguments, state: TrainerState) -> RestoredCheckpoint | None:
    """The checkpoint ``load_best_model_at_end`` restored at the end of training, when it
    was saved before the last step (``None`` otherwise: the weights are the last step's)."""
    if not args.load_best_model_at_end or not state.best_model_checkpoint:
        return None
    path = Path(state.best_model_checkpoint)
    step = _checkpoint_step(path)
    return RestoredCheckpoint(path, step) if step < state.global_step else None


def _checkpoint_step(path: Path) -> int:
    """A checkpoint's ``global_step``: from its ``trainer_state.json``, else its folder's
    name (``checkpoint-<step>``)."""
    saved = path / TRAINER_STATE_NAME
    if saved.is_file():
        return int(json.loads(saved.read_text())["global_step"])
    return int(path.name.rsplit("-", 1)[-1])


def end_at_checkpoint(
    session: CaptureSession,
    restored: RestoredCheckpoint,
    optimizer: torch.optim.Optimizer | None,
    last_step: int,
) -> AdamMoments | None:
    """Roll ``session`` back to ``restored`` (:meth:`CaptureSession.roll_back`) and return
    the optimizer state its Adam moments are to be saved from: the checkpoint's, where it
    holds one this process can read (``None`` otherwise, with a warning: LESS then has no
    moments to use, and says so)."""
    session.roll_back(restored.step)
    moments = _checkpointed_moments(restored.path, optimizer, session)
    logger.warning(
        "tda-plugins: load_best_model_at_end restored %s, the weights after %d of the run's %d "
        "optimizer steps: the store keeps steps 0..%d, the ones those weights were trained on, "
        "with the K-FAC statistics%s saved with that checkpoint, so that its scores attribute "
        "the model the run ends with",
        restored.path.name,
        restored.step,
        last_step,
        restored.step - 1,
        " and Adam moments" if moments is not None else "",
    )
    return moments


def _checkpointed_moments(
    checkpoint: Path, optimizer: torch.optim.Optimizer | None, session: CaptureSession
) -> AdamMoments | None:
    if not session.settings.save_optimizer_state or not has_adam_moments(optimizer):
        return None
    assert optimizer is not None
    path = checkpoint / OPTIMIZER_NAME
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(is_dtensor(p) for p in params) or not path.is_file():
        logger.warning(
            "tda-plugins: %s holds no optimizer state this process can read (saved sharded, "
            "or with save_only_model), so the store gets no Adam moments and LESS cannot score "
            "it; the other methods are unaffected",
            checkpoint.name,
        )
        return None
    if session.rank != 0:  # unsharded moments are written by rank 0 alone, with no collective
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return SavedMoments(saved, params)


class SavedMoments:
    """A checkpointed optimizer state (``torch.optim.Optimizer.state_dict()``) keyed by the
    live optimizer's parameters, which it lists in the same order."""

    def __init__(self, saved: Mapping[str, Any], params: list[Tensor]):
        self.param_groups: list[dict[str, Any]] = list(saved["param_groups"])
        ids = [i for group in self.param_groups for i in group["params"]]
        if len(ids) != len(params):
            raise ValueError(
                f"the checkpointed optimizer holds {len(ids)} parameters, the trainer's "
                f"{len(params)}: it is not this run's"
            )
        states = saved["state"]
        pairs = zip(params, ids, strict=True)
        self.state: dict[Tensor, Any] = {p: states[i] for p, i in pairs if i in states}
