"""Progress bars for large writes and digests (a training run's K-FAC statistics, Adam
moments and weights' digest at its end, a fit cache): shown on rank 0 when the work is
large enough to be felt."""

from __future__ import annotations

import os
from typing import Any

from tqdm.auto import tqdm

#: Work below this many bytes passes without a bar (well under a second).
SHOWN_FROM_BYTES = 64 * 2**20


def end_of_run_bar(total_bytes: int, what: str) -> Any:
    """A byte-counting bar for ``what`` (``update(n)`` per part done), disabled below
    :data:`SHOWN_FROM_BYTES` and on ranks other than 0 (``RANK`` of a torchrun launch)."""
    quiet = total_bytes < SHOWN_FROM_BYTES or int(os.environ.get("RANK", "0")) != 0
    return tqdm(
        total=total_bytes,
        desc=f"tda-plugins: {what}",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=quiet,
        leave=False,
    )
