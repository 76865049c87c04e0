"""Data selection overhead: HF ``Trainer`` step time with ``DataSelectionCallback`` / plain.

Protocol (docs/design.md section 12): one process builds a Llama-architecture model from its
config (random init, seed 0, fp32) and, per mode -- PEFT LoRA (r=8 on every linear layer
but the head; selection over the adapters, the default) and full fine-tuning (selection
over every trainable parameter, ``layers="all"``) -- one identical copy of it per
configuration:

* ``plain``: the ``Trainer`` alone;
* ``select``: with ``DataSelectionCallback`` (target pool of 16 sequences, its gradient
  refreshed every step, rule ``bottom_fraction`` 0.25, score ``"dot"``);
* ``select, 1 of pool``: the same, each step's target one example of the pool in turn
  (``target_examples=1``: the dattri-llm paper's protocol, whose 1.64x is measured so);
* ``select, fixed target``: the same with the target captured at a run's first step only
  (``refresh_every`` beyond the run), so that the timed steps show selection without the
  target's forward and backward; a refresh every ``n`` steps costs about
  ``fixed + (select - fixed) / n``.

Short ``trainer.train()`` runs of the configurations alternate (order rotated every
round); a ``TrainerCallback`` first in the list times each step from ``on_step_begin`` to
``on_step_end`` (batch loading outside; forward, backward, selection, clipping, AdamW and
``zero_grad`` inside), the first steps of each run are discarded (AdamW state creation),
and the median of at least 10 timed steps per configuration is compared: ratio =
median(select) / median(plain), wall and CPU (``time.process_time``).

``--setting demo`` measures instead the demo's own setting (``recipes/lora_data_selection.py``:
SmolLM2-135M-Instruct, LoRA on its last 8 blocks, TRL ``SFTTrainer``, batch 8 of the demo
mixture) with ``DataSelectionCallback``'s default settings, target refreshes included:
runs of ``--demo-steps`` steps (by default one refresh interval of the default, so that
each run holds the refreshes a long run holds per step) alternate between no selection and
selection, and each round's ratio is the whole run's time with selection / without
(:func:`demo_setting`).

Where the time goes: the selection callback used here is a subclass that times its own
two entry points in the same timed runs -- the target gradient (``on_step_begin``) and the
selection at the optimizer step (``on_pre_optimizer_step``: scoring, dropping, ``.grad``
surgery, clipping) -- and the rest of the extra time is the capture hooks on the
training forward/backward. A short cProfile run splits the selection step into scoring
(the layers' per-example gradients built once where that is cheaper, the dots with the
target, the rule) and surgery.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common
from peers import workload
from peers.training import each_mode
from torch import nn
from transformers import TrainerCallback

from tda_plugins.integrations.transformers import DataSelectionCallback

SECTION = "## Data selection overhead (benchmarks/selection_overhead.py)"
SCRIPT = "benchmarks/selection_overhead.py"
TARGET = 1.3
PLAIN = "plain"
SELECT = "select"
ONE = "select, 1 of pool"
PROJECTED = "select, 1 of pool, k=16 scores"
FIXED = "select, fixed target"
#: Configurations: name -> (refresh_every, target_examples, score_projection); plain has
#: no selection.
CONFIGS: dict[str, tuple[int | None, int | None, int | None]] = {
    PLAIN: (None, None, None),
    SELECT: (1, None, None),
    ONE: (1, 1, None),
    PROJECTED: (1, 1, 16),
    FIXED: (10**9, None, None),
}
#: The configurations held to the target.
TARGETED = (SELECT, ONE, PROJECTED)
SELECTOR = "tda_plugins/data_selection/selector.py"
#: Code whose cumulative time splits the selection's cost.
PROFILED = {
    "scoring": (
        (SELECTOR, "_built_once"),
        (SELECTOR, "_unit_scores"),
        (SELECTOR, "_keep_masks"),
    ),
    "selection step": ((SELECTOR, "on_optimizer_step"),),
}


@dataclass(frozen=True)
class Settings:
    """Resolved command-line settings."""

    modes: tuple[str, ...]
    seq: int
    batch: int
    pool: int
    repeats: int
    steps_per_run: int
    warmup_steps: int
    profile_steps: int
    quick: bool
    write: bool
    results: Path
    setting: str = "synthetic"
    rounds: int = 3
    demo_steps: int = 16

    @property
    def model_config(self) -> dict[str, Any]:
        """The Llama's config keyword arguments."""
        return workload.QUICK_LLAMA if self.quick else workload.SELECTION_LLAMA

    @property
    def runs(self) -> int:
        """Alternating runs per configuration."""
        return common.runs_needed(self.repeats, self.steps_per_run, self.warmup_steps)


