"""Running a test worker under ``torchrun`` (gloo ranks on the CPU), for the few
multi-process tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


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
