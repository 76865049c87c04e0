"""Side by side with the peer libraries: time, peak RSS and agreement with the exact
reference, per library, method and model, on one workload (issue 6).

Workload (``benchmarks/peers/workload.py``): a GPT-2 and a Llama causal LM from configs
(about 10M parameters, seed 0, fp32, dropout off, tied embeddings), ``--train`` training
rows and 8 or 256 query rows of ``--seq`` random tokens, the attention and MLP linear
layers (no embedding, no head), each example's own summed token loss. On a CUDA GPU,
``--device cuda --dtype bf16 --models qwen2 --seq 512`` runs the larger configuration
(Qwen2-0.5B's shape from its config); times are then taken after a device synchronize,
and peaks are torch's allocated GPU memory instead of RSS.

Rows, per model and query count:

* **floor**: plain forward + backward, and forward only, over the same training and query
  rows, measured inside every cell's process between its runs;
* **graddot** (full-dimensional), **graddot_proj** (factor projection, k per side, or the
  nearest the library has), **kfac**, **ekfac**, for each library in
  ``benchmarks/peers/base.py:LIBRARIES``.

Each cell (model, library, method, query count) runs in a fresh child process: an untimed
warm-up on one micro-batch, then ``--rounds`` rounds of [floor forward + backward, forward
only, the library's whole capture-and-score call] in rotated order; medians are reported.
Peak RSS is the child's ``VmHWM`` over the library's calls (reset before them), model and
data included. Agreement: the first 8 query columns against the exact fp64 reference
(``benchmarks/peers/reference.py``, one backward per example, computed once per model and
size and cached in ``--out``): Spearman per query (mean and minimum) and
``max |s - r| / max |r|``. A targets table sets each of our ways (``ours``: through the
store on disk; ``ours-memory``: the store held in memory; ``ours-live``: scored inside
the backward) against the issue's targets.

Every invocation writes its JSON dump to ``--out``; ``--report`` renders the section from
several dumps (runs of the same sizes merged into one table), so that a comparison can be
run in parts that each fit in the time at hand.

Usage (the peers' venv, ``make bench``; our library alone runs in ``.venv``)::

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \\
        benchmarks/.venv-peers/bin/python benchmarks/bench_peers.py
    .venv/bin/python benchmarks/bench_peers.py --quick --libraries ours   # smoke
    benchmarks/.venv-peers/bin/python benchmarks/bench_peers.py --device cuda --dtype bf16 \\
        --models qwen2 --seq 512 --methods graddot_proj                   # on a GPU
    benchmarks/.venv-peers/bin/python benchmarks/bench_peers.py \\
        --report benchmarks/out/peers-A.json benchmarks/out/peers-B.json --notes notes.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from attribution import spearman
from common import (
    REPO,
    Stopwatch,
    base_parser,
    command_line,
    load_average,
    load_text,
    machine_info,
    parameter_count,
    phase_peak,
    publish,
    rotated,
    run_child,
    tidy,
    utc_now,
)
from peers.base import LIBRARIES, Unsupported, adapter, library_version
from peers.coverage import CellKey, Found, Gap, coverage_table, load_gaps
from peers.reference import reference_scores
from peers.workload import (
    DTYPES,
    METHODS,
    MODELS,
    Shape,
    floor_backward,
    floor_forward,
    make_problem,
)
from safetensors.torch import load_file, save_file
from torch import Tensor

SECTION = "## Peer comparison (benchmarks/bench_peers.py)"
INDEX_SECTION = "## Peer comparison: cell index (benchmarks/bench_peers.py --index)"
#: Where the published runs' dumps and the reasons for the cells none reached are kept.
DUMPS, GAPS = "benchmarks/peers/results", "benchmarks/peers/gaps.json"
SCRIPT = "benchmarks/bench_peers.py"
OUT = REPO / "benchmarks" / "out"
CHART = REPO / "benchmarks" / "peer_ratios.png"
#: Query columns compared with the reference (the first rows of every query set).
REF_QUERIES = 8
FLOOR, FORWARD, RUN = "floor", "forward", "run"


# -- one cell (child process) ----------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One measured configuration."""

    model: str
    library: str
    method: str
    queries: int

    @property
    def key(self) -> str:
        return f"{self.model}/{self.library}/{self.method}/q{self.queries}"


