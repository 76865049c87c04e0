"""Attribution spread over ranks: ``tda attribute`` on 2 torchrun ranks against one process.

The peer workload (``benchmarks/peers/workload.py``: 256 training and 8 query rows of 128
tokens, the ~10M-parameter GPT-2 and Llama, every linear layer) is captured once with
``tda capture``; then ``tda attribute`` runs as a command per method, in interleaved
rounds (the order of the three set-ups rotates each round), three ways:

* ``1x1``: one process, one thread (``OMP_NUM_THREADS=1``): the reference;
* ``1x2``: one process, two threads;
* ``2x1``: ``torchrun --nproc-per-node 2``, one thread per rank (gloo).

Each command prints its scoring time (store reading, the preconditioner's fit and the
scores, on every rank: the collectives included); the command's wall time adds the
process start (imports, and for torchrun its rendezvous) and the writing of the outputs.
Reported: medians, the ratios 2x1 / 1x1 and 2x1 / 1x2, and whether the 2-rank scores
equal the reference's bit for bit.

    python benchmarks/distributed_attribution.py [--rounds 3] [--models gpt2 llama]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import (
    REPO,
    base_parser,
    command_line,
    load_average,
    load_text,
    machine_info,
    publish,
    rotated,
    utc_now,
)
from peers.workload import Shape, make_problem
from safetensors.torch import load_file

from tda_plugins.cli import main as tda

SETUPS = {
    "1x1": ("1", ()),
    "1x2": ("2", ()),
    "2x1": ("1", ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")),
}
HEADING = "## Attribution on 2 ranks against one process"


@dataclass
class Run:
    """One command: its wall time and the scoring time it printed, in seconds."""

    wall: float
    scoring: float


def prepare(model: str, rows: int, work: Path, tiny: bool) -> Path:
    """The workload's model saved, and its training and query stores captured by
    ``tda capture`` (one micro-batch of 8 rows per store step); returns the folder."""
    folder = work / model
    problem = make_problem(Shape(model, tiny=tiny, train=rows), folder)
    problem.model.save_pretrained(folder / "model")
    for name, data in (("train", problem.train), ("queries", problem.queries)):
        lines = [json.dumps({"input_ids": r.tolist(), "id": i}) for i, r in enumerate(data)]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        argv = ["capture", "--model", folder / "model", "--data", folder / f"{name}.jsonl"]
        code = tda([str(a) for a in [*argv, "--out", folder / name, "--batch-size", 8]])
        if code != 0:
            raise RuntimeError(f"capture of {name} failed with exit code {code}")
    return folder


def attribute(folder: Path, method: str, setup: str) -> Run:
    """``tda attribute`` of the folder's stores in a fresh process (or torchrun)."""
    threads, launcher = SETUPS[setup]
    out = folder / f"scores-{method}-{setup}"
    stores = ["--store", folder / "train", "--queries", folder / "queries"]
    argv = ["attribute", *stores, "--method", method, "--out", out, "--force"]
    command = [sys.executable, *launcher, "-m", "tda_plugins.cli", *map(str, argv)]
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    found = re.search(r" in ([0-9.]+) s on (\d) rank", done.stdout)
    if found is None:
        raise RuntimeError(f"no scoring time in the output of {' '.join(command)}")
    return Run(wall, float(found.group(1)))


def same_scores(folder: Path, method: str, setup: str) -> bool:
    """Whether ``setup``'s scores equal the one-process, one-thread scores bit for bit."""
    ref = load_file(folder / f"scores-{method}-1x1" / "scores.safetensors")
    got = load_file(folder / f"scores-{method}-{setup}" / "scores.safetensors")
    return all(torch.equal(ref[k], got[k]) for k in ("train_ids", "query_ids", "values"))


def measure(args: argparse.Namespace, work: Path) -> str:
    """Every round, method and set-up; the section's markdown."""
    runs: dict[tuple[str, str, str], list[Run]] = {}
    loads = []
    folders = {m: prepare(m, args.rows, work, args.quick) for m in args.models}
    for round_ in range(args.rounds):
        loads.append(load_average())
        for model, folder in folders.items():
            for method in args.methods:
                for setup in rotated(list(SETUPS), round_):
                    run = attribute(folder, method, setup)
                    runs.setdefault((model, method, setup), []).append(run)
                    print(f"round {round_} {model} {method} {setup}: {run}", flush=True)
    lines = [
        "| model | method | scoring 1x1 / 1x2 / 2x1 (s) | 2x1 / 1x1 | 2x1 / 1x2 "
        "| command wall 1x1 / 1x2 / 2x1 (s) | 2x1 / 1x1 | 2x1 bitwise = 1x1 | 1x2 bitwise = 1x1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, folder in folders.items():
        for method in args.methods:
            score = {
                s: statistics.median(r.scoring for r in runs[model, method, s]) for s in SETUPS
            }
            wall = {s: statistics.median(r.wall for r in runs[model, method, s]) for s in SETUPS}
            lines.append(
                f"| {model} | {method} | "
                + " / ".join(f"{score[s]:.2f}" for s in SETUPS)
                + f" | {score['2x1'] / score['1x1']:.2f} | {score['2x1'] / score['1x2']:.2f} | "
                + " / ".join(f"{wall[s]:.1f}" for s in SETUPS)
                + f" | {wall['2x1'] / wall['1x1']:.2f} | "
                + f"{'yes' if same_scores(folder, method, '2x1') else 'NO'} | "
                + f"{'yes' if same_scores(folder, method, '1x2') else 'no'} |"
            )
    argv = sys.argv[1:]
    return (
        f"{HEADING}\n\n"
        f"{args.rows} training and 8 query rows of 128 tokens (the peer workload), "
        f"medians of {args.rounds} interleaved rounds; 1x1 = one process on one thread, "
        "1x2 = one process on two threads, 2x1 = torchrun, 2 gloo ranks of one thread. "
        "Scoring = the time `tda attribute` prints (fit and scores, collectives included); "
        "command wall adds the process start and the writes.\n\n"
        + "\n".join(lines)
        + f"\n\n{utc_now()}, {machine_info()}; {load_text(loads)}.\n"
        f"`{command_line('benchmarks/distributed_attribution.py', argv)}`\n"
    )


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--methods", nargs="+", default=["graddot", "kfac", "ekfac"])
    parser.add_argument("--rows", type=int, default=256, help="training rows")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rounds = 16, 1
    work = Path(tempfile.mkdtemp(prefix="tda-distributed-"))
    try:
        section = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write = args.write if args.write is not None else not args.quick
    publish(section, HEADING, args.results, write)


if __name__ == "__main__":
    main()