# -- the timed selection callback ------------------------------------------------------


@dataclass
class PhaseTimes:
    """Per-step cost of the selection callback's entry points, one list per run."""

    target: list[list[common.Sample]] = field(default_factory=list)
    select: list[list[common.Sample]] = field(default_factory=list)

    def timed(self, warmup: int) -> tuple[list[common.Sample], list[common.Sample]]:
        """Target and selection costs of every run's steps after ``warmup``."""
        return (
            [t for run in self.target for t in run[warmup:]],
            [t for run in self.select for t in run[warmup:]],
        )


class TimedSelection(DataSelectionCallback):
    """``DataSelectionCallback`` that also times its target capture and its selection."""

    def __init__(self, times: PhaseTimes, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.times = times

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.times.target.append([])
        self.times.select.append([])
        super().on_train_begin(args, state, control, **kwargs)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with common.Stopwatch() as watch:
            super().on_step_begin(args, state, control, **kwargs)
        self.times.target[-1].append(watch.sample)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with common.Stopwatch() as watch:
            super().on_pre_optimizer_step(args, state, control, **kwargs)
        self.times.select[-1].append(watch.sample)


# -- models, data, trainers ------------------------------------------------------------


def target_pool(settings: Settings) -> list[dict[str, Any]]:
    """The selection target: ``pool`` sequences as long as the training ones."""
    vocab = int(settings.model_config["vocab_size"])
    rows = common.token_rows(settings.pool, settings.seq, vocab, seed=3)
    return [{"input_ids": r.tolist()} for r in rows]


@dataclass
class Config:
    """One configuration of a mode: its model copy, timer, and selection options."""

    name: str
    model: nn.Module
    timer: common.StepTimer
    refresh_every: int | None
    target_examples: int | None
    score_projection: int | None
    phases: PhaseTimes = field(default_factory=PhaseTimes)


class ModeBench:
    """Alternating short ``Trainer`` runs of the configurations of one mode."""

    def __init__(self, mode: workload.Mode, settings: Settings, base: nn.Module, work: Path):
        self.mode = mode
        self.settings = settings
        self.work = work
        vocab, steps = int(settings.model_config["vocab_size"]), settings.steps_per_run
        self.rows = workload.step_rows(vocab, steps=steps, batch=settings.batch, seq=settings.seq)
        self.pool = target_pool(settings)
        self.configs = {
            name: Config(name, mode.copy(base), common.StepTimer(), *options)
            for name, options in CONFIGS.items()
        }
        self.loads: list[float] = []

    def selection(self, config: Config, refresh_every: int) -> TimedSelection:
        """A fresh selection callback for one run of ``config``."""
        return TimedSelection(
            config.phases,
            self.pool,
            rule="bottom_fraction",
            fraction=0.25,
            score="dot",
            refresh_every=refresh_every,
            target_examples=config.target_examples,
            score_projection=config.score_projection,
            **self.mode.layers,
        )

    def train(
        self, config: Config, run: int, steps: int, first: TrainerCallback | None = None
    ) -> None:
        """One ``trainer.train()`` of ``steps`` steps for ``config``; ``first`` (a
        profiler) goes before its timer. Selection must have run at every step."""
        callbacks: list[TrainerCallback] = [config.timer]
        if first is not None:
            callbacks.insert(0, first)
        selection = None
        if config.refresh_every is not None:
            selection = self.selection(config, config.refresh_every)
            callbacks.append(selection)
        out = self.work / f"{self.mode.name}-{config.name}-{run}".replace(" ", "_")
        args = common.training_args(out, steps, self.settings.batch)
        common.make_trainer(config.model, self.rows, args, callbacks).train()
        if selection is not None and len(selection.history) != steps:
            raise RuntimeError(
                f"{config.name}: selection ran at {len(selection.history)} of {steps} steps"
            )

    def measure(self) -> None:
        """``runs`` rounds of one run per configuration, order rotated."""
        steps = self.settings.steps_per_run
        self.loads += common.alternate(
            list(self.configs),
            self.settings.runs,
            lambda name, round_: self.train(self.configs[name], round_, steps),
            f"{self.mode.name} ",
        )

    def profile_split(self) -> dict[str, float]:
        """Seconds per step of each :data:`PROFILED` part in the cProfiled steps of a
        selection run (after its warm-up steps), and ``surgery`` = the selection step
        minus its scoring; the run's steps are not among the timed ones."""
        config = dataclasses.replace(
            self.configs[SELECT], timer=common.StepTimer(), phases=PhaseTimes()
        )
        profiler = common.StepProfiler(self.settings.warmup_steps)
        self.train(config, -1, self.settings.warmup_steps + self.settings.profile_steps, profiler)
        split = profiler.split(PROFILED)
        split["surgery"] = split.pop("selection step") - split["scoring"]
        return split


# -- results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModeResult:
    """One mode's measurements.

    Attributes:
        samples: timed steps per configuration.
        target_s: median CPU seconds per step of the target capture, per configuration.
        select_s: median CPU seconds per step of the selection at the optimizer step.
        profile: cProfiled seconds per step of the :data:`PROFILED` parts and ``surgery``.
    """

    mode: workload.Mode
    params: int
    trainable: int
    samples: dict[str, list[common.Sample]]
    target_s: dict[str, float]
    select_s: dict[str, float]
    profile: dict[str, float]

    def comparison(self, name: str) -> common.Comparison:
        """``name`` against the plain configuration."""
        return common.Comparison.of(self.samples[name], self.samples[PLAIN])


def run_mode(
    mode: workload.Mode, settings: Settings, base: nn.Module, work: Path
) -> tuple[ModeResult, list[float]]:
    """Measure one mode: timed alternating runs, then the profile run."""
    bench = ModeBench(mode, settings, base, work)
    bench.measure()
    split = bench.profile_split() if settings.profile_steps else {}
    warm = settings.warmup_steps
    samples = {name: c.timer.timed(warm) for name, c in bench.configs.items()}
    target_s, select_s = {}, {}
    for name in (*TARGETED, FIXED):
        target, select = bench.configs[name].phases.timed(warm)
        target_s[name] = common.median_of(target, "cpu")
        select_s[name] = common.median_of(select, "cpu")
    model = bench.configs[PLAIN].model
    result = ModeResult(
        mode,
        common.parameter_count(model),
        common.parameter_count(model, trainable_only=True),
        samples,
        target_s,
        select_s,
        split,
    )
    return result, bench.loads


def time_table(results: list[ModeResult]) -> str:
    """The markdown table of step times and ratios."""
    lines = [
        "| mode | configuration | step s, wall median [IQR] | **wall ratio** "
        "| paired wall ratio [IQR] | step s, CPU median [IQR] | CPU ratio | target | met "
        "(wall / CPU) |",
        "|---|---|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in results:
        for name in CONFIGS:
            c = r.comparison(name)
            timed = name in TARGETED
            target = f"{TARGET:.2f}x" if timed else "—"
            met = (
                f"{common.verdict(c.wall_ratio, TARGET)} / {common.verdict(c.cpu_ratio, TARGET)}"
                if timed
                else ""
            )
            lines.append(
                f"| {r.mode.label} | {name} | {c.wall.text()} | **{c.wall_ratio:.2f}x** "
                f"| {c.wall_paired.text('.2f', 'x')} | {c.cpu.text()} | {c.cpu_ratio:.2f}x "
                f"| {target} | {met} |"
            )
    return "\n".join(lines)


def split_table(results: list[ModeResult]) -> str:
    """Where the extra CPU time of a selection step goes, in ms and % of the plain step."""
    lines = [
        "| mode | configuration | plain step, ms | extra per step, ms | target gradient "
        "| selection at the step (scoring / surgery) "
        "| capture hooks in training + rest "
        "| refresh every 8 steps, estimated ratio (wall / CPU) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        plain = common.median_of(r.samples[PLAIN], "cpu")
        for name in (*TARGETED, FIXED):
            extra = common.median_of(r.samples[name], "cpu") - plain
            target, select = r.target_s[name], r.select_s[name]
            select_parts = ""
            if r.profile and name == SELECT:
                select_parts = f" ({ms(r.profile['scoring'])} / {ms(r.profile['surgery'])})"
            lines.append(
                f"| {r.mode.label} | {name} | {1e3 * plain:.0f} | {1e3 * extra:+.0f} "
                f"| {share(target, plain)} | {share(select, plain)}{select_parts} "
                f"| {share(extra - target - select, plain)} "
                f"| {refresh_estimate(r, 8) if name == SELECT else ''} |"
            )
    return "\n".join(lines)


def refresh_estimate(r: ModeResult, every: int) -> str:
    """Ratio of a target refreshed every ``every`` steps, ``fixed + (select - fixed) /
    every``, from the wall and the CPU ratios."""
    select, fixed = r.comparison(SELECT), r.comparison(FIXED)
    wall = fixed.wall_ratio + (select.wall_ratio - fixed.wall_ratio) / every
    cpu = fixed.cpu_ratio + (select.cpu_ratio - fixed.cpu_ratio) / every
    return f"{wall:.2f}x / {cpu:.2f}x"


def timed_steps(results: list[ModeResult]) -> int:
    """Timed steps per configuration (the same for all)."""
    return min(len(v) for r in results for v in r.samples.values())


def ms(seconds: float) -> str:
    """Milliseconds, no decimals."""
    return f"{1e3 * seconds:.0f}"


def share(seconds: float, plain: float) -> str:
    """``ms (x% of the plain step)``."""
    return f"{1e3 * seconds:.0f} ms ({100 * seconds / plain:.0f}%)"


def models_text(results: list[ModeResult], settings: Settings) -> str:
    """One line per mode: parameters and trainable parameters."""
    shape = ", ".join(f"{k}={v}" for k, v in settings.model_config.items())
    modes = "; ".join(
        f"{r.mode.name}: {r.params / 1e6:.2f}M parameters, {r.trainable / 1e6:.2f}M trainable"
        for r in results
    )
    return f"Model: `LlamaConfig({shape})` ({modes})."


def report(
    results: list[ModeResult], loads: list[float], settings: Settings, argv: Sequence[str]
) -> str:
    """The full markdown section for the results file."""
    warnings = "\n\n".join(
        note for r in results if (note := common.contention_note(r.mode.name, r.samples[PLAIN]))
    )
    return common.tidy(f"""{common.heading(SECTION, SCRIPT, argv, loads)}

HF `Trainer` (CPU, fp32, AdamW, `max_grad_norm=1.0`), batch {settings.batch} x sequence \
{settings.seq}, no padding. {models_text(results, settings)} `select` = \
`DataSelectionCallback(target, rule="bottom_fraction", fraction=0.25, score="dot", \
refresh_every=1)` with a target pool of {settings.pool} sequences of {settings.seq} \
tokens (its gradient: one plain forward/backward of the summed losses); \
`select, 1 of pool` = the same with `target_examples=1`, each step's target the next \
example of the pool (the dattri-llm paper's protocol: one example of a 16-example \
validation pool per step, batch 8, whose 1.64x the target is set against); \
`select, 1 of pool, k=16 scores` = that with `score_projection=16` (scores in a 16 x 16 \
factor-projected space per layer, approximate; the removal stays exact); \
`select, fixed target` = the target computed at each run's first step only. With the \
whole pool every step the target's forward/backward alone is \
{settings.pool} / {settings.batch} of a training step's, so that configuration's floor \
is about 1 + {settings.pool} / {settings.batch}. \
Runs of {settings.steps_per_run} steps alternate (order rotated, \
{settings.runs} run(s) per configuration, identical model copies), the first \
{settings.warmup_steps} step(s) of each run discarded: median of {timed_steps(results)} \
steps per configuration, each timed `on_step_begin` -> `on_step_end` by a callback placed \
first. Ratio = median / median(plain) of the same mode; paired = step / plain step in \
the same slot. Target: <= {TARGET}x with selection (the dattri-llm paper reports 1.64x).

{time_table(results)}

{warnings}

Where the extra time of a step goes (CPU time, steadier than wall time here; medians of \
the timed steps): the target's gradient and the selection at the optimizer step are \
timed by the callback itself in the runs above; the selection's split, in CPU ms per \
step under cProfile ({settings.profile_steps} steps), is scoring (per-example gradients \
built once where cheaper, their dots with the target, the rule) / surgery (dropped examples' \
contributions summed and removed from `.grad`, logging). The rest \
is the capture hooks on the training forward/backward (and the records they keep). \
The last column estimates a target refreshed every 8 steps: fixed + (select - fixed) / 8.

{split_table(results)}
""")


# -- command line ----------------------------------------------------------------------


# -- the demo's setting ----------------------------------------------------------------

DEMO_SECTION = (
    "## Data selection overhead in the demo's setting (selection_overhead.py --setting demo)"
)


@dataclass(frozen=True)
class DemoRound:
    """One round: every step of a run without selection and of one with it."""

    plain: list[common.Sample]
    select: list[common.Sample]

    def ratio(self, attr: str) -> float:
        """The selecting run's summed step time / the plain run's."""
        return sum(getattr(s, attr) for s in self.select) / sum(
            getattr(s, attr) for s in self.plain
        )


def demo_setting(rounds: int, steps: int, quick: bool) -> tuple[list[DemoRound], list[float], str]:
    """Alternating runs of the demo's ``none`` and ``ours`` arms (order rotated each round):
    the rounds, the load averages and the settings line the demo prints."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
    import lora_data_selection as demo
    from demo_arms import ARMS
    from tqdm.auto import tqdm

    options = demo.parse_options(
        ["--steps", str(steps), "--eval_steps", str(10**9), *(["--model", "tiny"] * quick)]
    )
    demo.quiet()
    mixture = demo.build_mixture(0)
    base = demo.base_model(options, mixture)
    results, loads = [], []
    with tempfile.TemporaryDirectory(prefix="tda-select-demo-") as work:
        for index in range(rounds):
            times: dict[str, list[common.Sample]] = {}
            for name in common.rotated(["none", "ours"], index):
                timer = common.StepTimer()
                job = demo.Job(
                    base, mixture, options, 0, Path(work) / str(index), tqdm(disable=True)
                )
                demo.train_arm(job, ARMS[name], None, eval_on_start=False, first=timer)
                times[name] = timer.runs[-1]
            results.append(DemoRound(times["none"], times["ours"]))
            loads.append(common.load_average())
            print(
                f"  demo round {index + 1}/{rounds}: {results[-1].ratio('cpu'):.3f}x CPU",
                flush=True,
            )
    return results, loads, demo.settings_line(options)


def demo_report(rounds: list[DemoRound], loads: list[float], line: str, argv: Sequence[str]) -> str:
    """The markdown section of the demo setting's measurement."""
    cpu = common.Spread.of([r.ratio("cpu") for r in rounds])
    wall = common.Spread.of([r.ratio("wall") for r in rounds])
    steps = len(rounds[0].plain)
    plain = common.Spread.of([sum(s.cpu for s in r.plain) / steps for r in rounds])
    cells = [
        ("CPU (`process_time`)", plain.text(), f"**{cpu.text('.3f', 'x')}**", cpu.median),
        ("wall", "—", wall.text(".3f", "x"), wall.median),
    ]
    table = "\n".join(
        [
            "| clock | plain step, s (median [IQR] over rounds) | whole run with / without "
            "selection | target | met |",
            "|---|---:|---:|---:|:-:|",
            *(
                f"| {clock} | {step} | {ratio} | {TARGET:.2f}x | {common.verdict(median, TARGET)} |"
                for clock, step, ratio, median in cells
            ),
        ]
    )
    return common.tidy(f"""{DEMO_SECTION}

Command: `{common.command_line(SCRIPT, argv)}`

Date: {common.utc_now()}. Machine: {common.machine_info()}; {common.load_text(loads)}.

The demo's setting ({line}): {len(rounds)} rounds, each one run of {steps} steps without \
selection and one with `DataSelectionCallback`'s default settings, order rotated; every \
step timed (`on_step_begin` -> `on_step_end`, the target refreshes included), none \
discarded. Ratio = the selecting run's summed step time / the plain run's, per round; \
median [quartiles] over rounds. Target: <= {TARGET}x.

{table}
""")


def parse_args(argv: Sequence[str]) -> Settings:
    """Parse and validate the command line into :class:`Settings`."""
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=[*workload.MODES, "both"], default="both")
    p.add_argument("--pool", type=int, default=16, help="target pool size")
    p.add_argument("--setting", choices=["synthetic", "demo"], default="synthetic")
    p.add_argument("--rounds", type=int, help="--setting demo: rounds (default 3; quick 1)")
    p.add_argument("--demo-steps", type=int, default=16, help="--setting demo: steps of one run")
    common.add_step_flags(p, seq=128, repeats=12, steps_per_run=4, profiled="selection")
    a = p.parse_args(argv)
    settings = Settings(
        modes=tuple(workload.MODES) if a.mode == "both" else (a.mode,),
        pool=a.pool,
        setting=a.setting,
        rounds=a.rounds or (1 if a.quick else 3),
        demo_steps=a.demo_steps,
        **common.step_settings(a, seq=128, repeats=12),
    )
    common.require_steps(p, settings, ("pool", "rounds", "demo_steps"))
    return settings


def main(argv: Sequence[str]) -> None:
    """Run the benchmark, print the tables and the command, update the results file."""
    settings = parse_args(argv)
    common.quiet_transformers()
    if settings.setting == "demo":
        rounds, loads, line = demo_setting(settings.rounds, settings.demo_steps, settings.quick)
        section = demo_report(rounds, loads, line, argv)
        common.publish(section, DEMO_SECTION, settings.results, settings.write)
        return
    base = workload.trainer_llama(settings.model_config, seq=settings.seq)
    with tempfile.TemporaryDirectory(prefix="tda-select-") as work:
        results, loads = each_mode(
            settings.modes, lambda mode: run_mode(mode, settings, base, Path(work))
        )
    common.publish(
        report(results, loads, settings, argv), SECTION, settings.results, settings.write
    )


if __name__ == "__main__":
    main(sys.argv[1:])