@dataclass
class CellResult:
    """What a cell's child reports. ``status``: ``ok``, ``unsupported`` or ``error``
    (``reason`` says why, with the library's version)."""

    cell: Cell
    status: str
    reason: str = ""
    note: str = ""
    samples: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)
    spearman: tuple[float, float] | None = None
    max_rel_err: float | None = None

    def median(self, phase: str, attr: str = "wall") -> float:
        """Median wall (or CPU) seconds of a phase."""
        return statistics.median(s[attr] for s in self.samples[phase])

    def ratio(self) -> float:
        """The library's call over the floor of the same process (median wall times)."""
        return self.median(RUN) / self.median(FLOOR)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> CellResult:
        rho = value.get("spearman")
        fields = {**value, "cell": Cell(**value["cell"]), "spearman": tuple(rho) if rho else None}
        return cls(**fields)


def agreement(scores: Tensor, reference: Tensor) -> tuple[tuple[float, float], float]:
    """Spearman (mean, min over query columns) and ``max |s - r| / max |r|`` of ``(Q, N)``
    scores against the ``(N, R)`` reference, over the first ``min(Q, R)`` queries."""
    columns = min(scores.shape[0], reference.shape[1])
    mine, ref = scores[:columns].T.double(), reference[:, :columns]
    rho = spearman(mine, ref)
    err = (mine - ref).abs().max() / ref.abs().max()
    return (float(rho.mean()), float(rho.min())), float(err)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; a timer stopped
    without this would time the launches)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def device_peak(peaks: dict[str, float], phase: str, device: torch.device) -> Iterator[None]:
    """:func:`phase_peak` of the process's RSS on the CPU; on a CUDA device, the peak of
    the memory torch allocated there (MB), the memory a GPU run is bounded by."""
    if device.type != "cuda":
        with phase_peak(peaks, phase):
            yield
        return
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        peaks[phase] = max(peaks.get(phase, 0.0), peak)


def run_cell(cell: Cell, shape: Shape, rounds: int, reference: Path) -> CellResult:
    """Body of ``--child``: warm-up, ``rounds`` rotated rounds, agreement."""
    try:
        peer = adapter(cell.library)
    except Unsupported as why:
        return CellResult(cell, "unsupported", reason=str(why))
    except ImportError as missing:
        reason = f"{library_version(cell.library)}: cannot import ({missing})"
        return CellResult(cell, "error", reason=reason)
    result = CellResult(cell, "ok", note=peer.notes.get(cell.method, ""))
    with tempfile.TemporaryDirectory(prefix="tda-peers-") as work:
        problem = make_problem(replace(shape, queries=cell.queries), Path(work))
        try:
            peer.check(cell.method)
            problem = peer.prepare(problem, cell.method)
            warm = problem.head(shape.batch, min(cell.queries, 2))
            floor_backward(warm)
            peer.scores(warm, cell.method)
            peer.cleanup(warm)
            scores = None
            phases: dict[str, Callable[[], Any]] = {
                FLOOR: lambda: floor_backward(problem),
                FORWARD: lambda: floor_forward(problem),
                RUN: lambda: peer.scores(problem, cell.method),
            }
            for round_ in range(rounds):
                for phase in rotated(list(phases), round_):
                    with device_peak(result.peaks, phase, problem.device), Stopwatch() as watch:
                        out = phases[phase]()
                        synchronize(problem.device)
                    result.samples.setdefault(phase, []).append(watch.sample.to_json())
                    if phase == RUN:
                        scores = out.detach().cpu()
                        peer.cleanup(problem)
        except Unsupported as why:
            return replace(result, status="unsupported", reason=str(why))
        except Exception as error:  # a peer's failure is a result, recorded in its cell
            last = traceback.format_exception_only(error)[-1].strip()
            reason = f"{peer.version_text()}: {last[:300]}"
            traceback.print_exc(file=sys.stderr)
            return replace(result, status="error", reason=reason)
    expected = (cell.queries, shape.train)
    if scores is None or tuple(scores.shape) != expected:
        got = None if scores is None else tuple(scores.shape)
        return replace(result, status="error", reason=f"scores of shape {got}, not {expected}")
    ref = load_file(reference)["graddot" if cell.method.startswith("graddot") else cell.method]
    result.spearman, result.max_rel_err = agreement(scores, ref)
    return result


