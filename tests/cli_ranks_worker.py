"""Run under ``torchrun --nproc-per-node=2`` by tests/test_cli_ranks.py: ``tda capture`` and
``tda attribute`` spread over 2 gloo ranks, through :func:`tda_plugins.cli.main` in this
process, in turn (the first command makes the gloo process group, the others reuse it).

    python -m torch.distributed.run --nproc-per-node=2 tests/cli_ranks_worker.py ROOT

``ROOT`` holds ``model/``, ``train.jsonl``, ``store/`` and ``queries/`` (written by the test
in one process); this writes ``ROOT/ranks-store`` and ``ROOT/ranks-<method>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tda_plugins.cli import main

#: The methods scored on 2 ranks; ``--chunk`` small enough that each rank reads several.
METHODS = ("graddot", "gradcos", "kfac", "ekfac")
CHUNK = 4
BATCH = 3


def run(*argv: object) -> None:
    code = main([str(a) for a in argv])
    if code != 0:
        raise SystemExit(f"tda {argv[0]} failed with exit code {code}")


if __name__ == "__main__":
    root = Path(sys.argv[1])
    run(
        "capture", "--model", root / "model", "--data", root / "train.jsonl",
        "--out", root / "ranks-store", "--dtype", "float64", "--batch-size", BATCH,
        "--curvature-head",
    )  # fmt: skip
    for method in METHODS:
        run(
            "attribute", "--store", root / "store", "--queries", root / "queries",
            "--method", method, "--chunk", CHUNK, "--top-k", 3, "--out", root / f"ranks-{method}",
        )  # fmt: skip
