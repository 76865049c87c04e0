"""Helpers shared by the benchmark scripts: timing, interleaving, peak RSS, models from
configs, ``Trainer`` plumbing, profiling, and writing a script's own results section.

The scripts import it as ``common`` (``python benchmarks/<script>.py`` puts this folder
first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import json
import math
import os
import platform
import pstats
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback
from transformers.utils import logging as hf_logging

REPO = Path(__file__).resolve().parent.parent
#: One detail file per script: ``benchmarks/RESULTS.md`` is the hand-kept summary of
#: current figures that links to them, and no script writes it.
RESULTS_DIR = REPO / "benchmarks" / "results"
#: The default ``--results`` of the script being run (``python benchmarks/<script>.py``):
#: ``benchmarks/results/<script>.md``, where its reruns replace its own sections.
RESULTS = RESULTS_DIR / f"{Path(sys.argv[0]).stem}.md"
RESULTS_TITLE = "# Benchmark results"
ENV_VARS = ("HF_HUB_OFFLINE", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")
#: docs/design.md section 12: median of at least this many repeats after warm-up.
MIN_REPEATS = 10
#: A baseline whose wall time exceeds this multiple of its CPU time waited for a core.
CONTENDED = 1.15


# -- timing ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """What one timed piece of work cost.

    Attributes:
        wall: elapsed seconds (``time.perf_counter``).
        cpu: CPU seconds of this process, user + system (``time.process_time``); with one
            torch thread it is the work itself, far less disturbed than wall time by other
            processes competing for the cores of a shared machine.
        sys: system CPU seconds (page faults, zeroing fresh pages, file writes).
        faults: minor page faults (fresh pages the work touched).
    """

    wall: float
    cpu: float
    sys: float = 0.0
    faults: int = 0

    def to_json(self) -> dict[str, float]:
        """The fields as a JSON object."""
        return {"wall": self.wall, "cpu": self.cpu, "sys": self.sys, "faults": self.faults}

    @classmethod
    def from_json(cls, value: Mapping[str, float]) -> Sample:
        """Inverse of :meth:`to_json`."""
        return cls(
            float(value["wall"]),
            float(value["cpu"]),
            float(value.get("sys", 0.0)),
            int(value.get("faults", 0)),
        )


@dataclass(frozen=True)
class Mark:
    """A point in time on every clock a :class:`Sample` reads."""

    wall: float
    cpu: float
    sys: float
    faults: int

    @classmethod
    def now(cls) -> Mark:
        """The clocks now."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return cls(time.perf_counter(), time.process_time(), usage.ru_stime, usage.ru_minflt)

    def elapsed(self) -> Sample:
        """What passed on each clock since this mark."""
        now = Mark.now()
        return Sample(
            now.wall - self.wall, now.cpu - self.cpu, now.sys - self.sys, now.faults - self.faults
        )


class Stopwatch:
    """The cost of a ``with`` block: ``with Stopwatch() as sw: ...; sw.sample``."""

    def __enter__(self) -> Stopwatch:
        self._start = Mark.now()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sample = self._start.elapsed()


@dataclass(frozen=True)
class Spread:
    """Median with first and third quartile."""

    q1: float
    median: float
    q3: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """Quartiles of ``values`` (all equal for a single value)."""
        if not values:
            raise ValueError("no values to summarize")
        if len(values) < 2:
            return cls(values[0], values[0], values[0])
        q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(q1, median, q3)

    def text(self, spec: str = ".3f", suffix: str = "") -> str:
        """``median [q1–q3]``."""
        return f"{self.median:{spec}}{suffix} [{self.q1:{spec}}–{self.q3:{spec}}]"