def run_reference(shape: Shape, path: Path) -> None:
    """Body of ``--reference``: the exact scores against the first 8 queries, saved."""
    with tempfile.TemporaryDirectory(prefix="tda-peers-ref-") as work:
        problem = make_problem(replace(shape, queries=REF_QUERIES), Path(work))
        scores = reference_scores(problem, REF_QUERIES)
    save_file({k: v.contiguous() for k, v in scores.items()}, path)


# -- parent ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Resolved command-line settings."""

    models: tuple[str, ...]
    libraries: tuple[str, ...]
    methods: tuple[str, ...]
    query_counts: tuple[int, ...]
    shape: Shape
    rounds: int
    out: Path
    write: bool
    results: Path
    chart: Path | None

    def shape_flags(self) -> list[str]:
        """The workload sizes as command-line flags for a child."""
        s = self.shape
        flags = ["--train", str(s.train), "--seq", str(s.seq), "--batch", str(s.batch)]
        flags += ["--k", str(s.k), "--device", s.device, "--dtype", s.dtype]
        return flags + (["--tiny"] if s.tiny else [])

    def reference_path(self, model: str) -> Path:
        """Cache file of a model's reference scores (keyed by the sizes and the model
        dtype that change it)."""
        s = self.shape
        tag = f"{model}-{'tiny' if s.tiny else 'full'}-n{s.train}-t{s.seq}"
        tag += "" if s.dtype == "fp32" else f"-{s.dtype}"
        return self.out / f"peers-reference-{tag}.safetensors"


def cells_of(settings: Settings, model: str) -> list[Cell]:
    """Every cell of one model: per query count and method, ours first, then the peers."""
    return [
        Cell(model, library, method, queries)
        for queries in settings.query_counts
        for method in settings.methods
        for library in settings.libraries
    ]


@dataclass
class Run:
    """The results of one workload size (one invocation, or several merged by
    :func:`merged`), as its JSON dump keeps them (``--report`` renders several)."""

    commands: list[list[str]]
    dates: list[str]
    shape: Shape
    query_counts: tuple[int, ...]
    rounds: int
    params: dict[str, int]
    loads: list[float]
    results: list[CellResult]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "results": [r.to_json() for r in self.results]}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Run:
        return cls(
            **{
                **value,
                "shape": Shape(**value["shape"]),
                "query_counts": tuple(value["query_counts"]),
                "results": [CellResult.from_json(r) for r in value["results"]],
            }
        )


def merged(runs: Sequence[Run]) -> list[Run]:
    """Runs of the same workload size and query counts joined into one (cells of later
    runs replace earlier ones), in order of first appearance."""
    groups: dict[tuple[Shape, tuple[int, ...]], Run] = {}
    for run in runs:
        key = (replace(run.shape, model=""), run.query_counts)
        if key not in groups:
            groups[key] = replace(run, results=list(run.results))
            continue
        into = groups[key]
        cells = {r.cell: r for r in [*into.results, *run.results]}
        groups[key] = replace(
            into,
            commands=into.commands + run.commands,
            dates=into.dates + run.dates,
            params=into.params | run.params,
            loads=into.loads + run.loads,
            results=list(cells.values()),
        )
    return list(groups.values())


