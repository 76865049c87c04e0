"""What the store's fit cache buys a second K-FAC/EK-FAC run on the same store, and what
keeping it costs the first.

SmolLM2-135M's shape built from its config (random init; the fit's cost depends on the
factors' sizes only) with PEFT LoRA r=8 on every linear layer, training rows captured
with K-FAC statistics (``capture_examples(..., curvature=True)``) into a store under
``--out`` (default ``benchmarks/out/fit_cache``, a folder on the repository's disk, where a
user's ``run/grads`` would be), and 3 query rows. Per round and method, alternated: the
fit cache removed, ``attribute`` timed (the first run: it factorizes and keeps the
result, the time of that write measured inside it), then ``attribute`` again (it reads
the cache). Reported: medians (ranges) of the first run, its write, the second run, and
the ratios second / first and first / (first - write), the latter what keeping the cache
adds to a first run.

    python benchmarks/fit_cache.py --rows 40 160 --rounds 3
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from unittest import mock

import torch
from common import (
    REPO,
    base_parser,
    causal_lm,
    heading,
    llama,
    load_average,
    publish,
    tidy,
    token_rows,
    with_lora,
)

from tda_plugins import attribute, capture_examples
from tda_plugins.parallel.ranks import LayerTensors
from tda_plugins.precondition.fit_cache import CACHE_FOLDER, FitCache

SECTION = "## The fit cache: a second K-FAC/EK-FAC run on one store"
SMOLLM2 = llama(49152, hidden=576, intermediate=1536, layers=30, heads=9, num_key_value_heads=3)
TINY = llama(256, hidden=32, intermediate=64, layers=2, heads=2)


def timed_attribute(store: Path, queries: Path, method: str) -> tuple[float, float]:
    """Seconds of one ``attribute`` call, and of the fit cache's write within it."""
    writes: list[float] = []
    save = FitCache.save

    def timed_save(self: FitCache, fitted: Mapping[str, LayerTensors]) -> None:
        start = time.perf_counter()
        save(self, fitted)
        writes.append(time.perf_counter() - start)

    start = time.perf_counter()
    with mock.patch.object(FitCache, "save", timed_save):
        attribute(store, queries, method)
    return time.perf_counter() - start, sum(writes)


def spread(values: list[float]) -> str:
    """``median (min-max)``."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str]) -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[40, 160])
    p.add_argument("--methods", nargs="+", default=["ekfac", "kfac"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seq", type=int, default=96)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "fit_cache")
    args = p.parse_args(argv)
    config = TINY if args.quick else SMOLLM2
    rounds, row_counts = (1, [4]) if args.quick else (args.rounds, args.rows)
    model = with_lora(causal_lm("LlamaConfig", "LlamaForCausalLM", **config), rank=8)
    vocab = int(config["vocab_size"])
    lines = [
        "| rows | method | first run s | its cache write s | second run s | second / first "
        "| first / (first - write) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    loads = []
    for rows in row_counts:
        shutil.rmtree(args.out, ignore_errors=True)
        store, queries = args.out / "train", args.out / "queries"
        train_rows = [{"input_ids": r} for r in token_rows(rows, args.seq, vocab, seed=1).tolist()]
        query_rows = [{"input_ids": r} for r in token_rows(3, args.seq, vocab, seed=2).tolist()]
        capture_examples(model, train_rows, store, curvature=True, progress=False)
        capture_examples(model, query_rows, queries, progress=False)
        times: dict[str, list[tuple[float, float, float]]] = {m: [] for m in args.methods}
        for r in range(rounds):
            for method in args.methods[r % 2 :] + args.methods[: r % 2]:
                shutil.rmtree(store / CACHE_FOLDER, ignore_errors=True)
                first, write = timed_attribute(store, queries, method)
                second, _ = timed_attribute(store, queries, method)
                times[method].append((first, write, second))
                loads.append(load_average())
                print(
                    f"rows {rows} {method}: {first:.2f} s (write {write:.2f}), then {second:.2f} s",
                    flush=True,
                )
        for method, runs in times.items():
            first, write, second = (list(x) for x in zip(*runs, strict=True))
            cached = spread([s / f for f, _, s in runs])
            overhead = spread([f / (f - w) for f, w, _ in runs])
            lines.append(
                f"| {rows} | {method} | {spread(first)} | {spread(write)} | {spread(second)} | "
                f"{cached} | {overhead} |"
            )
    shutil.rmtree(args.out, ignore_errors=True)
    section = heading(SECTION, "benchmarks/fit_cache.py", argv, loads)
    publish(
        tidy(section + "\n\n" + "\n".join(lines)),
        SECTION,
        args.results,
        not args.quick if args.write is None else args.write,
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