@dataclass(frozen=True)
class Comparison:
    """A configuration's samples against the baseline's, measured side by side.

    ``ratio`` = median(config) / median(baseline); ``paired`` = config / baseline of the
    samples taken in the same slot (same round), whose spread shows the noise.
    """

    wall: Spread
    cpu: Spread
    wall_ratio: float
    cpu_ratio: float
    wall_paired: Spread
    cpu_paired: Spread

    @classmethod
    def of(cls, mine: Sequence[Sample], base: Sequence[Sample]) -> Comparison:
        """Compare ``mine`` with ``base`` (paired by position)."""
        pairs = list(zip(mine, base, strict=False))
        return cls(
            wall=Spread.of([s.wall for s in mine]),
            cpu=Spread.of([s.cpu for s in mine]),
            wall_ratio=median_of(mine, "wall") / median_of(base, "wall"),
            cpu_ratio=median_of(mine, "cpu") / median_of(base, "cpu"),
            wall_paired=Spread.of([a.wall / b.wall for a, b in pairs]),
            cpu_paired=Spread.of([a.cpu / b.cpu for a, b in pairs]),
        )


def median_of(samples: Sequence[Sample], attr: str) -> float:
    """Median of the ``attr`` (``"wall"`` or ``"cpu"``) of ``samples``."""
    return statistics.median(getattr(s, attr) for s in samples)


def rotated(names: Sequence[str], shift: int) -> list[str]:
    """``names`` rotated left by ``shift``, so that every configuration takes every slot."""
    shift %= len(names)
    return [*names[shift:], *names[:shift]]


def alternate(
    names: Sequence[str], rounds: int, run: Callable[[str, int], object], label: str = ""
) -> list[float]:
    """The interleaved-rounds skeleton of every side-by-side benchmark: ``rounds`` rounds of
    ``run(name, round)`` for each of ``names``, order rotated each round (so that every
    configuration takes every slot). Returns the 1-minute load average after each round."""
    loads = []
    for round_ in range(rounds):
        for name in rotated(names, round_):
            run(name, round_)
        loads.append(load_average())
        print(f"  {label}round {round_ + 1}/{rounds}", flush=True)
    return loads


def verdict(ratio: float, target: float | None) -> str:
    """``yes`` / ``**no**`` against ``target`` (empty without one)."""
    if target is None:
        return ""
    return "yes" if ratio <= target else "**no**"


def contention_note(name: str, base: Sequence[Sample]) -> str:
    """A warning when the baseline's wall time far exceeds its CPU time (the process waited
    for a core that other processes held), else nothing."""
    wall, cpu = median_of(base, "wall"), median_of(base, "cpu")
    if wall <= CONTENDED * cpu:
        return ""
    return (
        f"**Warning:** other processes competed for the cores while timing {name} (baseline "
        f"wall / CPU = {wall / cpu:.2f}); wall-time ratios are noisier there, the CPU ratios "
        "are the steadier reading."
    )


# -- memory ----------------------------------------------------------------------------