def collect(settings: Settings, argv: Sequence[str]) -> Run:
    """Run the reference and every cell's child."""
    script = Path(__file__).resolve()
    results: list[CellResult] = []
    params: dict[str, int] = {}
    loads: list[float] = []
    date = utc_now()
    settings.out.mkdir(parents=True, exist_ok=True)
    for model in settings.models:
        # counted on the CPU: the children's GPU memory is not shared with a parent's copy
        counted = replace(settings.shape, model=model, device="cpu")
        params[model] = parameter_count(make_problem(counted, settings.out).model)
        ref = settings.reference_path(model)
        if not ref.exists():
            print(f"  {model}: reference ...", flush=True)
            run_child(
                script, ["--reference", model, "--out", str(settings.out), *settings.shape_flags()]
            )
        for cell in cells_of(settings, model):
            print(f"  {cell.key} ...", flush=True)
            args = ["--child", json.dumps(asdict(cell)), "--rounds", str(settings.rounds)]
            args += ["--out", str(settings.out), *settings.shape_flags()]
            try:
                found = CellResult.from_json(run_child(script, args))
            except RuntimeError as died:  # killed (memory) or crashed outside the adapter
                tail = str(died).strip().splitlines()[-1][:300]
                found = CellResult(cell, "error", reason=f"child process died: {tail}")
            print(f"    {status_text(found)}", flush=True)
            results.append(found)
            loads.append(load_average())
    s = settings
    return Run([list(argv)], [date], s.shape, s.query_counts, s.rounds, params, loads, results)


def status_text(r: CellResult) -> str:
    """One line on a cell for the console."""
    if r.status != "ok":
        return f"{r.status}: {r.reason}"
    return (
        f"{r.median(RUN):.2f} s ({r.median(RUN) / r.median(FLOOR):.2f}x floor), "
        f"peak {r.peaks[RUN]:.0f} MB, Spearman {r.spearman[0]:.3f}"  # type: ignore[index]
    )


def versions(libraries: Sequence[str]) -> str:
    """``name version`` of torch, transformers and every library's distribution."""
    return ", ".join(library_version(n) for n in ["torch", "transformers", *libraries])


# -- tables and chart -----------------------------------------------------------------


def cell_text(r: CellResult, ours: CellResult | None) -> tuple[str, str, str, str, str]:
    """(time, x floor, x ours, peak RSS, agreement) cells of one result."""
    if r.status != "ok":
        return (f"{r.status}: {r.reason}", "—", "—", "—", "—")
    run, floor = r.median(RUN), r.median(FLOOR)
    vs_ours = "—"
    if ours is not None and ours.status == "ok" and r is not ours:
        vs_ours = f"{(run / floor) / (ours.median(RUN) / ours.median(FLOOR)):.2f}x"
    rho = r.spearman or (float("nan"), float("nan"))
    return (
        f"{run:.2f}",
        f"{run / floor:.2f}x",
        vs_ours,
        f"{r.peaks[RUN]:.0f} ({r.peaks[RUN] / r.peaks[FLOOR]:.2f}x)",
        f"{rho[0]:.3f} [{rho[1]:.3f}] / {r.max_rel_err:.2g}",
    )


def where(shape: Shape) -> str:
    """`` on cuda, bf16``: where a run ran, unless the CPU reference setting (fp32)."""
    return (
        ""
        if (shape.device, shape.dtype) == ("cpu", "fp32")
        else f" on {shape.device}, {shape.dtype}"
    )


def memory_name(shape: Shape) -> str:
    """What a run's peaks measure: the process's RSS, or on a GPU its allocated memory."""
    return "GPU memory" if shape.device == "cuda" else "RSS"


def results_table(results: list[CellResult], memory: str = "RSS") -> str:
    """One markdown row per cell, with the floor of the cell's own process; ``memory``
    names what the peaks measure (:func:`memory_name`)."""
    lines = [
        "| model | queries | method | library | note | time s (wall) | / floor "
        f"| / ours (floor-normalized) | peak {memory} MB (/ floor's) "
        "| Spearman mean [min] / max rel. err. | floor fwd+bwd s / fwd s (timed rounds) |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    ours = {
        (r.cell.model, r.cell.method, r.cell.queries): r
        for r in results
        if r.cell.library == "ours"
    }
    for r in results:
        c = r.cell
        floors = "—"
        if r.status == "ok":
            floors = f"{r.median(FLOOR):.2f} / {r.median(FORWARD):.2f} ({len(r.samples[RUN])})"
        texts = cell_text(r, ours.get((c.model, c.method, c.queries)))
        lines.append(
            f"| {c.model} | {c.queries} | {c.method} | {c.library} | {r.note} | "
            + " | ".join(texts)
            + f" | {floors} |"
        )
    return "\n".join(lines)


