"""The store's NaN/inf check on reading, against the check it replaced.

Every chunk a method reads from a store is checked for NaN/inf
(``tda_plugins.store.reader``): each tensor once (an input shared by q/k/v once), by its
sum (``tda_plugins.utils.finite``). The check before it read every layer's tensors with
``torch.aminmax``, a shared input once per layer that uses it; it is kept here, as the
baseline, in :func:`aminmax_per_layer`. Both run on the same chunks of a store of the peer
harness's Llama (``store_integrity.model``: hidden 256, 4 layers, vocabulary 4,096, untied
head, every linear layer; micro-batches of 32; rows of 128 random tokens), in alternated
rounds, and each is given over the floor (one forward and backward over the rows)
measured in the same process. CPU seconds, one thread.

    python benchmarks/finite_check.py --rows 64 256 --rounds 5
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import common
import torch
from attribution import capture_store, micro_batches
from flop_budget import floor
from store_integrity import model

from tda_plugins.store import StoreReader
from tda_plugins.store.reader import StoreChunk, _require_finite

SECTION = "## The store's finite check on reading (benchmarks/finite_check.py)"
SCRIPT = "benchmarks/finite_check.py"


def aminmax_per_layer(chunk: StoreChunk) -> None:
    """The check the reader made before: per layer, each floating tensor's minimum and
    maximum (NaN propagates through both), one host sync per tensor."""
    for grads in chunk.layers.values():

        def check(t: torch.Tensor) -> torch.Tensor:
            if t.is_floating_point() and t.numel():
                low, high = torch.aminmax(t)
                if not bool(torch.isfinite(torch.stack([low, high])).all()):
                    raise ValueError("non-finite")
            return t

        grads.map_tensors(check)


def cpu_seconds(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


CHECKS = {"now": _require_finite, "before": aminmax_per_layer}


def measure(
    net: torch.nn.Module, rows: int, rounds: int, where: Path
) -> tuple[list[float], list[float], float]:
    """Each check's CPU seconds over every chunk of a ``rows``-row store, per round
    (alternated: before, now), and the floor's."""
    gen = torch.Generator().manual_seed(0)
    train = torch.randint(1, 4096, (rows, 128), generator=gen)
    queries = torch.randint(1, 4096, (8, 128), generator=gen)
    with tempfile.TemporaryDirectory(dir=where) as name:
        root = Path(name) / "train"
        capture_store(net, micro_batches(train, 32), root, None, False)
        chunks = list(StoreReader(root).iter_chunks(32))
        floor_s = statistics.median(
            cpu_seconds(lambda: floor(net, train, queries)) for _ in range(2)
        )
        times: dict[str, list[float]] = {k: [] for k in CHECKS}
        order = list(CHECKS)
        for r in range(rounds):
            for key in order[r % 2 :] + order[: r % 2]:
                check = CHECKS[key]
                times[key].append(cpu_seconds(lambda check=check: [check(c) for c in chunks]))
    return times["before"], times["now"], floor_s


def spread(values: list[float], digits: int, unit: str = "") -> str:
    """``median (min-max)``."""
    m, lo, hi = statistics.median(values), min(values), max(values)
    return f"{m:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


def main(argv: list[str]) -> None:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path.cwd(), help="where the stores go")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = model()
    lines, loads = [], []
    for rows in [8] if a.quick else a.rows:
        before, now, floor_s = measure(net, rows, 1 if a.quick else a.rounds, a.dir)
        loads.append(common.load_average())
        ratios = [n / b for n, b in zip(now, before, strict=True)]
        shares = (
            f"{statistics.median(before) / floor_s:.3f}x -> {statistics.median(now) / floor_s:.3f}x"
        )
        lines.append(
            f"| {rows} | {spread(before, 3)} | {spread(now, 3)} | {spread(ratios, 2, 'x')} "
            f"| {shares} |"
        )
        print(lines[-1], flush=True)
    section = common.tidy(f"""{common.heading(SECTION, SCRIPT, argv, loads)}

CPU seconds of the check over every chunk of the training store (chunks of 32 examples),
median (range) of the rounds; the last column is each over the floor of the same process.

| rows | aminmax per layer (before) s | sum probe (now) s | now / before | share of the floor |
|---:|---:|---:|---:|---:|
{chr(10).join(lines)}
""")
    write = not a.quick if a.write is None else a.write
    common.publish(section, SECTION, a.results, write)


if __name__ == "__main__":
    main(sys.argv[1:])
