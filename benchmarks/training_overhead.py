"""Capture overhead in real training: HF ``Trainer`` step time with
``GradientCaptureCallback`` / without, on a PEFT LoRA model, and peak RSS.

Protocol (docs/design.md section 12): one process builds a Llama-architecture model from its
config (random init, seed 0, fp32), wraps two identical copies in PEFT LoRA (r=8 on every
linear layer but the head), and alternates short ``trainer.train()`` runs of

* ``plain``: the ``Trainer`` alone;
* ``capture``: with ``GradientCaptureCallback(layers="lora", projection="factor", k_a=16,
  k_g=16, curvature=True)`` writing a new gradient store on local disk each run (factor-
  projected per-example gradients of every adapter, crash-safe shards committed at every
  step, inline K-FAC statistics of the projected factors, each example's decoded text:
  both runs get a word-level tokenizer over the token ids as their ``processing_class``).

A ``TrainerCallback`` first in the list times each step from ``on_step_begin`` to
``on_step_end`` (batch loading outside; forward, backward, the callback's commit,
clipping, AdamW and ``zero_grad`` inside); the first steps of each run are discarded
(AdamW state creation) and the median of at least 10 timed steps per configuration is
compared: ratio = median(capture) / median(plain), wall and CPU (``time.process_time``).
The end of a run (saving the K-FAC statistics and Adam moments) is outside the steps.

Peak RSS: each configuration runs a few steps in fresh child processes (``VmHWM``),
started before the parent builds any model. Where the time goes: a few cProfiled capture
steps, cumulative time of the engine's hooks, the projection inside them, the store
writes and the curvature accumulation, per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import common
from peers import workload
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from transformers import PreTrainedTokenizerFast, TrainerCallback

from tda_plugins import LayerSelection
from tda_plugins.integrations.transformers import GradientCaptureCallback
from tda_plugins.store import StoreReader

SECTION = "## Capture overhead in real training (benchmarks/training_overhead.py)"
SCRIPT = "benchmarks/training_overhead.py"
TARGET = 1.05
PLAIN = "plain"
CAPTURE = "capture"
CONFIGS = (PLAIN, CAPTURE)
#: Engine code whose cumulative time is reported, by what it does (nested: the layer
#: hooks include the projection; consumers run inside the end-of-backward callback).
PROFILED: dict[str, tuple[common.FuncRef, ...]] = {
    "layer hooks (capture + projection)": (
        ("capture/engine.py", "_on_layer_forward"),
        ("capture/engine.py", "_on_layer_grad"),
    ),
    "of which factor extraction (adapter)": (("adapters/linear.py", "capture"),),
    "of which projection": (("grads/projection.py", "__call__"),),
    "of which random-map matmuls": (("grads/projection.py", "apply"),),
    "root hooks (example ids, loss scale)": (
        ("capture/engine.py", "_on_root_forward"),
        ("capture/engine.py", "_on_root_output"),
    ),
    "store writes (shards + index commit)": (
        ("store/writer.py", "on_micro_batch"),
        ("store/writer.py", "on_optimizer_step"),
    ),
    "curvature (inline K-FAC)": (("precondition/statistics.py", "on_micro_batch"),),
}


@dataclass(frozen=True)
class Settings:
    """Resolved command-line settings."""

    seq: int
    batch: int
    k: int
    repeats: int
    steps_per_run: int
    warmup_steps: int
    profile_steps: int
    rss_steps: int
    rss_repeats: int
    quick: bool
    write: bool
    results: Path

    @property
    def model_config(self) -> common.ModelConfig:
        """The Llama's config keyword arguments."""
        return workload.QUICK_LLAMA if self.quick else workload.TRAINING_LLAMA

    @property
    def runs(self) -> int:
        """Alternating runs per configuration."""
        return common.runs_needed(self.repeats, self.steps_per_run, self.warmup_steps)

    def child_flags(self) -> list[str]:
        """The settings a peak-RSS child needs, as command-line flags."""
        flags = ["--seq", str(self.seq), "--batch", str(self.batch), "--k", str(self.k)]
        flags += ["--rss-steps", str(self.rss_steps)]
        return flags + (["--quick"] if self.quick else [])


