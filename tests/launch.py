"""Starting the few multi-process tests' ranks (gloo on the CPU): forked from the test
process's :class:`~tests.zygote.Zygote` with the environment ``torchrun`` gives its ranks,
or, where the launcher itself is under test, under ``torchrun``."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.zygote import Zygote

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


def forked_ranks(
    zygote: Zygote, folder: Path, *jobs: str, ranks: int = 2, timeout: int = 300
) -> None:
    """Run ``tests/ranks_worker.py``'s ``jobs`` in ``folder`` on ``ranks`` processes forked
    by ``zygote``, each with the variables torchrun's ranks read (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``:
    one node, rank 0 hosting the rendezvous store). Fails the test with every rank's
    output tail unless all exit 0 within ``timeout`` seconds; on the first failure the
    other ranks are killed (they would wait in a collective)."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        outputs = [Path(logs) / f"rank-{rank}.log" for rank in range(ranks)]
        port = _free_port()
        pids = []
        for rank, output in enumerate(outputs):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            with output.open("w") as out:
                fd = out.fileno()
                pids.append(
                    zygote.start(
                        "tests.ranks_worker:main", folder, list(jobs), env=env, stdout=fd, stderr=fd
                    )
                )
        codes = _wait_all(zygote, pids, timeout)
        tails = "".join(f"-- rank {r} --\n{o.read_text()[-4000:]}\n" for r, o in enumerate(outputs))
    assert codes == [0] * ranks, f"exit codes {codes} (-9: killed)\n{tails}"


def _wait_all(zygote: Zygote, pids: list[int], timeout: float) -> list[int | None]:
    """Each worker's exit code; once one fails or the time is up, the rest are killed
    (their code: ``-signal.SIGKILL``)."""
    deadline = time.monotonic() + timeout
    codes: dict[int, int | None] = {}
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes and (code := zygote.wait(pid, timeout=0.2)) is not None:
                codes[pid] = code
        if any(code != 0 for code in codes.values()):
            break
    for pid in pids:
        if pid not in codes:
            with contextlib.suppress(ProcessLookupError):  # it may have just exited
                os.kill(pid, signal.SIGKILL)
            codes[pid] = zygote.wait(pid)
    return [codes[pid] for pid in pids]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
