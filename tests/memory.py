"""Peak resident memory of a piece of code, measured in a fresh Python process.

A fresh process, so that no memory freed by earlier tests (kept by the allocator and
already resident) hides what the code allocates. Linux only (``/proc``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_STATUS = """
import threading

def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
"""
_RESET = """
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak restarts from what is resident now
_before = _peak = _status("VmRSS")
_done = threading.Event()

def _sample():
    global _peak
    while not _done.wait(0.001):
        _peak = max(_peak, _status("VmRSS"))

_sampler = threading.Thread(target=_sample)
_sampler.start()
"""
_REPORT = """
_done.set()
_sampler.join()
print(max(_peak, _status("VmHWM")) - _before)
"""


def peak_growth(setup: str, measured: str, timeout: float = 120) -> int:
    """Bytes by which the process's peak resident memory (memory-mapped file pages
    included) rises above its resident memory while ``measured`` runs, after ``setup`` ran
    in the same fresh process (torch on one thread, this checkout first on the path).

    The peak is the larger of ``VmHWM`` and ``VmRSS`` sampled every millisecond: the
    kernel's high-water mark can miss mapped file pages that are unmapped again."""
    script = _STATUS + textwrap.dedent(setup) + _RESET + textwrap.dedent(measured) + _REPORT
    return int(_run(script, timeout).splitlines()[-1])


def resident_after(setup: str, steps: list[str], timeout: float = 120) -> list[int]:
    """Resident bytes (``VmRSS``) of a fresh process after ``setup`` and then after each
    of ``steps``, run in turn."""
    report = 'print(_status("VmRSS"))\n'
    script = (
        _STATUS
        + textwrap.dedent(setup)
        + "".join(textwrap.dedent(step) + "\n" + report for step in steps)
    )
    return [int(line) for line in _run(script, timeout).splitlines()[-len(steps) :]]


def _run(script: str, timeout: float) -> str:
    """Standard output of ``script`` in a fresh Python process (torch on one thread, this
    checkout first on the path)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"the measured process failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip()