# -- model, data, one run --------------------------------------------------------------


def id_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over every token id (``"w<i>"`` is id ``i``): the capture
    stores each example's decoded text, as it does with a run's real tokenizer."""
    words = {f"w{i}": i for i in range(vocab)}
    model = Tokenizer(models.WordLevel(words, unk_token="w0"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=model, pad_token="w0")


def capture_callback(store_dir: Path, settings: Settings) -> GradientCaptureCallback:
    """The measured callback, writing a new store at ``store_dir``."""
    return GradientCaptureCallback(
        store_dir=str(store_dir),
        layers="lora",
        projection="factor",
        k_a=settings.k,
        k_g=settings.k,
        curvature=True,
    )


def train_run(
    config: str,
    model: nn.Module,
    settings: Settings,
    work: Path,
    tag: str,
    steps: int,
    first: TrainerCallback | None = None,
) -> common.StepTimer:
    """One ``trainer.train()`` of ``steps`` steps of ``config``, timed by a fresh
    :class:`StepTimer`; ``first`` (a profiler) goes before it. A capture run must leave a
    store holding every step."""
    timer = common.StepTimer()
    callbacks: list[TrainerCallback] = [timer] if first is None else [first, timer]
    store = work / f"store-{tag}"
    if config == CAPTURE:
        callbacks.append(capture_callback(store, settings))
    args = common.training_args(work / f"out-{tag}", steps, settings.batch)
    vocab = int(settings.model_config["vocab_size"])
    rows = workload.step_rows(vocab, steps=steps, batch=settings.batch, seq=settings.seq)
    common.make_trainer(model, rows, args, callbacks, id_tokenizer(vocab)).train()
    if config == CAPTURE and StoreReader(store).steps != list(range(steps)):
        raise RuntimeError(f"the capture run {tag} did not commit all {steps} steps to {store}")
    if config == CAPTURE and len(StoreReader(store).texts()) != len(rows):
        raise RuntimeError(f"the capture run {tag} did not store every example's text")
    return timer


# -- timing (parent process) -----------------------------------------------------------


def measure(
    models: dict[str, nn.Module], settings: Settings, work: Path
) -> tuple[dict[str, list[common.Sample]], list[float]]:
    """Alternating runs (order rotated each round): timed steps per configuration."""
    samples: dict[str, list[common.Sample]] = {name: [] for name in CONFIGS}

    def run(name: str, round_: int) -> None:
        tag = f"{name}-{round_}"
        timer = train_run(name, models[name], settings, work, tag, settings.steps_per_run)
        samples[name] += timer.timed(settings.warmup_steps)

    return samples, common.alternate(CONFIGS, settings.runs, run)


def profile_capture(model: nn.Module, settings: Settings, work: Path) -> dict[str, float]:
    """Seconds per step of each :data:`PROFILED` part in the cProfiled steps of a capture
    run (after its warm-up steps)."""
    profiler = common.StepProfiler(settings.warmup_steps)
    steps = settings.warmup_steps + settings.profile_steps
    train_run(CAPTURE, model, settings, work, "profile", steps, first=profiler)
    return profiler.split(PROFILED)


# -- peak memory (child processes) -----------------------------------------------------


def rss_child(config: str, settings: Settings) -> dict[str, float]:
    """Body of ``--rss-child``: a few steps of one configuration in this fresh process."""
    common.quiet_transformers()
    model = workload.lora_copy(workload.trainer_llama(settings.model_config, seq=settings.seq))
    with tempfile.TemporaryDirectory(prefix="tda-train-rss-") as work:
        train_run(config, model, settings, Path(work), "rss", settings.rss_steps)
    return {"peak_mb": common.peak_rss_mb()}


def measure_rss(settings: Settings) -> dict[str, list[float]]:
    """Peak RSS (MB) of each configuration over ``rss_repeats`` fresh children, started
    one at a time, alternating configurations."""
    script = Path(__file__).resolve()
    peaks: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for repeat in range(settings.rss_repeats):
        for name in common.rotated(CONFIGS, repeat):
            found = common.run_child(script, ["--rss-child", name, *settings.child_flags()])
            peaks[name].append(found["peak_mb"])
    return peaks


# -- reporting -------------------------------------------------------------------------


def time_table(samples: dict[str, list[common.Sample]]) -> str:
    """The markdown table of step times and ratios."""
    lines = [
        "| configuration | step s, wall median [IQR] | **wall ratio** | paired wall ratio "
        "[IQR] | step s, CPU median [IQR] | CPU ratio | paired CPU ratio [IQR] | target "
        "| met (wall / CPU) |",
        "|---|---|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for name in CONFIGS:
        c = common.Comparison.of(samples[name], samples[PLAIN])
        target = f"{TARGET:.2f}x" if name == CAPTURE else "—"
        met = (
            f"{common.verdict(c.wall_ratio, TARGET)} / {common.verdict(c.cpu_ratio, TARGET)}"
            if name == CAPTURE
            else ""
        )
        lines.append(
            f"| {name} | {c.wall.text()} | **{c.wall_ratio:.3f}x** "
            f"| {c.wall_paired.text('.3f', 'x')} | {c.cpu.text()} | {c.cpu_ratio:.3f}x "
            f"| {c.cpu_paired.text('.3f', 'x')} | {target} | {met} |"
        )
    return "\n".join(lines)


def memory_table(peaks: dict[str, list[float]]) -> str:
    """Peak RSS per configuration and the ratio of medians (empty when not measured)."""
    if not all(peaks.get(name) for name in CONFIGS):
        return ""
    base = statistics.median(peaks[PLAIN])
    lines = ["| configuration | peak RSS MB, median (min–max) | RSS ratio | delta MB |"]
    lines.append("|---|---:|---:|---:|")
    for name in CONFIGS:
        mid = statistics.median(peaks[name])
        lines.append(
            f"| {name} | {mid:.0f} ({min(peaks[name]):.0f}–{max(peaks[name]):.0f}) "
            f"| {mid / base:.3f}x | {mid - base:+.0f} |"
        )
    return "\n".join(lines)


def profile_table(split: dict[str, float], samples: dict[str, list[common.Sample]]) -> str:
    """Engine parts in ms per step and as a share of the plain step's CPU time."""
    if not split:
        return ""
    plain = common.median_of(samples[PLAIN], "cpu")
    extra = common.median_of(samples[CAPTURE], "cpu") - plain
    extra_sys = common.median_of(samples[CAPTURE], "sys") - common.median_of(samples[PLAIN], "sys")
    extra_faults = common.median_of(samples[CAPTURE], "faults") - common.median_of(
        samples[PLAIN], "faults"
    )
    lines = [
        f"Measured extra CPU time per step (medians): {1e3 * extra:+.0f} ms "
        f"({100 * extra / plain:+.1f}% of the plain step's {1e3 * plain:.0f} ms), of which "
        f"system time {1e3 * extra_sys:+.0f} ms; minor page faults {extra_faults:+,.0f} per "
        "step. The parts below are the engine's own code; extra time beyond their sum is "
        "spent outside it (allocator, page faults, cache effects on the training's own work).",
        "",
        "| part (cumulative, cProfile) | ms / step | % of plain step CPU |",
        "|---|---:|---:|",
    ]
    for label, seconds in split.items():
        lines.append(f"| {label} | {1e3 * seconds:.1f} | {100 * seconds / plain:.1f}% |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Measured:
    """What the parent measured."""

    samples: dict[str, list[common.Sample]]
    loads: list[float]
    peaks: dict[str, list[float]]
    split: dict[str, float]
    params: int
    trainable: int
    adapters: int


def report(m: Measured, settings: Settings, argv: Sequence[str]) -> str:
    """The full markdown section for the results file."""
    shape = ", ".join(f"{k}={v}" for k, v in settings.model_config.items())
    rss = (
        f"each configuration in {settings.rss_repeats} fresh child process(es) of "
        f"{settings.rss_steps} steps, `VmHWM`, median"
        if m.peaks
        else "not measured"
    )
    return common.tidy(f"""{common.heading(SECTION, SCRIPT, argv, m.loads)}

HF `Trainer` (CPU, fp32, AdamW, `max_grad_norm=1.0`), batch {settings.batch} x sequence \
{settings.seq}, no padding. Model: `LlamaConfig({shape})` ({m.params / 1e6:.2f}M \
parameters) with PEFT LoRA r={workload.LORA_RANK} on every linear layer but the head \
({m.trainable / 1e6:.3f}M trainable, {m.adapters} adapter layers captured). `capture` = \
`GradientCaptureCallback(layers="lora", projection="factor", k_a={settings.k}, \
k_g={settings.k}, curvature=True)`, a new store on local disk (ext4) per run. Runs of \
{settings.steps_per_run} steps alternate (order rotated, {settings.runs} runs per \
configuration, identical model copies), the first {settings.warmup_steps} step(s) of \
each run discarded: median of {len(m.samples[PLAIN])} steps per configuration, each timed \
`on_step_begin` -> `on_step_end` by a callback placed first. Ratio = median / \
median(plain); paired = step / plain step in the same slot. Target: <= {TARGET}x \
(Traceprop reports 1.026x on a GPU). Peak RSS: {rss}.

{time_table(m.samples)}

{common.contention_note("the plain steps", m.samples[PLAIN])}

{memory_table(m.peaks)}

Where the capture time goes ({settings.profile_steps} cProfiled capture steps; \
cumulative CPU times, torch operations included; the layer hooks include the projection):

{profile_table(m.split, m.samples)}
""")


# -- command line ----------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> tuple[Settings, argparse.Namespace]:
    """Parse and validate the command line into :class:`Settings`."""
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=16, help="factor projection k_a = k_g")
    common.add_step_flags(p, seq=256, repeats=20, steps_per_run=3, profiled="capture")
    p.add_argument("--rss-steps", type=int, default=3, help="steps per peak-RSS child")
    p.add_argument("--rss-repeats", type=int, help="children per configuration (default 2)")
    p.add_argument("--rss-child", choices=CONFIGS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    settings = Settings(
        k=a.k,
        rss_steps=a.rss_steps,
        rss_repeats=a.rss_repeats if a.rss_repeats is not None else (0 if a.quick else 2),
        **common.step_settings(a, seq=256, repeats=20),
    )
    common.require_steps(p, settings, ("k", "rss_steps"))
    return settings, a


def run(settings: Settings) -> Measured:
    """Peak-RSS children first (before this process grows), then the timed runs."""
    peaks = measure_rss(settings) if settings.rss_repeats else {}
    common.quiet_transformers()
    base = workload.trainer_llama(settings.model_config, seq=settings.seq)
    models = {name: workload.lora_copy(base) for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="tda-train-") as work:
        samples, loads = measure(models, settings, Path(work))
        split = {}
        if settings.profile_steps:
            split = profile_capture(models[CAPTURE], settings, Path(work))
    model = models[PLAIN]
    adapters = len(LayerSelection(kind="lora").resolve(model))
    return Measured(
        samples,
        loads,
        peaks,
        split,
        common.parameter_count(model),
        common.parameter_count(model, trainable_only=True),
        adapters,
    )


def main(argv: Sequence[str]) -> None:
    """Run the benchmark, print the tables and the command, update the results file."""
    settings, args = parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, settings)))
        return
    measured = run(settings)
    common.publish(report(measured, settings, argv), SECTION, settings.results, settings.write)


if __name__ == "__main__":
    main(sys.argv[1:])