#: Chart panels: title -> (method, library) -> time over the floor.
Panels = dict[str, dict[tuple[str, str], float]]


def panel_title(model: str, train: int, queries: int) -> str:
    """A chart panel's title: the model and the workload's size."""
    return f"{model}, {train} train x {queries} queries"


def run_panels(runs: list[Run]) -> Panels:
    """One panel per (run, model, query count) of the runs' measured cells."""
    panels: Panels = {}
    for run in runs:
        for r in run.results:
            if r.status == "ok":
                c = r.cell
                title = panel_title(c.model, run.shape.train, c.queries)
                panels.setdefault(title, {})[(c.method, c.library)] = r.ratio()
    return panels


def draw_chart(panels: Panels, path: Path) -> None:
    """Bar chart of time / floor: one panel each, a group of bars per method, a bar per
    library (absent where the cell has no figure); log scale, so that a peer at 100x
    leaves the others readable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    libraries = list(dict.fromkeys(lib for cells in panels.values() for _, lib in cells))
    methods = list(dict.fromkeys(m for cells in panels.values() for m, _ in cells))
    columns = min(4, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    width = 0.8 / len(libraries)
    for ax, (title, cells) in zip(axes.flat, panels.items(), strict=False):
        for i, lib in enumerate(libraries):
            heights = [cells.get((method, lib), float("nan")) for method in methods]
            xs = [m + i * width for m in range(len(methods))]
            ax.bar(xs, heights, width, label=lib)
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([m + 0.4 - width / 2 for m in range(len(methods))], methods)
        ax.set_title(title)
        ax.set_ylabel("time / floor (forward + backward)")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class Target:
    """The issue's target for one row: ours within ``floor`` x the floor (``None``: no
    such target) and the fastest peer at least ``lead`` x slower than ours."""

    floor: float | None
    lead: float


def target_of(method: str, queries: int) -> Target:
    """(1)-(2): within 1.2x of the floor, no slower than any peer; (3): within 2x of the
    floor, 1.5x faster than the fastest peer; (1')-(3'), many queries: 3x faster."""
    if queries > REF_QUERIES:
        return Target(None, 3.0)
    return Target(1.2, 1.0) if method.startswith("graddot") else Target(2.0, 1.5)


def met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def targets_table(results: list[CellResult], memory: str = "RSS") -> str:
    """Per model, query count, method and each of our ways: ours against the floor and
    the fastest peer (floor-normalized times), and our peak ``memory`` against the
    lowest peer's."""
    lines = [
        "| model | queries | method | ours | ours / floor (target) | fastest peer (its / floor) "
        f"| fastest peer / ours (target) | time targets | ours {memory} / lowest peer's (6) |",
        "|---|---:|---|---|---:|---|---:|---|---:|",
    ]
    ok = [r for r in results if r.status == "ok"]
    for ours in (r for r in ok if LIBRARIES[r.cell.library].ours):
        c = ours.cell
        peers = [
            r
            for r in ok
            if not LIBRARIES[r.cell.library].ours and replace(r.cell, library=c.library) == c
        ]
        target = target_of(c.method, c.queries)
        within = target.floor is None or ours.ratio() <= target.floor
        bound = f" (<= {target.floor})" if target.floor is not None else ""
        head = f"| {c.model} | {c.queries} | {c.method} | {c.library} | {ours.ratio():.2f}x{bound} "
        if not peers:
            lines.append(head + f"| no peer ran | — | {met(within)} (floor only) | — |")
            continue
        fastest = min(peers, key=CellResult.ratio)
        lead = fastest.ratio() / ours.ratio()
        rss = ours.peaks[RUN] / min(r.peaks[RUN] for r in peers)
        lines.append(
            head + f"| {fastest.cell.library} ({fastest.ratio():.2f}x) "
            f"| {lead:.2f}x (>= {target.lead}) | {met(within and lead >= target.lead)} "
            f"| {rss:.2f} ({met(rss <= 1.0)}) |"
        )
    return "\n".join(lines)


