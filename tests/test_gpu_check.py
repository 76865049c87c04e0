"""``benchmarks/gpu_check.sh`` is for a GPU machine: here it parses, fails at once with a
clear message where torch sees no CUDA device (hidden with ``CUDA_VISIBLE_DEVICES=""``,
so that this holds on a GPU machine too), and the Python it calls imports on the CPU."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
ENV = {
    **os.environ,
    "PYTHON": sys.executable,
    "PYTHONPATH": str(ROOT),
    "HF_HUB_OFFLINE": "1",
    "CUDA_VISIBLE_DEVICES": "",
}


def run(*command: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in command], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )


def test_the_script_parses_and_names_files_that_exist() -> None:
    assert run("bash", "-n", SCRIPT).returncode == 0
    paths = set(re.findall(r"(?:tests|benchmarks)/\w+\.py", SCRIPT.read_text()))
    assert {"benchmarks/gpu_checks.py", "benchmarks/bench_peers.py"} <= paths
    assert all((ROOT / p).is_file() for p in paths), paths


def test_without_a_gpu_the_script_stops_at_once_and_says_why() -> None:
    done = run("bash", SCRIPT)
    assert done.returncode == 2
    assert "sees no CUDA device" in done.stderr and "nothing was checked" in done.stderr
    assert "==" not in done.stdout  # no check started


def run_script(path: Path, *args: str) -> int:
    """Run ``path`` as ``__main__`` in this process, as ``python path args`` would (its
    folder first on ``sys.path``); its exit code. In-process: a fresh interpreter would
    import torch and transformers again, most of this test's time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(path.parent))
        patch.setattr(sys, "argv", [str(path), *args])
        with pytest.raises(SystemExit) as stop:
            runpy.run_path(str(path), run_name="__main__")
    return stop.value.code


def test_the_python_it_calls_imports_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpu_checks.py`` imports everything it uses before it looks for the device (exit 2:
    no CUDA device, not an import error); ``bench_peers.py --help`` imports the harness."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a GPU machine too
    assert run_script(ROOT / "benchmarks" / "gpu_checks.py", "sync") == 2
    assert "sees no CUDA device" in capsys.readouterr().err
    assert run_script(ROOT / "benchmarks" / "bench_peers.py", "--help") == 0
    assert "--device" in capsys.readouterr().out
