"""What the store's durability mode buys a one-pass capture: GradDot through the store
(capture of the training rows, then scoring 8 queries) against the floor, one plain
forward and backward over the same rows, in one process, modes alternated by round.

    python benchmarks/store_durability.py --rows 64 256 --rounds 3

Modes: ``step-queued`` (each shard fsynced before its step is listed, shards queued for
the disk up to 256 MiB: what ``tda capture`` did before ``end`` became its default),
``end`` (the one-pass default: one fsync pass once the capture has ended, on a thread of
its own while the scoring runs; ``end-durable`` is the same run timed until that pass is
done too, as a process that exits right after scoring waits for it) and ``none`` (page
cache only). The peer harness's
Llama-style decoder (``store_integrity.model``), micro-batches of 32, one step each; with
``--slow-fsync S`` each fsync (the shards', the index's, the header's) is ``S`` seconds
longer (a slow disk). Reports each mode's
ratio to the floor of its round: median (range), and the load average of each round.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from common import base_parser, load_average
from store_integrity import model

from tda_plugins import CaptureEngine, LayerSelection, causal_lm_example_losses
from tda_plugins.methods import method_by_name
from tda_plugins.session.dataset import IN_FLIGHT_BYTES
from tda_plugins.store import GradientStore, StoreReader, io, writer

MODES = {"step-queued": "step", "end": "end", "none": "none"}
#: Each mode's columns: scored, and for ``end`` also durable.
COLUMNS = ["step-queued", "end", "end-durable", "none"]


def floor(net: torch.nn.Module, rows: torch.Tensor) -> float:
    """Seconds of one plain forward and backward over ``rows`` in micro-batches of 32."""
    start = time.perf_counter()
    for batch in rows.split(32):
        causal_lm_example_losses(net(input_ids=batch).logits, batch).sum().backward()
    net.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def capture(net: torch.nn.Module, rows: torch.Tensor, path: Path, durability: str) -> GradientStore:
    """Capture ``rows`` into a new store at ``path`` (one step per micro-batch of 32)."""
    store = GradientStore(path, durability=durability, in_flight_bytes=IN_FLIGHT_BYTES)
    engine = CaptureEngine(
        net, layers=LayerSelection("linear"), consumers=[store], parameter_grads=False
    )
    with engine:
        for batch in rows.split(32):
            causal_lm_example_losses(net(input_ids=batch).logits, batch).sum().backward()
            engine.optimizer_step()
        engine.end()
    return store


def store_path(
    net: torch.nn.Module, rows: torch.Tensor, folder: Path, mode: str, queries: Path
) -> tuple[float, float]:
    """Seconds to capture ``rows`` with ``mode`` and score them against ``queries``, and
    until the store is as durable as its mode makes it."""
    start = time.perf_counter()
    store = capture(net, rows, folder / mode, MODES[mode])
    method_by_name("graddot").score(StoreReader(folder / mode), StoreReader(queries))
    scored = time.perf_counter() - start
    store.flush()
    return scored, time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slow-fsync", type=float, default=0.0)
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="where the stores go")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    net = model()
    real = writer.fsync_path

    def slow(target: Path) -> None:
        time.sleep(args.slow_fsync)
        real(target)

    with contextlib.ExitStack() as patches:
        if args.slow_fsync:  # every fsync: the store's own and its atomic writes'
            for module in (writer, io):
                patches.enter_context(mock.patch.object(module, "fsync_path", slow))
        for count in args.rows:
            rows = torch.randint(1, 4096, (count, 128), generator=torch.Generator().manual_seed(0))
            ratios: dict[str, list[float]] = {c: [] for c in COLUMNS}
            loads = []
            for r in range(args.rounds):
                with tempfile.TemporaryDirectory(dir=args.dir) as name:
                    folder = Path(name)
                    queries = folder / "queries"
                    capture(net, rows[:8], queries, "end").flush()
                    order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
                    before = floor(net, rows)
                    seconds = {mode: store_path(net, rows, folder, mode, queries) for mode in order}
                    base = (before + floor(net, rows)) / 2  # the floor before and after
                    for mode, (scored, durable) in seconds.items():
                        ratios[mode].append(scored / base)
                        if mode == "end":
                            ratios["end-durable"].append(durable / base)
                    loads.append(load_average())
                    print(
                        f"rows {count} round {r} floor {base:.2f}s load {loads[-1]:.1f} "
                        + " ".join(f"{c} {ratios[c][-1]:.2f}" for c in COLUMNS),
                        flush=True,
                    )
            cells = " | ".join(
                f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in ratios.values()
            )
            print(
                f"| {count} | slow-fsync {args.slow_fsync:g} s | {cells} "
                f"| load {', '.join(f'{x:.1f}' for x in loads)} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
