"""An influence log saved beside each checkpoint, so that a resumed run's report covers the
whole run, as an uninterrupted run's does.

:class:`~tda_plugins.live.influence.InfluenceLogger` keeps, across steps, what no trainer
checkpoint holds: the per-step history (each scored step's example ids and scores), every
example's cumulative score and the token ids of the examples this rank trained on (for the
report's texts). A resumed run without them would start its report at the resumed step.
The integrations save its :meth:`~tda_plugins.live.influence.InfluenceLogger.state` as
``<checkpoint>/`` :data:`STATE_FILE` (:func:`write_state`; one file per rank: the token ids
are each rank's own) and give it back to a resumed run's logger (:func:`read_state`,
:meth:`~tda_plugins.live.influence.InfluenceLogger.restore`).

Layout (safetensors; ``S`` scored steps, ``N`` their examples in all, ``M`` queries, ``E``
examples with a cumulative score, ``T`` examples with tokens): ``steps`` ``(S,)``,
``rows`` ``(S,)`` (each step's example count), ``mean`` and ``max`` ``(S, M)``,
``example_ids`` ``(N,)``, ``scores`` ``(N, M)``, ``cumulative_ids`` ``(E,)``,
``cumulative`` ``(E, M)``, ``token_ids`` ``(T,)``, ``token_counts`` ``(T,)``, ``tokens``
(their token ids end to end). Written to a temporary name and renamed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from tda_plugins.live.influence import InfluenceLogger
from tda_plugins.store.io import write_renamed

logger = logging.getLogger(__name__)

#: The file a rank's influence log is saved to, in a trainer's checkpoint folder.
STATE_FILE = "influence-state-rank-{rank}.safetensors"


def state_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / STATE_FILE.format(rank=rank)


def write_state(log: InfluenceLogger, folder: str | Path, rank: int) -> Path:
    """Save ``log`` as ``folder``/:data:`STATE_FILE` of ``rank`` (temporary name, renamed)."""
    path = state_path(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in log.state().items()}
    write_renamed(path, lambda temporary: save_file(tensors, str(temporary)))
    return path


def read_state(folder: str | Path, rank: int) -> dict[str, Tensor] | None:
    """The state :func:`write_state` saved in ``folder`` (``None`` when there is none)."""
    path = state_path(folder, rank)
    return load_file(str(path)) if path.is_file() else None


def warn_not_restored(checkpoint: Path, step: int) -> None:
    """A resumed run whose checkpoint holds no influence log: its report starts here."""
    logger.warning(
        "tda-plugins: %s holds no influence log (%s), so the influence report covers the "
        "steps from %d on only; an uninterrupted run's covers every step",
        checkpoint,
        STATE_FILE.format(rank="<r>"),
        step + 1,
    )
