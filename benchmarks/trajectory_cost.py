"""What ``record_trajectory`` and ``adamw_influence`` cost, against GradDot's capture and
scoring of the same store.

Protocol (docs/design.md section 12), one process, Llama-architecture model built from its
config (random init, seed 0, fp32), HF ``Trainer`` with AdamW (``max_grad_norm=1.0``):

* **step time**: LoRA (r=8 on every linear layer but the head), alternating short
  ``trainer.train()`` runs (order rotated) of ``capture`` (``GradientCaptureCallback``,
  exact per-example gradients of every adapter, what GradDot and AdamW-influence read)
  and ``capture+trajectory`` (the same with ``record_trajectory=True``); each step timed
  ``on_step_begin`` -> ``on_step_end``, the first step of each run discarded, medians
  and paired ratios over at least ``--repeats`` steps per configuration.
* **storage per step**: bytes on disk of the store's shards and of the trajectory's step
  files, per optimizer step, for that LoRA run and for full fine-tuning of every linear
  layer (two steps).
* **scoring**: ``adamw_influence`` against ``graddot`` on the LoRA store (all its steps)
  with ``--queries`` queries, interleaved, median wall and CPU seconds.

Usage::

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \\
        .venv/bin/python benchmarks/trajectory_cost.py
    .venv/bin/python benchmarks/trajectory_cost.py --quick     # smoke run, no write
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from common import (
    Comparison,
    FuncRef,
    Sample,
    StepProfiler,
    StepTimer,
    Stopwatch,
    base_parser,
    causal_lm,
    command_line,
    contention_note,
    cumulative_seconds,
    load_average,
    load_text,
    machine_info,
    make_trainer,
    parameter_count,
    publish,
    quiet_transformers,
    rotated,
    runs_needed,
    tidy,
    token_rows,
    training_args,
    utc_now,
    with_lora,
)
from torch import nn

from tda_plugins import CaptureEngine, LayerSelection
from tda_plugins.api import causal_lm_losses
from tda_plugins.integrations.transformers import GradientCaptureCallback
from tda_plugins.methods import method_by_name
from tda_plugins.store import GradientStore, StoreReader
from tda_plugins.trajectory import TrajectoryReader

SECTION = "## Trajectory recording and AdamW-influence (benchmarks/trajectory_cost.py)"
SCRIPT = "benchmarks/trajectory_cost.py"
CAPTURE, TRAJECTORY = "capture", "capture+trajectory"
CONFIGS = (CAPTURE, TRAJECTORY)
LORA_RANK = 8
WARMUP = 1
MODEL = dict(
    vocab_size=8000,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
#: The recorder's own code, profiled per step (its hooks, and the waits for its writes).
PROFILED: dict[str, tuple[FuncRef, ...]] = {
    "recorder hooks (ids, loss scales, grad norms, step counts)": (
        ("trajectory/recorder.py", "on_micro_batch"),
        ("trajectory/recorder.py", "on_optimizer_step"),
    ),
    "after the update (read and copy exp_avg_sq, hand to the writer)": (
        ("trajectory/recorder.py", "after_update"),
    ),
    "waiting for the trajectory on disk (end of step)": (("trajectory/writer.py", "flush"),),
}
QUICK_MODEL = dict(MODEL, vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1)


def base_model(quick: bool, seq: int) -> nn.Module:
    config = QUICK_MODEL if quick else MODEL
    return causal_lm(
        "LlamaConfig", "LlamaForCausalLM", max_position_embeddings=seq, **config
    ).train()


def train_run(
    model: nn.Module,
    config: str,
    layers: str,
    work: Path,
    steps: int,
    batch: int,
    seq: int,
    first: StepProfiler | None = None,
) -> tuple[StepTimer, Path]:
    """One ``trainer.train()`` of ``steps`` steps capturing into a new store (``first``, a
    profiler, before the timer)."""
    timer = StepTimer()
    store = Path(tempfile.mkdtemp(prefix="store-", dir=work))
    callback = GradientCaptureCallback(
        store_dir=str(store),
        layers=layers,
        curvature=False,
        record_trajectory=config == TRAJECTORY,
    )
    vocab = int(model.config.vocab_size)
    rows = token_rows(steps * batch, seq, vocab, seed=4)
    args = training_args(work / "out", steps, batch)
    callbacks = [timer, callback] if first is None else [first, timer, callback]
    make_trainer(model, rows, args, callbacks).train()
    return timer, store


def capture_queries(model: nn.Module, rows: torch.Tensor, path: Path) -> StoreReader:
    """The queries' exact gradients (each one's summed token loss) at ``model``'s weights."""
    batch = {"input_ids": rows, "attention_mask": torch.ones_like(rows), "labels": rows.clone()}
    with CaptureEngine(model, LayerSelection("lora"), consumers=[GradientStore(path)]) as engine:
        causal_lm_losses(model, batch).sum().backward()
        engine.optimizer_step()
        engine.end()
    model.zero_grad(set_to_none=True)
    return StoreReader(path)


