"""Attribution throughput: capture and scoring time per method, peak RSS, and agreement.

What is measured (docs/design.md section 12), per model (tiny GPT-2 and Llama from configs,
random init, seed 0, fp32) and per method, on 256 training sequences scored against 8
query sequences of 128 tokens:

* **capture**: writing the training store (256 examples) and the query store (8) in
  micro-batches of 8 -- forward, backward with the engine's hooks, store shards, and the
  inline K-FAC statistics where the method needs them (K-FAC, EK-FAC, LoGra); for LESS,
  also saving the AdamW moments (``save_adam_state``) after a few AdamW steps;
* **scoring**: ``method.score(store, queries)`` (fitting the preconditioner included);
* **floor**: plain forward + backward over the same 256 + 8 sequences, same micro-batches,
  no engine. Capture and scoring times are reported as ratios to the floor measured in
  the same process, in rounds that alternate floor and capture (A B A B, order rotated).

Each measurement is a sum over 33 micro-batches; ``--rounds`` interleaved rounds (default
3, each 2-3 floors long) follow an untimed warm-up round on a few micro-batches, and the
median is reported. Variants: exact gradients ("full") and factor projection
``k_a = k_g = 16`` in the hook ("proj") where the method allows it (LoGra is K-FAC on
the projected store; LESS refuses projected stores, as it needs the Adam state entry by
entry). Agreement: Spearman rank correlation (torch: ranks, then Pearson) of projected
vs full scores of the same method, per query column, mean and minimum over the 8
queries; LoGra is compared with full K-FAC.

Processes and memory: methods that share one capture run in one fresh child process per
model -- first-order (GradDot, GradCos, TracIn), curvature (K-FAC, EK-FAC, LoGra), LESS --
so that each capture runs once per round. Peak RSS is measured per phase inside the
child: freed heap is returned (``malloc_trim``) and the high-water mark reset
(``/proc/self/clear_refs``) before each phase, and ``VmHWM`` read after it; a method's
peak is the larger of its capture's and its scoring's, compared with the floor's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import common
import torch
from common import llama
from peers.workload import ModelSpec, spec_model
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from tda_plugins import CaptureEngine, LayerSelection, ProjectionConfig, causal_lm_example_losses
from tda_plugins.capture import CaptureConsumer
from tda_plugins.methods import Scores, method_by_name
from tda_plugins.precondition import CurvatureAccumulator
from tda_plugins.precondition.adam import save_adam_state
from tda_plugins.session.dataset import IN_FLIGHT_BYTES
from tda_plugins.store import GradientStore, StoreReader

SECTION = "## Attribution throughput (benchmarks/attribution.py)"
SCRIPT = "benchmarks/attribution.py"
FLOOR = "floor"
FULL = "full"
PROJ = "proj"
Batch = dict[str, Tensor]
T = TypeVar("T")


# -- what is measured ------------------------------------------------------------------


MODELS: dict[str, ModelSpec] = {
    "gpt2": ModelSpec(
        "GPT2Config",
        "GPT2LMHeadModel",
        full=dict(vocab_size=2048, n_embd=128, n_layer=2, n_head=4),
        tiny=dict(vocab_size=128, n_embd=32, n_layer=1, n_head=2),
        note="Conv1D layers; lm_head tied to wte, so kind='linear' leaves it out",
    ),
    "llama": ModelSpec(
        "LlamaConfig",
        "LlamaForCausalLM",
        full=llama(2048, hidden=128, intermediate=352, layers=2, heads=4, tie_word_embeddings=True),
        tiny=llama(128, hidden=32, intermediate=64, layers=1, heads=2, tie_word_embeddings=True),
        note="lm_head tied to embed_tokens, so kind='linear' leaves it out",
    ),
}


@dataclass(frozen=True)
class MethodSpec:
    """A registered attribution method, the variants it runs in, and what its projected
    scores are compared with (``method/variant``)."""

    name: str
    variants: tuple[str, ...]
    reference: str | None
    note: str = ""


@dataclass(frozen=True)
class Group:
    """Methods sharing one capture, run together in one child process per model."""

    name: str
    methods: tuple[MethodSpec, ...]
    curvature: bool = False
    adam: bool = False

    @property
    def variants(self) -> tuple[str, ...]:
        """Store variants this group captures, full first."""
        found = {v for m in self.methods for v in m.variants}
        return tuple(v for v in (FULL, PROJ) if v in found)


GROUPS: dict[str, Group] = {
    "first-order": Group(
        "first-order",
        methods=(
            MethodSpec("graddot", (FULL, PROJ), f"graddot/{FULL}"),
            MethodSpec("gradcos", (FULL, PROJ), f"gradcos/{FULL}"),
            MethodSpec("tracin", (FULL, PROJ), f"tracin/{FULL}", "1 checkpoint"),
        ),
    ),
    "curvature": Group(
        "curvature",
        curvature=True,
        methods=(
            MethodSpec("kfac", (FULL, PROJ), f"kfac/{FULL}"),
            MethodSpec("ekfac", (FULL, PROJ), f"ekfac/{FULL}"),
            MethodSpec("logra", (PROJ,), f"kfac/{FULL}", "K-FAC on the projected store"),
        ),
    ),
    "less": Group(
        "less",
        adam=True,
        methods=(MethodSpec("less", (FULL,), None, "refuses projected stores"),),
    ),
}


@dataclass(frozen=True)
class Settings:
    """Resolved command-line settings."""

    models: tuple[str, ...]
    groups: tuple[str, ...]
    train: int
    queries: int
    seq: int
    batch: int
    k: int
    rounds: int
    adam_steps: int
    quick: bool
    write: bool
    results: Path

    def child_flags(self) -> list[str]:
        """The settings a child process needs, as command-line flags."""
        flags = ["--train", str(self.train), "--queries", str(self.queries)]
        flags += ["--seq", str(self.seq), "--batch", str(self.batch), "--k", str(self.k)]
        flags += ["--rounds", str(self.rounds), "--adam-steps", str(self.adam_steps)]
        return flags + (["--quick"] if self.quick else [])


# -- model, data, floor and capture (child process) ------------------------------------


def micro_batches(rows: Tensor, batch: int) -> list[Batch]:
    """Consecutive micro-batches of ``batch`` rows (all-ones mask, labels = inputs)."""
    out = []
    for start in range(0, rows.shape[0], batch):
        ids = rows[start : start + batch]
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


@dataclass(frozen=True)
class Data:
    """Training and query micro-batches of one model."""

    train: list[Batch]
    queries: list[Batch]

    def head(self, count: int) -> Data:
        """The first ``count`` training micro-batches and all queries (warm-up)."""
        return Data(self.train[:count], self.queries)


def make_data(spec: ModelSpec, settings: Settings) -> Data:
    """Random token sequences (distinct seeds for training and queries)."""
    vocab = int(spec.config(tiny=settings.quick)["vocab_size"])
    train = common.token_rows(settings.train, settings.seq, vocab, seed=1)
    queries = common.token_rows(settings.queries, settings.seq, vocab, seed=2)
    return Data(micro_batches(train, settings.batch), micro_batches(queries, settings.batch))


def summed_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Sum over the micro-batch of each example's own summed next-token loss."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return causal_lm_example_losses(logits, batch["labels"]).sum()


def floor_pass(model: nn.Module, data: Data) -> None:
    """Plain forward + backward over every training and query micro-batch."""
    for batch in [*data.train, *data.queries]:
        summed_loss(model, batch).backward()
        model.zero_grad(set_to_none=True)


def capture_store(
    model: nn.Module,
    batches: list[Batch],
    root: Path,
    projection: ProjectionConfig | None,
    curvature: bool,
    optimizer: torch.optim.Optimizer | None = None,
    layers: LayerSelection | None = None,
    curvature_head: bool = False,
) -> StoreReader:
    """One committed step per micro-batch into a new store at ``root`` (``layers``,
    default linear layers), written as ``capture_examples`` writes a one-pass store
    (shards queued for the disk, made durable once the capture has ended); inline K-FAC
    statistics with ``curvature`` (``curvature_head``: an untied LM head's dense output
    factor, not its diagonal); AdamW moments when ``optimizer`` is given."""
    store = GradientStore(root, durability="end", in_flight_bytes=IN_FLIGHT_BYTES)
    consumers: list[CaptureConsumer] = [store]
    if curvature:
        consumers.append(
            CurvatureAccumulator(root, curvature_head=curvature_head, durability="end")
        )
    layers = layers or LayerSelection(kind="linear")
    with CaptureEngine(
        model, layers=layers, projection=projection, consumers=consumers, parameter_grads=False
    ) as engine:
        for batch in batches:
            summed_loss(model, batch).backward()
            engine.optimizer_step()
            model.zero_grad(set_to_none=True)
        engine.end()
        if optimizer is not None:
            save_adam_state(root, engine, optimizer)
    return StoreReader(root)


def adam_steps(model: nn.Module, data: Data, steps: int) -> torch.optim.AdamW:
    """A few AdamW steps on the training micro-batches (LESS needs the optimizer state)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        summed_loss(model, data.train[step % len(data.train)]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def directory_mb(path: Path) -> float:
    """Total size of the files under ``path``, in MB."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


# -- one group of methods on one model (child process) ---------------------------------


@dataclass
class GroupRun:
    """Timings, peaks and store sizes of one group's child, keyed by phase name:
    ``floor``, ``capture/<variant>``, ``score/<method>/<variant>``."""

    samples: dict[str, list[common.Sample]]
    peaks: dict[str, float]
    store_mb: dict[str, float]


class GroupBench:
    """Runs the floor, captures and scorings of one :class:`Group` on one model."""

    def __init__(self, spec: ModelSpec, group: Group, settings: Settings, work: Path):
        self.group = group
        self.settings = settings
        self.work = work
        self.model = spec_model(spec, tiny=settings.quick, seq=settings.seq)
        self.data = make_data(spec, settings)
        self.optimizer = (
            adam_steps(self.model, self.data, settings.adam_steps) if group.adam else None
        )
        self.projection = ProjectionConfig(kind="factor", k_a=settings.k, k_g=settings.k)
        self.run = GroupRun({}, {}, {})

    def variant_projection(self, variant: str) -> ProjectionConfig | None:
        """The projection of a store variant."""
        return self.projection if variant == PROJ else None

    def capture(self, variant: str, data: Data) -> tuple[StoreReader, StoreReader]:
        """Training store (with the group's extras) and query store of one variant."""
        root = self.work / variant
        shutil.rmtree(root, ignore_errors=True)
        projection = self.variant_projection(variant)
        train = capture_store(
            self.model, data.train, root / "train", projection, self.group.curvature, self.optimizer
        )
        queries = capture_store(self.model, data.queries, root / "queries", projection, False)
        return train, queries

    def methods_of(self, variant: str) -> Iterator[MethodSpec]:
        """The group's methods that run on ``variant``."""
        return (m for m in self.group.methods if variant in m.variants)

    def timed(self, phase: str, work: Callable[[], T]) -> T:
        """Run ``work()``; record its wall/CPU time and peak RSS under ``phase``."""
        with common.phase_peak(self.run.peaks, phase), common.Stopwatch() as watch:
            result = work()
        self.run.samples.setdefault(phase, []).append(watch.sample)
        return result

    def variant_round(self, variant: str, keep_scores: Path | None) -> None:
        """Capture one variant, score each of its methods, drop the stores."""
        train, queries = self.timed(f"capture/{variant}", lambda: self.capture(variant, self.data))
        self.run.store_mb[variant] = directory_mb(train.root) + directory_mb(queries.root)
        for method in self.methods_of(variant):
            score = partial(method_by_name(method.name).score, train, queries)
            scores = self.timed(f"score/{method.name}/{variant}", score)
            if keep_scores is not None:
                save_scores(scores, keep_scores / f"{method.name}-{variant}.safetensors")
        shutil.rmtree(self.work / variant, ignore_errors=True)

    def warm_up(self) -> None:
        """One untimed pass of every phase on two training micro-batches."""
        small = self.data.head(2)
        floor_pass(self.model, small)
        for variant in self.group.variants:
            train, queries = self.capture(variant, small)
            for method in self.methods_of(variant):
                method_by_name(method.name).score(train, queries)
            shutil.rmtree(self.work / variant, ignore_errors=True)

    def measure(self, keep_scores: Path) -> GroupRun:
        """Warm-up, then ``rounds`` rounds of floor and each variant, order rotated."""
        self.warm_up()
        slots = [FLOOR, *self.group.variants]
        for round_ in range(self.settings.rounds):
            last = round_ == self.settings.rounds - 1
            for slot in common.rotated(slots, round_):
                if slot == FLOOR:
                    self.timed(FLOOR, lambda: floor_pass(self.model, self.data))
                else:
                    self.variant_round(slot, keep_scores if last else None)
        return self.run


def save_scores(scores: Scores, path: Path) -> None:
    """Score matrix with its ids (safetensors, no pickle)."""
    tensors = {"train_ids": scores.train_ids, "query_ids": scores.query_ids}
    save_file({**tensors, "values": scores.values.contiguous()}, path)


def group_child(model_name: str, group_name: str, settings: Settings, out: Path) -> dict[str, Any]:
    """Body of ``--child``: one group's measurements on one model, as JSON-ready data."""
    spec = MODELS[model_name]
    keep = out / model_name
    keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tda-attr-") as work:
        bench = GroupBench(spec, GROUPS[group_name], settings, Path(work))
        run = bench.measure(keep)
        layers = LayerSelection(kind="linear").resolve(bench.model)
    return {
        "params": common.parameter_count(bench.model),
        "layers": len(layers),
        "samples": {k: [s.to_json() for s in v] for k, v in run.samples.items()},
        "peaks": run.peaks,
        "store_mb": run.store_mb,
    }


# -- agreement -------------------------------------------------------------------------


def ranks(x: Tensor) -> Tensor:
    """Ranks ``0..N-1`` of each column of ``(N, M)`` ``x`` (ties broken by position)."""
    order = x.argsort(dim=0, stable=True)
    positions = torch.arange(x.shape[0], dtype=torch.float64).unsqueeze(1).expand_as(x)
    return torch.empty_like(x, dtype=torch.float64).scatter_(0, order, positions.contiguous())


def pearson(a: Tensor, b: Tensor) -> Tensor:
    """``(M,)`` Pearson correlation of matching columns of two ``(N, M)`` tensors."""
    a = a.double() - a.double().mean(dim=0)
    b = b.double() - b.double().mean(dim=0)
    return (a * b).sum(dim=0) / (a.norm(dim=0) * b.norm(dim=0)).clamp_min(1e-300)


def spearman(a: Tensor, b: Tensor) -> Tensor:
    """``(M,)`` Spearman rank correlation of matching columns: Pearson of the ranks."""
    return pearson(ranks(a), ranks(b))


def load_scores(path: Path) -> tuple[Tensor, Tensor]:
    """``(N, M)`` values with rows sorted by training id and columns by query id, and the
    sorted training ids."""
    tensors = load_file(path)
    rows, cols = tensors["train_ids"].argsort(), tensors["query_ids"].argsort()
    return tensors["values"][rows][:, cols], tensors["train_ids"][rows]


def agreement(out: Path, model: str, method: str, reference: str) -> tuple[float, float] | None:
    """Mean and minimum over queries of Spearman(projected ``method``, ``reference``)."""
    mine, ref = (
        out / model / f"{method}-{PROJ}.safetensors",
        out / model / f"{reference}.safetensors",
    )
    if not mine.exists() or not ref.exists():
        return None
    (a, ids_a), (b, ids_b) = load_scores(mine), load_scores(ref)
    if not torch.equal(ids_a, ids_b):
        raise RuntimeError(f"{mine.name} and {ref.name} hold different training examples")
    rho = spearman(a, b)
    return float(rho.mean()), float(rho.min())


# -- parent: run the children, build the table -----------------------------------------


@dataclass(frozen=True)
class Row:
    """One (model, method, variant) against its floor."""

    model: str
    method: str
    variant: str
    note: str
    capture: common.Sample
    score: common.Sample
    floor: common.Sample
    capture_peak_mb: float
    score_peak_mb: float
    floor_peak_mb: float
    store_mb: float
    rho: tuple[float, float] | None


def median_sample(samples: Sequence[common.Sample]) -> common.Sample:
    """Median wall and median CPU time (each taken separately)."""
    return common.Sample(common.median_of(samples, "wall"), common.median_of(samples, "cpu"))


def group_rows(model: str, group: Group, child: dict[str, Any], out: Path) -> list[Row]:
    """The rows of one group's child report."""
    samples = {k: [common.Sample.from_json(s) for s in v] for k, v in child["samples"].items()}
    peaks = child["peaks"]
    rows = []
    for method in group.methods:
        for variant in method.variants:
            score_phase = f"score/{method.name}/{variant}"
            reference = method.reference
            rho = None
            if variant == PROJ and reference is not None:
                rho = agreement(out, model, method.name, reference.replace("/", "-"))
            rows.append(
                Row(
                    model=model,
                    method=method.name,
                    variant=variant,
                    note=method.note,
                    capture=median_sample(samples[f"capture/{variant}"]),
                    score=median_sample(samples[score_phase]),
                    floor=median_sample(samples[FLOOR]),
                    capture_peak_mb=peaks[f"capture/{variant}"],
                    score_peak_mb=peaks[score_phase],
                    floor_peak_mb=peaks[FLOOR],
                    store_mb=child["store_mb"][variant],
                    rho=rho,
                )
            )
    return rows


@dataclass
class Collected:
    """Everything the parent gathered from its children."""

    rows: list[Row]
    models: dict[str, tuple[int, int]]
    floors: dict[str, list[common.Sample]]
    loads: list[float]


def collect(settings: Settings, out: Path) -> Collected:
    """Run every (model, group) child in turn and turn its report into rows."""
    found = Collected([], {}, {}, [])
    script = Path(__file__).resolve()
    for model in settings.models:
        children = {}
        for name in settings.groups:
            print(f"  {model}: {name} ...", flush=True)
            args = ["--child", model, name, "--out", str(out), *settings.child_flags()]
            children[name] = common.run_child(script, args)
            found.loads.append(common.load_average())
        for name, child in children.items():
            found.rows += group_rows(model, GROUPS[name], child, out)
            found.floors.setdefault(model, []).extend(
                common.Sample.from_json(s) for s in child["samples"][FLOOR]
            )
            found.models[model] = (child["params"], child["layers"])
    return found


def ratio(a: common.Sample, b: common.Sample) -> str:
    """``wall / CPU`` ratio of two medians."""
    return f"{a.wall / b.wall:.2f}x / {a.cpu / b.cpu:.2f}x"


def rho_text(rho: tuple[float, float] | None, variant: str) -> str:
    """Spearman cell: mean [min] over queries, or why there is none."""
    if rho is not None:
        return f"{rho[0]:.3f} [{rho[1]:.3f}]"
    return "reference" if variant == FULL else "—"


def results_table(rows: list[Row]) -> str:
    """The markdown table of capture / scoring times, memory and agreement."""
    lines = [
        "| model | method | variant | capture s (wall / CPU) | capture / floor (wall / CPU) "
        "| scoring s (wall / CPU) | scoring / floor (wall / CPU) | stores MB "
        "| peak RSS MB: capture / scoring (max / floor) | Spearman vs full, mean [min] |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        method = f"{r.method} ({r.note})" if r.note else r.method
        lines.append(
            f"| {r.model} | {method} | {r.variant} "
            f"| {r.capture.wall:.2f} / {r.capture.cpu:.2f} | {ratio(r.capture, r.floor)} "
            f"| {r.score.wall:.3f} / {r.score.cpu:.3f} | {ratio(r.score, r.floor)} "
            f"| {r.store_mb:.1f} | {r.capture_peak_mb:.0f} / {r.score_peak_mb:.0f} "
            f"({max(r.capture_peak_mb, r.score_peak_mb) / r.floor_peak_mb:.2f}x) "
            f"| {rho_text(r.rho, r.variant)} |"
        )
    return "\n".join(lines)


def models_table(found: Collected, settings: Settings) -> str:
    """The models, their floors and what the engine captured."""
    lines = [
        "| model | config | params | captured linear layers | floor s, median (wall / CPU) |",
        "|---|---|---:|---:|---:|",
    ]
    for name, (params, layers) in found.models.items():
        spec_text = MODELS[name].text(tiny=settings.quick)
        floor = median_sample(found.floors[name])
        lines.append(
            f"| {name} | {spec_text} | {params / 1e6:.2f}M "
            f"| {layers} | {floor.wall:.2f} / {floor.cpu:.2f} |"
        )
    return "\n".join(lines)


def report(found: Collected, settings: Settings, argv: Sequence[str]) -> str:
    """The full markdown section for the results file."""
    return common.tidy(f"""{common.heading(SECTION, SCRIPT, argv, found.loads)}

{settings.train} training and {settings.queries} query sequences of {settings.seq} random \
tokens, micro-batches of {settings.batch}, all linear layers \
(`LayerSelection(kind="linear")`), fp32, each example's own summed token loss. **Floor** = \
plain forward + backward over the same {settings.train} + {settings.queries} sequences. \
**Capture** = training store + query store (shards fsynced to local disk) with the \
method's extras: inline K-FAC statistics (kfac, ekfac, logra), AdamW moments after \
{settings.adam_steps} AdamW steps (less). **Scoring** = `method_by_name(m).score(store, \
queries)`, preconditioner fit included. "proj" = `ProjectionConfig(kind="factor", \
k_a={settings.k}, k_g={settings.k})` in the hook. Times are medians of {settings.rounds} \
interleaved rounds (floor / captures, order rotated) after an untimed warm-up round, \
each a sum over {len(range(0, settings.train, settings.batch)) + 1} micro-batches; ratios \
are to the floor of the same child process, wall / CPU (`time.process_time`, which other \
processes on this shared machine disturb far less). Methods sharing a capture run in one \
fresh child process per model (first-order; curvature; less); **peak RSS** = `VmHWM` per \
phase (after `malloc_trim` and a `/proc/self/clear_refs` high-water reset), of the \
method's capture and of its scoring, and the larger of the two over the floor's (the \
process's peak during the floor pass, model and data included). **Spearman**: projected vs full \
scores of the same method (logra: vs full kfac) per query over the {settings.train} \
training examples (torch ranks, then Pearson), mean [min] over queries.

{models_table(found, settings)}

{results_table(found.rows)}
""")


# -- command line ----------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> tuple[Settings, argparse.Namespace]:
    """Parse and validate the command line into :class:`Settings`."""
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=[*MODELS, "both"], help="default both; quick gpt2")
    p.add_argument("--group", choices=[*GROUPS, "all"], default="all", help="method groups")
    p.add_argument("--train", type=int, help="training sequences (default 256; quick 16)")
    p.add_argument("--queries", type=int, help="query sequences (default 8; quick 4)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 128; quick 16)")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size")
    p.add_argument("--k", type=int, default=16, help="factor projection k_a = k_g")
    p.add_argument("--rounds", type=int, help="timed rounds (default 3; quick 1)")
    p.add_argument("--adam-steps", type=int, default=4, help="AdamW steps before LESS")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "GROUP"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    quick = a.quick
    settings = Settings(
        models=models_of(a.model, quick),
        groups=tuple(GROUPS) if a.group == "all" else (a.group,),
        train=a.train or (16 if quick else 256),
        queries=a.queries or (4 if quick else 8),
        seq=a.seq or (16 if quick else 128),
        batch=a.batch,
        k=a.k,
        rounds=a.rounds or (1 if quick else 3),
        adam_steps=a.adam_steps,
        quick=quick,
        write=a.write if a.write is not None else not quick,
        results=a.results,
    )
    names = ("train", "queries", "seq", "batch", "k", "rounds", "adam_steps")
    common.require_positive(p, settings, names)
    return settings, a


def models_of(choice: str | None, quick: bool) -> tuple[str, ...]:
    """The models to run: ``--model``, else both (GPT-2 alone for ``--quick``)."""
    if choice is None:
        return ("gpt2",) if quick else tuple(MODELS)
    return tuple(MODELS) if choice == "both" else (choice,)


def main(argv: Sequence[str]) -> None:
    """Run the benchmark, print the table and the command, update the results file."""
    settings, args = parse_args(argv)
    if args.child:
        model, group = args.child
        print(json.dumps(group_child(model, group, settings, args.out)))
        return
    with tempfile.TemporaryDirectory(prefix="tda-attr-scores-") as out:
        found = collect(settings, Path(out))
        section = report(found, settings, argv)
    common.publish(section, SECTION, settings.results, settings.write)


if __name__ == "__main__":
    main(sys.argv[1:])