def order_key(cell: Cell) -> tuple[str, int, int, int]:
    """Table order: model, query count, method, then library as listed in ``LIBRARIES``."""
    return (
        cell.model,
        cell.queries,
        METHODS.index(cell.method),
        list(LIBRARIES).index(cell.library),
    )


def run_text(run: Run) -> str:
    """One run's part of the section: commands, dates, load, sizes, tables."""
    s = run.shape
    models = ", ".join(f"{m} {p / 1e6:.2f}M parameters" for m, p in run.params.items())
    commands = "\n".join(f"    {command_line(SCRIPT, argv)}" for argv in run.commands)
    ordered = sorted(run.results, key=lambda r: order_key(r.cell))
    memory = memory_name(s)
    return f"""### {", ".join(run.params)}: {s.train} training rows x \
{" / ".join(map(str, run.query_counts))} queries{where(s)}

Commands:

{commands}

Dates: {", ".join(run.dates)}; {load_text(run.loads)}. Workload: {models}, {s.train} \
training rows and {" / ".join(map(str, run.query_counts))} query rows of {s.seq} random \
tokens, micro-batches of {s.batch}, projection k = {s.k} per side, {s.dtype} models on \
{s.device} (peaks: {memory}); timed rounds per cell in the last column.

Against the issue's targets (times normalized by each process's own floor):

{targets_table(ordered, memory)}

{results_table(ordered, memory)}
"""


def report(runs: list[Run], settings: Settings, notes: str) -> str:
    """The results section: the protocol once, then each run's tables."""
    libraries = list(dict.fromkeys(r.cell.library for run in runs for r in run.results))
    chart = ""
    if settings.chart is not None:
        chart = f"![time / floor per library]({link(settings.chart, settings.results)})"
    parts = "\n".join(run_text(run) for run in runs)
    return tidy(f"""{SECTION}

Machine: {machine_info()}. Versions: {versions(libraries)}.

Workload (`benchmarks/peers/workload.py`): GPT-2 / Llama causal LMs from configs (seed 0, \
fp32 on the CPU unless a run says otherwise, dropout off, tied embeddings), random token \
rows, attention and MLP linear layers \
only, each example's own summed token loss. Each cell is a fresh process: warm-up on one \
micro-batch, then rotated rounds of [floor forward + backward, forward only, the \
library's whole capture + score call]; medians. "/ floor" = the call over the floor \
(forward + backward over the same training and query rows) of the same process; "/ ours" \
= that ratio over ours for the same model, method and query count (each normalized by \
its own floor, so that load drift between processes cancels). Peak RSS = `VmHWM` over \
the library's calls (reset before them), model and data included, and its ratio to the \
floor pass's (on a CUDA device: torch's peak allocated GPU memory). Agreement = the \
first {REF_QUERIES} query columns against the exact fp64 \
reference (`benchmarks/peers/reference.py`: one backward per example, streamed; damping \
0.1 x mean eigenvalue per factor, biases included): Spearman per query, mean [min], and \
max |s - r| / max |r|; projected rows are compared with the exact full-dimensional \
GradDot. A cell that could not run says why.

{notes}

{parts}

{chart}
""")


