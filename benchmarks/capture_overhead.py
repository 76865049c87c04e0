"""Capture overhead: training-step time and peak RSS with the capture engine / without.

Protocol (docs/design.md section 12): one process builds the model, then runs interleaved
rounds of single training steps -- baseline, (a), (b), with the order rotated every round
-- where a step is forward + backward + AdamW step + ``zero_grad`` on the same batch. The
engine of a configuration is attached right before its step and detached right after
(attach/detach are not timed; ``engine.optimizer_step()`` is), and the model is checked
to be hook-free after every detach. After warm-up rounds, the median of ``--repeats``
steps per configuration is reported, with ratio = median(capture) / median(baseline) of
the wall time. Each step also records its CPU time (user + system), system time and
minor page faults: on a shared machine the CPU ratio is the one other processes barely
disturb, and a warning is printed when the baseline's wall time far exceeds its CPU time.

Configurations, all linear layers (``LayerSelection(kind="linear")``), fp32:

* (a) ``factors``: factorized capture, records kept until the optimizer step by a consumer
  with ``wants_step_records = True`` that does nothing else.
* (b) ``proj-k16``: the same with factor projection, ``k_a = k_g = 16``, in the hook.

Where the time goes (``--profile``): a few more capture steps under cProfile; the time of
the engine's entry points (hooks, ``optimizer_step``) and its heaviest function are set
against the measured extra CPU time, extra system time and extra page faults.

Peak memory: each configuration runs a few steps in fresh child processes of this script
(``--rss-child``) that report ``ru_maxrss``. Children start before the parent builds any
model: on Linux a child's ``ru_maxrss`` starts at its parent's high-water mark (it is kept
across fork and exec), so a parent that had already trained would mask the child's peak.
The child also reads ``VmHWM`` from ``/proc/self/status`` as a cross-check.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import resource
import statistics
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import (
    CONTENDED,
    RESULTS,
    Mark,
    Sample,
    Spread,
    heading,
    llama,
    peak_rss_mb,
    publish,
    require_positive,
    require_repeats,
    rotated,
    run_child,
    tidy,
    verdict,
)
from peers.workload import ModelSpec
from torch import nn

from tda_plugins import (
    CaptureConsumer,
    CaptureEngine,
    LayerSelection,
    MicroBatchRecord,
    ProjectionConfig,
)

SECTION = "## Capture overhead (benchmarks/capture_overhead.py)"
SCRIPT = "benchmarks/capture_overhead.py"
BASELINE = "baseline"


# -- what is measured ------------------------------------------------------------------


MODELS: dict[str, ModelSpec] = {
    "llama": ModelSpec(
        "LlamaConfig",
        "LlamaForCausalLM",
        full=llama(
            8000, hidden=384, intermediate=1024, layers=2, heads=6, tie_word_embeddings=False
        ),
        tiny=llama(512, hidden=64, intermediate=128, layers=1, heads=4, tie_word_embeddings=False),
        note="untied lm_head, so lm_head (vocab-wide) is captured",
    ),
    "gpt2": ModelSpec(
        "GPT2Config",
        "GPT2LMHeadModel",
        full=dict(vocab_size=8000, n_embd=384, n_layer=4, n_head=6),
        tiny=dict(vocab_size=512, n_embd=64, n_layer=1, n_head=4),
        note="Conv1D layers; lm_head is tied to wte, so kind='linear' leaves it out",
    ),
}


@dataclass(frozen=True)
class CaptureConfig:
    """One engine configuration compared against the plain training step."""

    name: str
    label: str
    projection: ProjectionConfig | None
    target: float


CONFIGS: dict[str, CaptureConfig] = {
    "factors": CaptureConfig("factors", "(a) factors kept for the step", None, 1.15),
    "proj-k16": CaptureConfig(
        "proj-k16",
        "(b) factor projection k=16",
        ProjectionConfig(kind="factor", k_a=16, k_g=16),
        1.05,
    ),
}
CONFIG_NAMES = (BASELINE, *CONFIGS)


@dataclass(frozen=True)
class Settings:
    """Resolved command-line settings."""

    models: tuple[str, ...]
    seq: int
    batch: int
    repeats: int
    warmup: int
    rss_steps: int
    rss_repeats: int
    attn: str
    quick: bool
    rss: bool
    write: bool
    results: Path
    profile: bool
    profile_steps: int = 3


class StepRecordKeeper(CaptureConsumer):
    """Makes the engine keep each step's records until the optimizer step; counts layers.

    With ``measure`` (peak-RSS children only, never timed) it also records the bytes the
    step's records hold: per distinct storage, and summed per layer as
    ``MicroBatchRecord.nbytes()`` counts them (a layer input shared by several layers,
    such as q/k/v's, counts once per layer there).
    """

    wants_step_records = True

    def __init__(self, measure: bool = False) -> None:
        self.measure = measure
        self.layers_seen = 0
        self.held_unique = 0
        self.held_sum = 0

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        self.layers_seen = len(records[-1].layers) if records else 0
        if self.measure:
            self.held_unique = max(self.held_unique, unique_storage_bytes(records))
            self.held_sum = max(self.held_sum, sum(r.nbytes() for r in records))


def unique_storage_bytes(records: list[MicroBatchRecord]) -> int:
    """Bytes of the distinct storages behind the gradient tensors of ``records``."""
    storages: dict[int, int] = {}

    def note(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    for record in records:
        for layer in record.layers.values():
            layer.grads.map_tensors(note)
    return sum(storages.values())


# -- model, data, one training step ----------------------------------------------------


def build_model(spec: ModelSpec, settings: Settings) -> nn.Module:
    """The spec's model in fp32, train mode, seeded init, dropout off."""
    import transformers

    kwargs = spec.config(tiny=settings.quick)
    positions = max(settings.seq, 256)
    if spec.config_cls == "GPT2Config":
        kwargs |= dict(n_positions=positions, bos_token_id=0, eos_token_id=0)
        kwargs |= dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        kwargs |= dict(max_position_embeddings=positions)
    config = getattr(transformers, spec.config_cls)(
        pad_token_id=0, attn_implementation=settings.attn, **kwargs
    )
    torch.manual_seed(0)
    model = getattr(transformers, spec.model_cls)(config)
    return model.to(torch.float32).train()


def vocab_size(spec: ModelSpec, settings: Settings) -> int:
    """The vocabulary size of ``spec`` at these settings."""
    return int(spec.config(tiny=settings.quick)["vocab_size"])


def make_batch(vocab: int, settings: Settings) -> dict[str, torch.Tensor]:
    """A fixed random token batch with an all-ones attention mask and labels = inputs."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (settings.batch, settings.seq), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class Trainer:
    """Plain training steps of one model on one batch (AdamW)."""

    def __init__(self, model: nn.Module, batch: dict[str, torch.Tensor]):
        self.model = model
        self.batch = batch
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(self, engine: CaptureEngine | None) -> Sample:
        """One forward/backward/AdamW/zero_grad step, and what it cost."""
        gc.collect()
        start = Mark.now()
        loss = self.model(**self.batch).loss
        loss.backward()
        if engine is not None:
            engine.optimizer_step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return start.elapsed()


def make_engine(
    model: nn.Module, config: CaptureConfig, measure: bool = False
) -> tuple[CaptureEngine, StepRecordKeeper]:
    """An (unattached) engine for ``config`` on all linear layers, with its consumer."""
    keeper = StepRecordKeeper(measure)
    engine = CaptureEngine(
        model,
        layers=LayerSelection(kind="linear"),
        projection=config.projection,
        consumers=[keeper],
    )
    return engine, keeper


def hook_count(model: nn.Module) -> int:
    """Forward hooks and pre-hooks registered on any module of ``model``."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# -- timing (parent process) -----------------------------------------------------------


@dataclass
class Timings:
    """Per-configuration step times of one model, and what the engine captured."""

    model: str
    params: int
    layers: int
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    loads: list[float] = field(default_factory=list)
    profiles: dict[str, HookProfile] = field(default_factory=dict)


def timed_step(
    trainer: Trainer, capture: tuple[CaptureEngine, StepRecordKeeper] | None, clean_hooks: int
) -> tuple[Sample, int]:
    """One step with the engine attached only around it: (its cost, layers captured)."""
    if capture is None:
        return trainer.step(None), 0
    engine, keeper = capture
    keeper.layers_seen = 0
    engine.attach()
    try:
        sample = trainer.step(engine)
    finally:
        engine.detach()
    if hook_count(trainer.model) != clean_hooks:
        raise RuntimeError("CaptureEngine.detach() left hooks on the model")
    return sample, keeper.layers_seen


def time_model(name: str, settings: Settings) -> Timings:
    """Interleaved rounds of baseline / capture steps on a fresh model ``name``."""
    spec = MODELS[name]
    model = build_model(spec, settings)
    trainer = Trainer(model, make_batch(vocab_size(spec, settings), settings))
    engines: dict[str, tuple[CaptureEngine, StepRecordKeeper] | None] = {BASELINE: None}
    engines |= {name: make_engine(model, cfg) for name, cfg in CONFIGS.items()}
    layers = len(LayerSelection(kind="linear").resolve(model))
    clean = hook_count(model)
    result = Timings(name, sum(p.numel() for p in model.parameters()), layers)
    result.samples = {name: [] for name in engines}
    for round_ in range(settings.warmup + settings.repeats):
        for name in rotated(list(engines), round_):
            sample, seen = timed_step(trainer, engines[name], clean)
            if engines[name] is not None and seen != layers:
                raise RuntimeError(f"{name}: captured {seen} layers, expected {layers}")
            if round_ >= settings.warmup:
                result.samples[name].append(sample)
        if round_ % 10 == 0 and hasattr(os, "getloadavg"):
            result.loads.append(os.getloadavg()[0])
        print(f"  {name} round {round_ + 1}/{settings.warmup + settings.repeats}", flush=True)
    if settings.profile:
        for name, capture in engines.items():
            if capture is not None:
                result.profiles[name] = profile_hooks(trainer, capture, settings.profile_steps)
    return result


# -- where the capture time goes (cProfile) --------------------------------------------


@dataclass(frozen=True)
class HookProfile:
    """Time spent in the engine's own code during capture steps, per step.

    Attributes:
        engine_ms: cumulative time of the engine's entry points (functions of
            ``tda_plugins`` called from outside it: the hooks and ``optimizer_step``),
            including the torch operations they run (projection matmuls, hashing).
        top: the ``tda_plugins`` function with the most own time, as cProfile names it.
        top_ms: that function's own time (its torch operations included).
    """

    engine_ms: float
    top: str
    top_ms: float


FuncKey = tuple[str, int, str]


def is_engine_code(func: FuncKey) -> bool:
    """Whether a cProfile function key belongs to the ``tda_plugins`` package."""
    return "tda_plugins" in Path(func[0]).parts


def called_from_engine(func: FuncKey, table: dict[FuncKey, tuple], seen: set[FuncKey]) -> bool:
    """Whether ``func`` runs below engine code, directly or through other code (such as
    ``functools.singledispatch``), so that its time is already in an engine entry point."""
    for caller in table[func][4] if func in table else ():
        if caller in seen:
            continue
        seen.add(caller)
        if is_engine_code(caller) or called_from_engine(caller, table, seen):
            return True
    return False


def profile_hooks(
    trainer: Trainer, capture: tuple[CaptureEngine, StepRecordKeeper], steps: int
) -> HookProfile:
    """Run ``steps`` capture steps under cProfile and summarize the engine's share."""
    engine, _ = capture
    profiler = cProfile.Profile()
    engine.attach()
    try:
        for _ in range(steps):
            profiler.enable()
            trainer.step(engine)
            profiler.disable()
    finally:
        engine.detach()
    table = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    ours = {f: row for f, row in table.items() if is_engine_code(f)}
    entries = [row[3] for f, row in ours.items() if not called_from_engine(f, table, set())]
    top, row = max(ours.items(), key=lambda item: item[1][2])
    name = f"{Path(top[0]).name}:{top[1]}({top[2]})"
    return HookProfile(1e3 * sum(entries) / steps, name, 1e3 * row[2] / steps)


# -- peak memory (child processes) -----------------------------------------------------


def peak_rss_child(model_name: str, config_name: str, settings: Settings) -> dict[str, float]:
    """Body of ``--rss-child``: a few steps of one configuration in this fresh process."""
    spec = MODELS[model_name]
    model = build_model(spec, settings)
    trainer = Trainer(model, make_batch(vocab_size(spec, settings), settings))
    engine, keeper = None, StepRecordKeeper(measure=True)
    if config_name != BASELINE:
        engine, keeper = make_engine(model, CONFIGS[config_name], measure=True)
        engine.attach()
    for _ in range(settings.rss_steps):
        trainer.step(engine)
    return {
        "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "vmhwm_kb": 1024 * peak_rss_mb(),
        "held_unique": keeper.held_unique,
        "held_sum": keeper.held_sum,
    }


def child_args(settings: Settings) -> list[str]:
    """The settings a child process needs, as command-line flags."""
    args = ["--seq", str(settings.seq), "--batch", str(settings.batch), "--attn", settings.attn]
    args += ["--rss-steps", str(settings.rss_steps)]
    return args + (["--quick"] if settings.quick else [])


def run_rss_child(model_name: str, config_name: str, settings: Settings) -> dict[str, float]:
    """Start ``--rss-child`` for one (model, configuration) and parse its JSON line."""
    args = ["--rss-child", model_name, config_name, *child_args(settings)]
    return run_child(Path(__file__).resolve(), args)


RssRuns = dict[tuple[str, str], list[dict[str, float]]]


def measure_rss(settings: Settings) -> RssRuns:
    """Peak RSS of every (model, configuration), ``rss_repeats`` children each, a few at a
    time (concurrency does not change a process's own peak)."""
    jobs = [
        (m, c) for _ in range(settings.rss_repeats) for m in settings.models for c in CONFIG_NAMES
    ]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        found = list(pool.map(lambda job: run_rss_child(job[0], job[1], settings), jobs))
    runs: RssRuns = {}
    for job, result in zip(jobs, found, strict=True):
        runs.setdefault(job, []).append(result)
    return runs


# -- reporting -------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    """Peak RSS of one (model, configuration) over its children, and what capture held."""

    median_mb: float
    low_mb: float
    high_mb: float
    ratio: float
    delta_mb: float
    held_unique_mb: float
    held_sum_mb: float


@dataclass(frozen=True)
class Row:
    """One configuration of one model: times against the baseline, and memory."""

    model: str
    config: str
    wall: Spread
    wall_ratio: float
    wall_paired: Spread
    cpu: Spread
    cpu_ratio: float
    cpu_paired: Spread
    faults: float
    cpu_extra_ms: float
    sys_extra_ms: float
    faults_extra: float
    target: float | None
    memory: Memory | None
    profile: HookProfile | None


def memory_of(runs: RssRuns, model: str, config: str) -> Memory | None:
    """Summarize the children of one (model, configuration) against the baseline's."""
    mine, base = runs.get((model, config)), runs.get((model, BASELINE))
    if not mine or not base:
        return None
    peaks = [r["maxrss_kb"] / 1024 for r in mine]
    base_median = statistics.median(r["maxrss_kb"] / 1024 for r in base)
    return Memory(
        median_mb=statistics.median(peaks),
        low_mb=min(peaks),
        high_mb=max(peaks),
        ratio=statistics.median(peaks) / base_median,
        delta_mb=statistics.median(peaks) - base_median,
        held_unique_mb=max(r["held_unique"] for r in mine) / 2**20,
        held_sum_mb=max(r["held_sum"] for r in mine) / 2**20,
    )


def build_row(t: Timings, name: str, runs: RssRuns) -> Row:
    """Ratios of configuration ``name`` against the baseline of the same model and run."""
    mine, base = t.samples[name], t.samples[BASELINE]
    cfg = CONFIGS.get(name)
    wall = Spread.of([s.wall for s in mine])
    cpu = Spread.of([s.cpu for s in mine])
    base_wall = statistics.median(s.wall for s in base)
    base_cpu = statistics.median(s.cpu for s in base)
    sys_time = statistics.median(s.sys for s in mine)
    faults = statistics.median(s.faults for s in mine)
    return Row(
        model=t.model,
        config=cfg.label if cfg else BASELINE,
        wall=wall,
        wall_ratio=wall.median / base_wall,
        wall_paired=Spread.of([c.wall / b.wall for c, b in zip(mine, base, strict=True)]),
        cpu=cpu,
        cpu_ratio=cpu.median / base_cpu,
        cpu_paired=Spread.of([c.cpu / b.cpu for c, b in zip(mine, base, strict=True)]),
        faults=faults,
        cpu_extra_ms=1e3 * (cpu.median - base_cpu),
        sys_extra_ms=1e3 * (sys_time - statistics.median(s.sys for s in base)),
        faults_extra=faults - statistics.median(s.faults for s in base),
        target=cfg.target if cfg else None,
        memory=memory_of(runs, t.model, name),
        profile=t.profiles.get(name),
    )


def build_rows(timings: list[Timings], runs: RssRuns) -> list[Row]:
    """One row per (model, configuration), baseline first."""
    return [build_row(t, name, runs) for t in timings for name in t.samples]


def time_table(rows: list[Row]) -> str:
    """The markdown table of step times."""
    lines = [
        "| model | config | wall s, median [IQR] | wall ratio | paired wall ratio [IQR] "
        "| CPU s, median [IQR] | CPU ratio | paired CPU ratio [IQR] | target "
        "| met (wall / CPU) | minor faults / step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|:-:|---:|",
    ]
    for r in rows:
        target = "—" if r.target is None else f"{r.target:.2f}x"
        met = (
            ""
            if r.target is None
            else f"{verdict(r.wall_ratio, r.target)} / {verdict(r.cpu_ratio, r.target)}"
        )
        lines.append(
            f"| {r.model} | {r.config} | {r.wall.text('.3f')} | **{r.wall_ratio:.3f}x** "
            f"| {r.wall_paired.text('.3f', 'x')} | {r.cpu.text('.3f')} | {r.cpu_ratio:.3f}x "
            f"| {r.cpu_paired.text('.3f', 'x')} | {target} | {met} | {r.faults:,.0f} |"
        )
    return "\n".join(lines)


def profile_table(rows: list[Row], steps: int) -> str:
    """Where the extra CPU time of each capture configuration goes (empty if not profiled)."""
    profiled = [r for r in rows if r.profile is not None]
    if not profiled:
        return ""
    lines = [
        f"Where the time goes: CPU time over the baseline step (medians of the timed rounds), "
        f"the engine's own code under cProfile ({steps} extra capture steps; its hooks and "
        "`optimizer_step`, torch operations they launch included), the heaviest engine "
        "function by own time, and the extra system time and fresh-page faults (memory the "
        "allocator could not reuse).",
        "",
        "| model | config | extra CPU, ms/step | engine code, ms/step (% of baseline CPU) "
        "| heaviest engine function, ms/step | extra sys, ms/step | extra minor faults / step |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        prof = r.profile
        if prof is None:
            continue
        base_ms = 1e3 * r.cpu.median / r.cpu_ratio
        lines.append(
            f"| {r.model} | {r.config} | {r.cpu_extra_ms:+.0f} "
            f"| {prof.engine_ms:.1f} ({100 * prof.engine_ms / base_ms:.1f}%) "
            f"| `{prof.top}` {prof.top_ms:.1f} | {r.sys_extra_ms:+.0f} "
            f"| {r.faults_extra:+,.0f} |"
        )
    return "\n".join(lines)


def memory_table(rows: list[Row]) -> str:
    """The markdown table of peak RSS (empty when it was not measured)."""
    if all(r.memory is None for r in rows):
        return ""
    lines = [
        "| model | config | peak RSS, MB median (min–max) | RSS ratio | delta (MB) "
        "| held at step, MB: unique / per-layer sum |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r.memory
        if m is None:
            continue
        held = "—" if m.held_sum_mb == 0 else f"{m.held_unique_mb:.1f} / {m.held_sum_mb:.1f}"
        lines.append(
            f"| {r.model} | {r.config} | {m.median_mb:.0f} ({m.low_mb:.0f}–{m.high_mb:.0f}) "
            f"| {m.ratio:.3f}x | {m.delta_mb:+.0f} | {held} |"
        )
    return "\n".join(lines)


def models_table(timings: list[Timings], settings: Settings) -> str:
    """The markdown table describing the benchmarked models."""
    lines = ["| model | config | params | captured linear layers |", "|---|---|---:|---:|"]
    for t in timings:
        spec_text = MODELS[t.model].text(tiny=settings.quick)
        lines.append(f"| {t.model} | {spec_text} | {t.params / 1e6:.2f}M | {t.layers} |")
    return "\n".join(lines)


def rss_note(runs: RssRuns) -> str:
    """How far ``ru_maxrss`` and ``VmHWM`` of the children disagree."""
    gaps = [
        abs(r["maxrss_kb"] - r["vmhwm_kb"]) / r["vmhwm_kb"]
        for results in runs.values()
        for r in results
        if r["vmhwm_kb"] == r["vmhwm_kb"]
    ]
    if not gaps:
        return "VmHWM was not available for a cross-check."
    return f"`ru_maxrss` and `VmHWM` of the children agree within {100 * max(gaps):.1f}%."


def memory_text(settings: Settings, runs: RssRuns) -> str:
    """The protocol sentence about memory."""
    if not runs:
        return "peak RSS not measured (`--no-rss`)."
    return (
        f"each configuration alone in {settings.rss_repeats} fresh child process(es) of "
        f"{settings.rss_steps} steps each (engine attached throughout), median of "
        f'`ru_maxrss`; {rss_note(runs)} "held at step" is what the step\'s records hold '
        "when `optimizer_step()` hands them over: distinct storages, and the per-layer sum "
        "that `MicroBatchRecord.nbytes()` / `engine.held_bytes()` report (inputs shared by "
        "several layers counted once per layer)."
    )


def contention_warning(rows: list[Row]) -> str:
    """A warning for models whose baseline wall time far exceeds its CPU time (the process
    waited for a core that other processes held), else nothing."""
    slow = [
        f"{r.model} (wall / CPU = {r.wall.median / r.cpu.median:.2f})"
        for r in rows
        if r.config == BASELINE and r.wall.median > CONTENDED * r.cpu.median
    ]
    if not slow:
        return ""
    return (
        f"**Warning:** other processes competed for the cores while timing {', '.join(slow)}; "
        "wall-time ratios there are unreliable: read the CPU ratios (or rerun on a quiet "
        "machine)."
    )


def report(
    rows: list[Row], timings: list[Timings], settings: Settings, runs: RssRuns, argv: Sequence[str]
) -> str:
    """The full markdown section for the results file."""
    loads = [x for t in timings for x in t.loads]
    return f"""{heading(SECTION, SCRIPT, argv, loads)}

Step = forward + backward + AdamW step + `zero_grad`, fp32, batch {settings.batch} x \
sequence {settings.seq}, attention `{settings.attn}`, capture of all linear layers \
(`LayerSelection(kind="linear")`). {settings.warmup} warm-up rounds, then \
{settings.repeats} timed rounds of one step per configuration (baseline, (a), (b), order \
rotated each round; each engine attached only around its own step, model checked \
hook-free after each detach). **Wall ratio** = median(capture) / median(baseline) of \
the step's wall time, the protocol's ratio and the one the targets apply to; paired \
ratio = capture / baseline step of the same round; CPU = `time.process_time()` of the \
step (user + system), which other processes on a shared machine disturb far less than \
wall time when torch runs one thread. (a) keeps the factorized records until \
`engine.optimizer_step()` through a consumer with `wants_step_records = True` that does \
nothing else; (b) adds `ProjectionConfig(kind="factor", k_a=16, k_g=16)`. Memory: \
{memory_text(settings, runs)}

{models_table(timings, settings)}

{time_table(rows)}

{contention_warning(rows)}

{profile_table(rows, settings.profile_steps)}

{memory_table(rows)}
"""


# -- command line ----------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> tuple[Settings, argparse.Namespace]:
    """Parse and validate the command line into :class:`Settings`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["llama", "gpt2", "both"], default="both")
    p.add_argument("--repeats", type=int, help="timed rounds (default 20; quick 3)")
    p.add_argument("--warmup", type=int, help="untimed rounds first (default 2; quick 1)")
    p.add_argument("--seq", type=int, help="sequence length (default 256; quick 32)")
    p.add_argument("--batch", type=int, help="batch size (default 8; quick 2)")
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument("--rss-steps", type=int, default=3, help="steps per peak-RSS child")
    p.add_argument("--rss-repeats", type=int, help="children per configuration (default 3)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (no RSS, profile or write)")
    p.add_argument("--rss", action=argparse.BooleanOptionalAction, help="measure peak RSS")
    p.add_argument("--write", action=argparse.BooleanOptionalAction, help="update the results file")
    p.add_argument("--results", type=Path, default=RESULTS, help="markdown file to update")
    p.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        help="profile the engine's share of a few capture steps (default on; quick off)",
    )
    p.add_argument("--rss-child", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    quick = a.quick
    settings = Settings(
        models=("llama", "gpt2") if a.model == "both" else (a.model,),
        seq=a.seq or (32 if quick else 256),
        batch=a.batch or (2 if quick else 8),
        repeats=a.repeats or (3 if quick else 20),
        warmup=a.warmup if a.warmup is not None else (1 if quick else 2),
        rss_steps=a.rss_steps,
        rss_repeats=a.rss_repeats or (1 if quick else 3),
        attn=a.attn,
        quick=quick,
        rss=a.rss if a.rss is not None else not quick,
        write=a.write if a.write is not None else not quick,
        results=a.results,
        profile=a.profile if a.profile is not None else not quick,
    )
    require_positive(p, settings, ("seq", "batch", "repeats", "rss_steps", "rss_repeats"))
    if settings.warmup < 0:
        p.error("--warmup must be >= 0")
    require_repeats(p, settings.repeats, quick=quick)
    return settings, a


def main(argv: Sequence[str]) -> None:
    """Run the benchmark, print the table and the command, update the results file."""
    settings, args = parse_args(argv)
    if args.rss_child:
        model_name, config_name = args.rss_child
        print(json.dumps(peak_rss_child(model_name, config_name, settings)))
        return
    # Children first: they must start before this process grows (see module docstring).
    runs = measure_rss(settings) if settings.rss else {}
    timings = [time_model(name, settings) for name in settings.models]
    section = tidy(report(build_rows(timings, runs), timings, settings, runs, argv))
    publish(section, SECTION, settings.results, settings.write)


if __name__ == "__main__":
    main(sys.argv[1:])