def _proc_status_kb(key: str) -> float:
    """A ``kB`` field of ``/proc/self/status`` (Linux), else NaN."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return float(line.split()[1])
    except OSError:
        pass
    return float("nan")


def peak_rss_mb() -> float:
    """This process's peak RSS since start or the last :func:`reset_peak_rss` (``VmHWM``).

    ``VmHWM`` belongs to the process's own address space, unlike ``ru_maxrss``, which a
    child inherits from its parent's high-water mark across fork and exec.
    """
    return _proc_status_kb("VmHWM") / 1024


def reset_peak_rss() -> bool:
    """Give freed heap back to the OS (``malloc_trim``), then reset ``VmHWM`` to the current
    RSS (``/proc/self/clear_refs`` value 5), so that the next peak is one phase's own.
    Returns False where the reset is not available."""
    with suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@contextmanager
def phase_peak(peaks: dict[str, float], name: str) -> Iterator[None]:
    """Record in ``peaks[name]`` the peak RSS (MB) reached inside the block (max over
    repeated phases of the same name)."""
    reset_peak_rss()
    try:
        yield
    finally:
        peaks[name] = max(peaks.get(name, 0.0), peak_rss_mb())


def run_child(script: Path, args: Sequence[str]) -> dict[str, Any]:
    """Run ``script`` with ``args`` in a fresh Python process; parse its last stdout line
    as JSON (the child's report)."""
    cmd = [sys.executable, str(script), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"child {shlex.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- models and data -------------------------------------------------------------------

#: Config keyword arguments of a transformers model.
ModelConfig = dict[str, Any]


def causal_lm(config_cls: str, model_cls: str, seed: int = 0, **config: Any) -> nn.Module:
    """A transformers causal LM built from its config: fp32, seeded random init."""
    import transformers

    cfg = getattr(transformers, config_cls)(pad_token_id=0, **config)
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(cfg).to(torch.float32)


def llama(
    vocab: int, *, hidden: int, intermediate: int, layers: int, heads: int, **more: Any
) -> ModelConfig:
    """Config keyword arguments of a Llama-style decoder (Llama, Qwen2): the sizes in the
    order of the arguments, ``num_key_value_heads`` (default ``heads``), then ``more``
    (transformers' own names: ``num_key_value_heads``, ``tie_word_embeddings``)."""
    config = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate)
    config |= dict(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads)
    return config | more


def parameter_count(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of (distinct) parameters of ``model``, or of its trainable ones."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def token_rows(count: int, length: int, vocab: int, seed: int) -> Tensor:
    """``(count, length)`` random token ids in ``[1, vocab)`` (0 is the pad id)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (count, length), generator=gen)


def with_lora(model: nn.Module, rank: int) -> nn.Module:
    """PEFT LoRA of rank ``rank`` on every linear layer except the output head."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
    return get_peft_model(model, config)


# -- Trainer plumbing ------------------------------------------------------------------


class RowDataset(torch.utils.data.Dataset):
    """A map-style dataset of fixed-length token rows: ``{"input_ids": (T,) int64}``."""

    def __init__(self, rows: Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.rows[index]}


def collate_rows(features: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack equal-length rows into a causal-LM batch (no padding; labels = inputs)."""
    ids = torch.stack([f["input_ids"] for f in features])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def quiet_transformers() -> None:
    """Errors only from transformers' logger, and no deprecation ``FutureWarning``s."""
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)


def training_args(output_dir: Path, steps: int, batch: int, **overrides: Any) -> TrainingArguments:
    """CPU, fp32, AdamW at a constant learning rate, ``steps`` optimizer steps of ``batch``
    examples; no logging, checkpoints, reporting or progress bar; ``overrides`` win."""
    options: dict[str, Any] = dict(output_dir=str(output_dir), max_steps=steps, seed=0)
    options |= dict(optim="adamw_torch", learning_rate=1e-4, lr_scheduler_type="constant")
    options |= dict(per_device_train_batch_size=batch, gradient_accumulation_steps=1)
    options |= dict(
        use_cpu=True, bf16=False, dataloader_drop_last=True, remove_unused_columns=False
    )
    options |= dict(report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    options.update(overrides)
    return TrainingArguments(**options)


def make_trainer(
    model: nn.Module,
    rows: Tensor,
    args: TrainingArguments,
    callbacks: Sequence[TrainerCallback],
    processing_class: Any = None,
) -> Trainer:
    """A ``Trainer`` over ``rows`` (fixed-length token rows) with ``callbacks`` in order
    (and ``processing_class``, the tokenizer callbacks get); the end-of-run metrics are
    not printed."""
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RowDataset(rows),
        data_collator=collate_rows,
        callbacks=list(callbacks),
        processing_class=processing_class,
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


@dataclass
class StepTimer(TrainerCallback):
    """Times each optimizer step from ``on_step_begin`` to ``on_step_end``.

    Put it first in the trainer's callbacks, so that its ``on_step_begin`` runs before any
    other callback's (a data-selection callback captures its target pool there); batch
    loading is outside the window, the forward, backward, clipping, optimizer step and
    ``zero_grad`` inside. Each ``train()`` call is a run: ``runs[-1]`` holds its steps.
    """

    runs: list[list[Sample]] = field(default_factory=list)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.runs.append([])

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._start = Mark.now()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.runs[-1].append(self._start.elapsed())

    def timed(self, warmup: int) -> list[Sample]:
        """Every run's steps after its first ``warmup`` steps, in order."""
        return [s for run in self.runs for s in run[warmup:]]


def runs_needed(repeats: int, steps_per_run: int, warmup_steps: int) -> int:
    """Alternating runs per configuration that give at least ``repeats`` timed steps."""
    return math.ceil(repeats / (steps_per_run - warmup_steps))


# -- profiling -------------------------------------------------------------------------

#: A function as pstats names it: (file name suffix, function name).
FuncRef = tuple[str, str]


class StepProfiler(TrainerCallback):
    """cProfile over the optimizer steps after the first ``warmup`` ones of a run, from
    ``on_step_begin`` to ``on_step_end`` (put it first, like :class:`StepTimer`). It counts
    this process's CPU time (``time.process_time``), so that other processes on the
    machine do not inflate the split."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.steps = 0
        self.profiler = cProfile.Profile(time.process_time)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= self.warmup:
            self.profiler.enable()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step > self.warmup:  # global_step has already advanced
            self.profiler.disable()
            self.steps += 1

    def table(self) -> dict[tuple[str, int, str], tuple]:
        """The raw pstats table of the profiled steps."""
        return pstats.Stats(self.profiler).stats  # type: ignore[attr-defined]

    def split(self, parts: Mapping[str, Sequence[FuncRef]]) -> dict[str, float]:
        """Seconds per profiled step of each part (label -> the functions it sums, each
        with its cumulative time)."""
        table = self.table()
        return {
            label: sum(cumulative_seconds(table, ref) for ref in refs) / self.steps
            for label, refs in parts.items()
        }


def cumulative_seconds(table: Mapping[tuple[str, int, str], tuple], ref: FuncRef) -> float:
    """Cumulative seconds (own time plus callees) of every function matching ``ref``."""
    suffix, name = ref
    return sum(
        row[3] for (path, _, func), row in table.items() if func == name and path.endswith(suffix)
    )


# -- reporting -------------------------------------------------------------------------


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark has: ``--quick``, ``--write``,
    ``--results``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny smoke run in seconds (no write)")
    p.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        help="update the results file (default: on, except with --quick)",
    )
    p.add_argument("--results", type=Path, default=RESULTS, help="markdown file to update")
    return p


def add_step_flags(
    p: argparse.ArgumentParser, *, seq: int, repeats: int, steps_per_run: int, profiled: str
) -> None:
    """The flags of a benchmark that times ``Trainer`` steps in alternating short runs
    (defaults ``seq``, ``repeats``, ``steps_per_run``; ``profiled``: what its cProfiled
    steps are); :func:`step_settings` reads them."""
    p.add_argument("--seq", type=int, help=f"sequence length (default {seq}; quick 16)")
    p.add_argument("--batch", type=int, default=8, help="examples per step")
    p.add_argument("--repeats", type=int, help=f"timed steps per configuration (default {repeats})")
    p.add_argument(
        "--steps-per-run", type=int, default=steps_per_run, help="steps of one train() run"
    )
    p.add_argument("--warmup-steps", type=int, default=1, help="discarded steps of each run")
    p.add_argument("--profile-steps", type=int, help=f"cProfiled {profiled} steps (default 3)")


def step_settings(a: argparse.Namespace, *, seq: int, repeats: int) -> dict[str, Any]:
    """The settings of :func:`add_step_flags`'s flags, defaults resolved (``--quick``: 16
    tokens, 3 repeats, 1 profiled step), and ``quick``, ``write``, ``results``."""
    quick = a.quick
    return dict(
        seq=a.seq or (16 if quick else seq),
        batch=a.batch,
        repeats=a.repeats or (3 if quick else repeats),
        steps_per_run=a.steps_per_run,
        warmup_steps=a.warmup_steps,
        profile_steps=a.profile_steps if a.profile_steps is not None else (1 if quick else 3),
        quick=quick,
        write=a.write if a.write is not None else not quick,
        results=a.results,
    )


def require_steps(p: argparse.ArgumentParser, settings: Any, positive: Sequence[str]) -> None:
    """Refuse step settings that cannot give a valid measurement: ``positive`` (and the
    step flags) below 1, a warm-up that leaves no timed step, too few repeats."""
    require_positive(p, settings, ("seq", "batch", *positive, "repeats", "steps_per_run"))
    if not 0 <= settings.warmup_steps < settings.steps_per_run:
        p.error("--warmup-steps must be in [0, --steps-per-run)")
    require_repeats(p, settings.repeats, quick=settings.quick)


def require_positive(p: argparse.ArgumentParser, settings: object, names: Sequence[str]) -> None:
    """Refuse (``p.error``) settings among ``names`` below 1, naming their flags."""
    for name in names:
        if getattr(settings, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")


def require_repeats(p: argparse.ArgumentParser, repeats: int, *, quick: bool) -> None:
    """Refuse (``p.error``) fewer than :data:`MIN_REPEATS` timed repeats outside ``--quick``."""
    if repeats < MIN_REPEATS and not quick:
        p.error(
            f"--repeats must be >= {MIN_REPEATS} (docs/design.md section 12); use --quick to smoke"
        )


def command_line(script: str, argv: Sequence[str]) -> str:
    """The exact command, with the environment variables that matter, as run from the repo."""
    env = [f"{k}={os.environ[k]}" for k in ENV_VARS if k in os.environ]
    python = Path(sys.executable)
    if python.is_relative_to(REPO):
        python = python.relative_to(REPO)
    return " ".join([*env, shlex.join([str(python), script, *argv])])


def machine_info() -> str:
    """CPU count and model, torch threads, library versions, OS."""
    import transformers

    cpu = platform.processor() or "unknown CPU"
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return (
        f"{os.cpu_count()} CPUs ({cpu}), torch {torch.__version__} on "
        f"{torch.get_num_threads()} thread(s), transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def utc_now() -> str:
    """The current time, ``YYYY-MM-DD HH:MM UTC``."""
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def load_average() -> float:
    """The 1-minute load average (other processes on the machine), NaN where unknown."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def heading(section: str, script: str, argv: Sequence[str], loads: Sequence[float]) -> str:
    """The start of every results section: its heading, the command that produced it, the
    date, the machine and the load average during the run."""
    return (
        f"{section}\n\nCommand: `{command_line(script, argv)}`\n\n"
        f"Date: {utc_now()}. Machine: {machine_info()}; {load_text(loads)}."
    )


def load_text(loads: Sequence[float]) -> str:
    """The load averages sampled during a run, as a phrase."""
    if not loads:
        return "load average not sampled"
    return "1-min load average during the run " + ", ".join(f"{x:.1f}" for x in loads)


def tidy(markdown: str) -> str:
    """Collapse runs of blank lines (left by empty optional parts of a section)."""
    return re.sub(r"\n{3,}", "\n\n", markdown).strip() + "\n"


def write_section(path: Path, heading: str, section: str) -> None:
    """Replace the section that starts with ``heading`` in ``path`` (or append it), keeping
    every other section; create the file with its title if missing."""
    text = path.read_text() if path.exists() else RESULTS_TITLE + "\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.M | re.S)
    block = section.rstrip() + "\n\n"
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + block
    path.write_text(text.rstrip() + "\n")


def publish(section: str, heading: str, results: Path, write: bool) -> None:
    """Print ``section``; write it into ``results`` when asked."""
    print("\n" + section)
    if write:
        write_section(results, heading, section)
        print(f"updated {results}")