def latest_cells(
    dumps: Sequence[tuple[str, Run]],
) -> tuple[dict[Shape, dict[CellKey, Found]], dict[tuple[str, str], Found]]:
    """Per workload size (the shape without its model), what each cell's latest run
    reported (dumps in order, later ones replacing earlier ones); and the latest
    ``unsupported`` report of each (library, method), which holds at every size."""
    sizes: dict[Shape, dict[CellKey, Found]] = {}
    standing: dict[tuple[str, str], Found] = {}
    for name, run in dumps:
        found = sizes.setdefault(replace(run.shape, model=""), {})
        for r in run.results:
            ratio = r.ratio() if r.status == "ok" else None
            key = (r.cell.model, r.cell.library, r.cell.method, r.cell.queries)
            found[key] = Found(r.status, name, ratio, r.reason)
            if r.status == "unsupported":
                standing[(r.cell.library, r.cell.method)] = found[key]
    return sizes, standing


def link(target: Path, page: Path) -> str:
    """``target`` as a markdown link written in the file ``page`` (relative to its folder:
    the results file may live in another folder than the chart)."""
    return Path(os.path.relpath(target.resolve(), page.resolve().parent)).as_posix()


def index_panels(dumps: Sequence[tuple[str, Run]]) -> Panels:
    """The cell index's latest figures as chart panels, one per (training rows, model,
    query count), larger workloads first."""
    cells = [
        (shape.train, key, found.ratio)
        for shape, by_key in latest_cells(dumps)[0].items()
        for key, found in by_key.items()
        if found.ratio is not None
    ]
    panels: Panels = {}
    for train, (model, library, method, queries), ratio in sorted(
        cells, key=lambda c: (-c[0], c[1][0], c[1][3])
    ):
        panels.setdefault(panel_title(model, train, queries), {})[(method, library)] = ratio
    return panels


def index_text(dumps: Sequence[tuple[str, Run]], settings: Settings, gaps: Sequence[Gap]) -> str:
    """The cell index section: per workload size, every (model, queries, method) x
    library cell with its latest figure (dumps in order, later ones replacing earlier
    ones) or the reason it is missing, below a link to the chart of those figures."""
    sizes, standing = latest_cells(dumps)
    parts = []
    for shape, found in sorted(sizes.items(), key=lambda item: -item[0].train):
        # the asked models, and any other a run measured at this size (qwen2 on a GPU)
        ran = {model for model, *_ in found}
        models = [m for m in MODELS if m in settings.models or m in ran]
        axes = (models, settings.query_counts, settings.methods, settings.libraries)
        tiny = " (tiny models)" if shape.tiny else ""
        parts.append(
            f"### {shape.train} training rows of {shape.seq} tokens{tiny}{where(shape)}\n\n"
            + coverage_table(shape.train, found, axes, standing, gaps)
        )
    chart = ""
    if settings.chart is not None:
        chart = (
            f"![time / floor: each cell's latest figure]({link(settings.chart, settings.results)})"
        )
    body = "\n\n".join(parts)
    # the dumps' glob unquoted, for the shell to expand (in date order)
    command = command_line(SCRIPT, []) + f" --report {DUMPS}/peers-*.json --index {GAPS}"
    return tidy(f"""{INDEX_SECTION}

Every workload x library cell of the peer comparison, one table per training-set size: \
the latest measured time over the floor of its own process (the full rows, with peak \
RSS and agreement, are in each run's section and in the JSON dumps named below), or the \
reason the cell is missing. (0) the floor is measured inside every cell; (6) peak RSS \
comes with every measured cell; (4) capture in training and (5) selection have their own \
scripts (`peer_capture.py`, `peer_selection.py`). \
The runs behind one row may come from different machines: every ratio is to the floor \
of its own process, not to the other cells'.

Command: `{command}`

{chart}

{body}
""")


