"""The arithmetic of GradDot, K-FAC and EK-FAC through the store, against the floor's.

Issue 33's targets are times over the floor (one plain forward and backward over the
training and query rows). This script says how much of each method's time is arithmetic
it cannot skip and how much is everything else (the store's bytes, GEMM shapes, Python):
each phase's floating-point operations as counted by ``torch.utils.flop_counter`` (every
matrix product, the attention kernel included; eigendecompositions are not counted, so
their seconds are given apart), over the floor's count, beside its time over the floor's
time.

Workload: the peer harness's Llama-style decoder (``store_integrity.model``: hidden 256,
intermediate 688, 4 layers, vocabulary 4,096, fp32, random init), rows of 128 random
tokens, micro-batches of 32, 8 queries, every linear layer that
``LayerSelection("linear")`` captures (the untied head included, the diagonal of its
``4096``-wide output factor kept: the default); one process, one thread. Per method:
capture of the training rows (with inline K-FAC statistics for ``kfac`` and ``ekfac``),
capture of the queries, then ``method_by_name(m).score``, the path of
``bench_peers.py``'s ``ours`` (the store in a temporary folder under ``--dir``). Each
phase is run once under the counter, then timed without it between two floors.

    python benchmarks/flop_budget.py --rows 64 256
    python benchmarks/flop_budget.py --rows 64 --methods ekfac ekfac-dense-head kfac kfac-dense-head
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import common
import torch
from attribution import capture_store, micro_batches
from peers.workload import example_losses, row_batches
from store_integrity import model
from torch.utils.flop_counter import FlopCounterMode

from tda_plugins.methods import method_by_name
from tda_plugins.store import StoreReader

SECTION = "## Arithmetic against the floor (benchmarks/flop_budget.py)"
SCRIPT = "benchmarks/flop_budget.py"
#: ``-dense-head``: the untied head's dense ``vocab x vocab`` factor (``curvature_head``).
DENSE_HEAD = "-dense-head"
METHODS = ("graddot", "kfac", "ekfac", "kfac" + DENSE_HEAD, "ekfac" + DENSE_HEAD)
PHASES = ("capture train", "capture queries", "score")
BATCH = 32


def counted(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()`` and the floating-point operations its matrix products did."""
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, float(counter.get_total_flops())


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()`` and its wall seconds."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def floor(net: torch.nn.Module, train: torch.Tensor, queries: torch.Tensor) -> None:
    """One plain forward and backward over every training and query row."""
    for ids in [*row_batches(train, BATCH), *row_batches(queries, BATCH)]:
        example_losses(net, ids).sum().backward()
        net.zero_grad(set_to_none=True)


def phases(
    net: torch.nn.Module, train: torch.Tensor, queries: torch.Tensor, method: str, root: Path
) -> list[Callable[[], object]]:
    """The method's three phases, each a call that reads what the previous ones wrote."""
    dense_head = method.endswith(DENSE_HEAD)
    method = method.removesuffix(DENSE_HEAD)
    curvature = method in ("kfac", "ekfac")
    made: dict[str, StoreReader] = {}

    def capture(part: str, rows: torch.Tensor, stats: bool) -> Callable[[], object]:
        def run() -> object:
            batches = micro_batches(rows, BATCH)
            made[part] = capture_store(
                net, batches, root / part, None, stats, curvature_head=dense_head
            )
            return made[part]

        return run

    return [
        capture("train", train, curvature),
        capture("queries", queries, False),
        lambda: method_by_name(method).score(made["train"], made["queries"]),
    ]


class EighClock:
    """Adds up the seconds ``torch.linalg.eigh`` takes while the block runs (what K-FAC and
    EK-FAC spend in eigendecompositions, which the flop counter does not count)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> EighClock:
        self._real = torch.linalg.eigh

        def eigh(*args: object, **kwargs: object) -> object:
            out, seconds = timed(lambda: self._real(*args, **kwargs))
            self.seconds += seconds
            return out

        torch.linalg.eigh = eigh
        return self

    def __exit__(self, *exc: object) -> None:
        torch.linalg.eigh = self._real


def measure(
    net: torch.nn.Module, train: torch.Tensor, queries: torch.Tensor, method: str, where: Path
) -> tuple[list[float], list[float], float, float]:
    """The method's phases: their flops (one counted run), their seconds and the seconds
    of its eigendecompositions (one uncounted run), and the floor's seconds (the mean of
    one before and one after the timed run)."""

    def floor_run() -> None:
        floor(net, train, queries)

    with tempfile.TemporaryDirectory(dir=where) as name:
        flops = [counted(run)[1] for run in phases(net, train, queries, method, Path(name))]
    with tempfile.TemporaryDirectory(dir=where) as name:
        before = timed(floor_run)[1]
        with EighClock() as eigh:
            secs = [timed(run)[1] for run in phases(net, train, queries, method, Path(name))]
        floor_s = (before + timed(floor_run)[1]) / 2
    return flops, secs, eigh.seconds, floor_s


def main(argv: list[str]) -> int:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS[:3]))
    p.add_argument("--dir", type=Path, default=Path.cwd(), help="where the stores go")
    a = p.parse_args(argv)
    write = a.write if a.write is not None else not a.quick
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = model()
    lines, loads = [], []
    for rows in [8] if a.quick else a.rows:
        gen = torch.Generator().manual_seed(0)
        train = torch.randint(1, 4096, (rows, 128), generator=gen)
        queries = torch.randint(1, 4096, (8, 128), generator=gen)
        floor_flops = counted(partial(floor, net, train, queries))[1]
        for method in a.methods:
            flops, secs, eigh, floor_s = measure(net, train, queries, method, a.dir)
            loads.append(common.load_average())
            cells = " | ".join(
                f"{f / floor_flops:.2f}x / {s / floor_s:.2f}x"
                for f, s in zip(flops, secs, strict=True)
            )
            line = (
                f"| {rows} | {method} | {cells} | **{sum(flops) / floor_flops:.2f}x** "
                f"| {eigh / floor_s:.2f}x | **{sum(secs) / floor_s:.2f}x** |"
            )
            print(line, flush=True)
            lines.append(line)
    header = " | ".join(f"{ph}: flops / time" for ph in PHASES)
    section = common.tidy(f"""{common.heading(SECTION, SCRIPT, argv, loads)}

Each phase's floating-point operations (`torch.utils.flop_counter`: matrix products and
attention; eigendecompositions not counted) over the floor's, and its wall time over the
floor's (the mean of a floor before and after the method). `eigh` is the time the fp64
eigendecompositions of the store's factors take alone, part of the `score` time.
`-dense-head`: the untied head's dense `4096 x 4096` output factor (`curvature_head=True`)
instead of its diagonal (the default).

| rows | method | {header} | flops, total | eigh time | time, total |
|---:|---|{"---|" * len(PHASES)}---:|---:|---:|
{chr(10).join(lines)}
""")
    common.publish(section, SECTION, a.results, write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
