"""What the store's integrity checks cost, and what a one-pass capture's queue for the
disk buys: shard checksums on write and read, the fingerprint's weight digest, and shards
queued for the disk (``in_flight_bytes``, what ``tda capture`` uses) against one at a time
(what training uses), on the local disk and on a slow one.

    python benchmarks/store_integrity.py

Captures the peer harness's Llama-style decoder (hidden 256, 4 layers, vocabulary 4,096,
linear layers) over 64 and 256 rows of 128 tokens, micro-batches of 32, into a store on
the local disk, alternating rounds: the XXH3 checksum computed (the default) and replaced
by a constant (what the store did before); shards queued and one at a time, on the local
disk and with each fsync made ``--slow-fsync`` seconds longer (a slow disk); and scores
each store (GradDot against 8 queries) with and without its verification. Reports each
ratio's median over the rounds and its range.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from common import base_parser, causal_lm, command_line, machine_info, publish, utc_now

from tda_plugins import CaptureEngine, LayerSelection, causal_lm_example_losses
from tda_plugins.methods import method_by_name
from tda_plugins.session.dataset import IN_FLIGHT_BYTES
from tda_plugins.store import GradientStore, StoreReader, reader, writer
from tda_plugins.store.fingerprint import weights_digest

HEADING = (
    "## Store integrity and the disk queue: checksums, fingerprints, shards queued "
    "(benchmarks/store_integrity.py)"
)
NO_CHECKSUM = "0" * 16


def model() -> torch.nn.Module:
    return causal_lm(
        "LlamaConfig",
        "LlamaForCausalLM",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )


def capture(
    net: torch.nn.Module,
    rows: torch.Tensor,
    path: Path,
    checksums: bool = True,
    queued: bool = False,
    slow_fsync: float = 0.0,
) -> float:
    """Seconds to capture ``rows`` into a new store (one step per micro-batch of 32), its
    shards ``queued`` for the disk or one at a time, each fsync ``slow_fsync`` s longer."""
    real_fsync = writer.fsync_path

    def slow(target: Path) -> None:
        time.sleep(slow_fsync)
        real_fsync(target)

    patches = contextlib.ExitStack()
    if not checksums:
        patches.enter_context(mock.patch.object(writer, "file_checksum", lambda _: NO_CHECKSUM))
    if slow_fsync:
        patches.enter_context(mock.patch.object(writer, "fsync_path", slow))
    start = time.perf_counter()
    with patches:
        store = GradientStore(path, in_flight_bytes=IN_FLIGHT_BYTES if queued else None)
        engine = CaptureEngine(
            net, layers=LayerSelection("linear"), consumers=[store], parameter_grads=False
        )
        with engine:
            for batch in rows.split(32):
                logits = net(input_ids=batch).logits
                causal_lm_example_losses(logits, batch).sum().backward()
                engine.optimizer_step()
            engine.end()
    return time.perf_counter() - start


def score(path: Path, queries: Path, verify: bool) -> float:
    """Seconds of a GradDot scoring of the store against the queries (the shards'
    verification replaced by a no-op if not ``verify``)."""
    off = mock.patch.object(reader.StoreReader, "_verify", lambda self, shard: None)
    start = time.perf_counter()
    with contextlib.nullcontext() if verify else off:
        method_by_name("graddot").score(StoreReader(path), StoreReader(queries))
    return time.perf_counter() - start


def spread(ratios: list[float], digits: int) -> str:
    """``median (min-max)`` of ratios."""
    low, mid, high = min(ratios), statistics.median(ratios), max(ratios)
    return f"{mid:.{digits}f}x ({low:.{digits}f}-{high:.{digits}f})"


def main(argv: list[str]) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument(
        "--slow-fsync", type=float, default=0.5, help="seconds added to each fsync (a slow disk)"
    )
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    torch.set_num_threads(1)
    net = model()
    lines = [
        HEADING,
        "",
        f"Command: `{command_line('benchmarks/store_integrity.py', argv)}`",
        "",
        f"Date: {utc_now()}. Machine: {machine_info()}. Store on the local disk "
        f"(a temporary folder); {rounds} rounds, alternated.",
        "",
        "| rows | capture, checksums on / off: median (range) "
        "| capture, shards queued / one at a time: median (range) "
        f"| the same, each fsync +{args.slow_fsync:g} s (a slow disk) "
        "| GradDot scoring, verified / not: median (range) |",
        "|---:|---:|---:|---:|---:|",
    ]
    runs: dict[str, dict[str, Any]] = {
        "on": {},
        "off": {"checksums": False},
        "queued": {"queued": True},
        "slow": {"slow_fsync": args.slow_fsync},
        "slow-queued": {"queued": True, "slow_fsync": args.slow_fsync},
    }
    for count in args.rows:
        rows = torch.randint(1, 4096, (count, 128), generator=torch.Generator().manual_seed(0))
        writes, queues, slow_queues, reads = [], [], [], []
        with tempfile.TemporaryDirectory(dir=Path.cwd()) as folder:
            queries = Path(folder) / "queries"
            capture(net, rows[:8], queries)
            for r in range(rounds):
                times = {}
                order = list(runs) if r % 2 == 0 else list(reversed(runs))  # alternated
                for name in order:
                    times[name] = capture(net, rows, Path(folder) / f"{name}{r}", **runs[name])
                writes.append(times["on"] / times["off"])
                queues.append(times["queued"] / times["on"])
                slow_queues.append(times["slow-queued"] / times["slow"])
                store = Path(folder) / f"on{r}"
                reads.append(score(store, queries, True) / score(store, queries, False))
        lines.append(
            f"| {count} | {spread(writes, 3)} | {spread(queues, 3)} "
            f"| {spread(slow_queues, 3)} | {spread(reads, 2)} |"
        )
    layers = LayerSelection("linear").resolve(net)
    start = time.perf_counter()
    weights_digest(net, list(layers))
    size = sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20
    lines += [
        "",
        f"Weight digest of the captured layers (end of capture): "
        f"{time.perf_counter() - start:.3f} s for a {size:.0f} MB model.",
    ]
    write = args.write if args.write is not None else not args.quick
    publish("\n".join(lines), HEADING, args.results, write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