# -- command line ----------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> tuple[Settings, argparse.Namespace]:
    """Parse the command line."""
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", nargs="+", choices=list(MODELS), help="default gpt2 and llama (the CPU pair)"
    )
    p.add_argument("--libraries", nargs="+", choices=list(LIBRARIES), help="default all")
    p.add_argument("--methods", nargs="+", choices=METHODS, help="default all four")
    p.add_argument("--queries", nargs="+", type=int, help="query counts (default 8 256)")
    p.add_argument("--train", type=int, help="training rows (default 256; quick 8)")
    p.add_argument("--seq", type=int, help="tokens per row (default 128; quick 16)")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size")
    p.add_argument("--k", type=int, default=16, help="factor projection per side")
    p.add_argument("--rounds", type=int, help="timed rounds per cell (default 3; quick 1)")
    p.add_argument("--tiny", action="store_true", help="tiny models (implied by --quick)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where it all runs")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="the models' dtype")
    p.add_argument("--out", type=Path, default=OUT, help="JSON and reference cache folder")
    p.add_argument("--chart", default=str(CHART), help="PNG of the ratios ('' = none)")
    p.add_argument(
        "--report",
        nargs="+",
        type=Path,
        help="render the section from these JSON dumps of earlier runs (runs nothing)",
    )
    p.add_argument("--notes", type=Path, help="markdown inserted above the runs' tables")
    p.add_argument(
        "--index",
        type=Path,
        metavar="GAPS",
        help="with --report: render the cell index instead, GAPS (JSON) explaining the "
        "cells no run reached",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--reference", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    quick = a.quick
    shape = Shape(
        model="gpt2",
        tiny=a.tiny or quick,
        train=a.train or (8 if quick else 256),
        seq=a.seq or (16 if quick else 128),
        batch=a.batch,
        k=a.k,
        device=a.device,
        dtype=a.dtype,
    )
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device cuda, but this torch {torch.__version__} sees no CUDA device; run on a "
            "GPU machine with a CUDA build of torch, or leave --device at cpu"
        )
    settings = Settings(
        models=tuple(a.models or (["gpt2"] if quick else ["gpt2", "llama"])),
        libraries=tuple(a.libraries or (["ours"] if quick else list(LIBRARIES))),
        methods=tuple(a.methods or METHODS),
        query_counts=tuple(a.queries or ([4] if quick else [8, 256])),
        shape=shape,
        rounds=a.rounds or (1 if quick else 3),
        out=a.out,
        write=a.write if a.write is not None else not quick,
        results=a.results,
        chart=Path(a.chart) if a.chart else None,
    )
    return settings, a


def fresh_dump_path(folder: Path, date: str) -> Path:
    """``peers-<date>.json`` in ``folder``, with ``-2``, ``-3``... where runs that ended
    in the same minute already wrote one (never overwrite a run's results)."""
    stem = "peers-" + date.replace(" ", "_").replace(":", "")
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    return path


def main(argv: Sequence[str]) -> None:
    """Run the comparison, write JSON, the results section and the chart."""
    settings, args = parse_args(argv)
    torch.set_num_threads(1)
    if args.reference:
        shape = replace(settings.shape, model=args.reference)
        run_reference(shape, settings.reference_path(args.reference))
        print(json.dumps({"ok": True}))
        return
    if args.child:
        cell = Cell(**json.loads(args.child))
        shape = replace(settings.shape, model=cell.model)
        found = run_cell(cell, shape, settings.rounds, settings.reference_path(cell.model))
        print(json.dumps(found.to_json()))
        return
    if args.index:
        if not args.report:
            raise SystemExit("--index renders the dumps given with --report: pass both")
        dumps = [(p.name, Run.from_json(json.loads(p.read_text()))) for p in args.report]
        index = index_text(dumps, settings, load_gaps(args.index))
        publish(index, INDEX_SECTION, settings.results, settings.write)
        if settings.chart is not None and settings.write:
            draw_chart(index_panels(dumps), settings.chart)
        return
    if args.report:
        runs = merged([Run.from_json(json.loads(path.read_text())) for path in args.report])
    else:
        runs = [collect(settings, argv)]
        dump = fresh_dump_path(settings.out, utc_now())
        dump.write_text(json.dumps(runs[0].to_json(), indent=1))
        print(f"wrote {dump}")
    if settings.chart is not None and settings.write:
        draw_chart(run_panels(runs), settings.chart)
    notes = args.notes.read_text().strip() if args.notes else ""
    publish(report(runs, settings, notes), SECTION, settings.results, settings.write)


if __name__ == "__main__":
    main(sys.argv[1:])
