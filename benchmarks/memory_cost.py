"""What a gigabyte of memory new to a process costs this machine's kernel.

The store path writes every row's token factors into the page cache, so its time holds
the kernel's cost of the pages it fills. That cost depends on the machine, not on the
library: on a virtual machine whose free memory goes back to the host (virtio-balloon
free page reporting, ``/sys/module/page_reporting``), a page freed for a few seconds
must be faulted in from the host again, where a page reused at once is cheap. This
script measures both, for the page cache (a file written, then removed) and for a
process's own memory (a buffer touched page by page), so that a store-path figure from
one machine can be read against another's:

* **reused at once**: written (touched) right after the same amount was freed;
* **free for a while**: written after ``--idle`` seconds with that memory free.

Kernel (system) CPU seconds per GB, median (range) of the rounds, files under ``--dir``.

    python benchmarks/memory_cost.py --gb 1 2 --rounds 3 --idle 20
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import common
import torch

SECTION = "## The kernel's cost of new memory (benchmarks/memory_cost.py)"
SCRIPT = "benchmarks/memory_cost.py"
CHUNK = 64 << 20
REPORTING = Path("/sys/module/page_reporting/parameters/reported_kib")


def system_seconds(work: Callable[[], None]) -> float:
    before = os.times()
    work()
    return os.times().system - before.system


def page_cache(path: Path, gb: float) -> Callable[[], None]:
    """Write ``gb`` GB to ``path`` (buffered, no fsync): the page cache takes it."""
    block = torch.ones(CHUNK, dtype=torch.uint8).numpy().tobytes()

    def write() -> None:
        with path.open("wb") as f:
            for _ in range(round(gb * (1 << 30) / CHUNK)):
                f.write(block)

    return write


def process_memory(gb: float) -> Callable[[], None]:
    """Allocate ``gb`` GB and touch each 4 KiB page once, then free it."""

    def touch() -> None:
        buffer = torch.empty(int(gb * (1 << 30)), dtype=torch.uint8)
        buffer[::4096] = 1
        del buffer

    return touch


def per_gb(kind: str, gb: float, idle: float, folder: Path) -> tuple[float, float]:
    """(reused at once, free for ``idle`` s) kernel seconds per GB of one ``kind``."""
    path = folder / ".memory_cost.bin"
    work = page_cache(path, gb) if kind == "page cache" else process_memory(gb)

    def freed() -> None:
        path.unlink(missing_ok=True)

    work()
    freed()
    at_once = system_seconds(work) / gb
    freed()
    time.sleep(idle)
    after_idle = system_seconds(work) / gb
    freed()
    return at_once, after_idle


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def reported_gb() -> float | None:
    """GB of free memory this guest has reported to its host so far, if it reports."""
    return int(REPORTING.read_text()) / (1 << 20) if REPORTING.exists() else None


def main(argv: list[str]) -> None:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, nargs="+", default=[1.0, 2.0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle", type=float, default=20.0, help="seconds the memory stays free")
    p.add_argument("--dir", type=Path, default=Path.cwd(), help="where the file goes")
    a = p.parse_args(argv)
    sizes, rounds, idle = ([0.25], 1, 2.0) if a.quick else (a.gb, a.rounds, a.idle)
    reported_before = reported_gb()
    lines, loads = [], []
    for kind in ("page cache", "process memory"):
        for gb in sizes:
            samples = [per_gb(kind, gb, idle, a.dir) for _ in range(rounds)]
            loads.append(common.load_average())
            at_once = [s[0] for s in samples]
            after_idle = [s[1] for s in samples]
            ratios = [late / max(now, 1e-3) for now, late in samples]
            lines.append(
                f"| {kind} | {gb:g} | {spread(at_once)} | {spread(after_idle)} "
                f"| {statistics.median(ratios):.1f}x |"
            )
            print(lines[-1], flush=True)
    reported_after = reported_gb()
    reporting = (
        "This kernel has no free page reporting."
        if reported_before is None or reported_after is None
        else f"Free memory reported to the host during the run: "
        f"{reported_after - reported_before:.1f} GB."
    )
    section = common.tidy(f"""{common.heading(SECTION, SCRIPT, argv, loads)}

Kernel CPU seconds per GB, median (range) of {rounds} rounds; the memory was free for
{idle:g} s before the second column's writes. {reporting}

| memory | GB | reused at once s/GB | free for a while s/GB | ratio |
|---|---:|---:|---:|---:|
{chr(10).join(lines)}
""")
    write = not a.quick if a.write is None else a.write
    common.publish(section, SECTION, a.results, write)


if __name__ == "__main__":
    main(sys.argv[1:])
