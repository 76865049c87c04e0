"""Running a test worker under ``torchrun`` (gloo ranks on the CPU), for the few
multi-process tests."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def freeze_imported() -> None:
    """Put the objects alive now (after the imports: torch's, transformers' and OLMo-core's
    half million) out of the garbage collector's reach. They live as long as the process,
    yet each full collection walks them all again: 5 s a time on a slow 2-core machine,
    and every ``Trainer.train`` asks for one (accelerate's ``free_memory``), as does
    OLMo-core's checkpoint loading. What is made later is collected as before."""
    gc.collect()
    gc.freeze()


def torchrun(worker: str, *args: object, ranks: int = 2, timeout: int = 300) -> str:
    """Run ``tests/<worker>`` on ``ranks`` processes with ``args``; fail the test with the
    output's tail unless every rank exits 0. Returns the standard output."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        str(REPO / "tests" / worker),
        *map(str, args),
    ]
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    return result.stdout