def bytes_per_step(store: Path) -> tuple[float, float]:
    """Bytes per step of the store's shards and of its trajectory's step files."""
    steps = len(StoreReader(store).steps)
    shards = sum(p.stat().st_size for p in (store / "rank-0").glob("s*.safetensors"))
    folder = store / "rank-0" / "trajectory"
    trajectory = sum(p.stat().st_size for p in folder.glob("t*.safetensors"))
    return shards / steps, trajectory / steps


def score_times(store: Path, queries: StoreReader, repeats: int) -> dict[str, list[Sample]]:
    """Interleaved scoring of the store by both methods."""
    out: dict[str, list[Sample]] = {"graddot": [], "adamw_influence": []}
    for round_ in range(repeats):
        for name in rotated(list(out), round_):
            with Stopwatch() as watch:
                method_by_name(name).score(StoreReader(store), queries)
            out[name].append(watch.sample)
    return out


def main(argv: Sequence[str]) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=12, help="timed steps per configuration")
    p.add_argument("--steps-per-run", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--score-repeats", type=int, default=5)
    a = p.parse_args(argv)
    if a.quick:
        a.repeats, a.steps_per_run, a.batch, a.seq, a.score_repeats = 2, 2, 2, 16, 1
    write = a.write if a.write is not None else not a.quick
    quiet_transformers()
    torch.manual_seed(0)
    base = base_model(a.quick, a.seq)
    models = {}
    for name in CONFIGS:
        torch.manual_seed(1)
        models[name] = with_lora(copy.deepcopy(base), LORA_RANK)
    samples: dict[str, list[Sample]] = {name: [] for name in CONFIGS}
    loads = []
    with tempfile.TemporaryDirectory(prefix="tda-trajectory-bench-") as tmp:
        work = Path(tmp)
        last: dict[str, Path] = {}
        for round_ in range(runs_needed(a.repeats, a.steps_per_run, WARMUP)):
            for name in rotated(CONFIGS, round_):
                timer, last[name] = train_run(
                    models[name], name, "lora", work, a.steps_per_run, a.batch, a.seq
                )
                samples[name] += timer.timed(WARMUP)
            loads.append(load_average())
            print(f"  round {round_ + 1}", flush=True)
        profiler = StepProfiler(WARMUP)
        train_run(
            models[TRAJECTORY], TRAJECTORY, "lora", work, a.steps_per_run, a.batch, a.seq, profiler
        )
        table = profiler.table()
        split = {
            label: sum(cumulative_seconds(table, ref) for ref in refs) / profiler.steps
            for label, refs in PROFILED.items()
        }
        lora_bytes = bytes_per_step(last[TRAJECTORY])
        captured = sum(
            t.numel()
            for t in map(
                TrajectoryReader(last[TRAJECTORY]).entry_parameters,
                StoreReader(last[TRAJECTORY]).layer_names,
            )
        )
        full = base_model(a.quick, a.seq)
        _, full_store = train_run(full, TRAJECTORY, "linear", work, 2, a.batch, a.seq)
        full_bytes = bytes_per_step(full_store)
        full_captured = sum(
            TrajectoryReader(full_store).entry_parameters(n).numel()
            for n in StoreReader(full_store).layer_names
        )
        vocab = int(base.config.vocab_size)
        query_rows = token_rows(a.queries, a.seq, vocab, seed=9)
        queries = capture_queries(models[TRAJECTORY], query_rows, work / "queries")
        scoring = score_times(last[TRAJECTORY], queries, a.score_repeats)
        examples = StoreReader(last[TRAJECTORY]).num_examples
    c = Comparison.of(samples[TRAJECTORY], samples[CAPTURE])
    base_c = Comparison.of(samples[CAPTURE], samples[CAPTURE])
    cpu_step = statistics.median(x.cpu for x in samples[CAPTURE])
    profile_rows = "\n".join(
        f"| {label} | {1e3 * sec:.1f} | {100 * sec / cpu_step:.2f}% |"
        for label, sec in split.items()
    )
    config = QUICK_MODEL if a.quick else MODEL
    shape = ", ".join(f"{k}={v}" for k, v in config.items())
    med = {
        n: (statistics.median(s.wall for s in v), statistics.median(s.cpu for s in v))
        for n, v in scoring.items()
    }
    section = tidy(f"""{SECTION}

Command: `{command_line(SCRIPT, argv)}`

Date: {utc_now()}. Machine: {machine_info()}; {load_text(loads)}.

HF `Trainer` (CPU, fp32, AdamW, `max_grad_norm=1.0`), batch {a.batch} x sequence {a.seq}. \
Model: `LlamaConfig({shape})` ({parameter_count(base) / 1e6:.2f}M parameters). LoRA r=\
{LORA_RANK} on every linear layer but the head; `capture` = `GradientCaptureCallback(\
layers="lora", curvature=False)` (exact gradients), `capture+trajectory` the same with \
`record_trajectory=True`. Runs of {a.steps_per_run} steps alternate (order rotated), the \
first step of each discarded: median of {len(samples[CAPTURE])} steps per configuration.

| configuration | step s, wall median [IQR] | wall ratio | step s, CPU median [IQR] \
| **CPU ratio** | paired CPU ratio [IQR] |
|---|---|---:|---|---:|---:|
| {CAPTURE} | {base_c.wall.text()} | 1.000x | {base_c.cpu.text()} | **1.000x** | 1.000x |
| {TRAJECTORY} | {c.wall.text()} | {c.wall_ratio:.3f}x | {c.cpu.text()} \
| **{c.cpu_ratio:.3f}x** | {c.cpu_paired.text(".3f", "x")} |

{contention_note(CAPTURE, samples[CAPTURE])}

The recorder's own CPU time per step ({profiler.steps} cProfiled `capture+trajectory` \
steps, cumulative), against the median `capture` step's {1e3 * cpu_step:.0f} ms of CPU:

| part | ms / step | % of the step |
|---|---:|---:|
{profile_rows}

Storage per optimizer step, bytes on disk (batch {a.batch} x {a.seq} tokens):

| run | captured parameters `D` | store shards (GradDot) | trajectory | trajectory / shards |
|---|---:|---:|---:|---:|
| LoRA | {captured:,} | {lora_bytes[0] / 2**20:.2f} MiB | {lora_bytes[1] / 2**20:.2f} MiB \
| {lora_bytes[1] / lora_bytes[0]:.3f}x |
| full fine-tuning, every linear layer | {full_captured:,} | {full_bytes[0] / 2**20:.2f} MiB \
| {full_bytes[1] / 2**20:.2f} MiB | {full_bytes[1] / full_bytes[0]:.3f}x |

Scoring the LoRA store ({examples} examples, {examples // a.batch} steps) against \
{a.queries} queries, interleaved, median of {a.score_repeats}: graddot \
{med["graddot"][0]:.2f} s wall / {med["graddot"][1]:.2f} s CPU, adamw_influence \
{med["adamw_influence"][0]:.2f} s / {med["adamw_influence"][1]:.2f} s \
({med["adamw_influence"][1] / med["graddot"][1]:.2f}x CPU).
""")
    publish(section, SECTION, a.results, write)


if __name__ == "__main__":
    main(sys.argv[1:])
