"""Soak run: a long HF ``Trainer`` run with capture and data selection, killed and resumed.

    python benchmarks/soak.py --steps 2000 --kills 10

Trains a tiny Llama (full fine-tuning, ``layers="all"``) with ``GradientCaptureCallback``
and ``DataSelectionCallback`` for ``--steps`` optimizer steps, checkpointing every
``--save-every`` steps, twice in fresh processes:

* the reference: one uninterrupted run;
* the soak: the same run, killed with SIGKILL at ``--kills`` random steps (the kill lands
  wherever the process is when the driver sees the step, possibly inside a checkpoint or a
  store write) and each time resumed with ``resume_from_checkpoint=True``.

It then checks what a user relies on, and exits non-zero if any fails:

* the soak's store equals the reference's: the same (step, example id) pairs and the same
  gradients (largest relative error printed; resumed steps recompute from a checkpoint, so
  equality is up to the kernels' run-to-run rounding);
* the last selection of every step (``selection.jsonl``) equals the reference's;
* nothing outside the store and the trainer's own output folder was written or changed (a
  sentinel file beside the store keeps its bytes), and no temporary file is left in the
  store;
* resident memory is flat: the least-squares slope of the reference run's RSS over its
  steps after the first tenth, in MB per 1,000 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import (
    REPO,
    base_parser,
    causal_lm,
    command_line,
    llama,
    machine_info,
    make_trainer,
    publish,
    quiet_transformers,
    token_rows,
    training_args,
    utc_now,
)
from transformers import TrainerCallback

from tda_plugins.integrations.transformers import DataSelectionCallback, GradientCaptureCallback
from tda_plugins.store import StoreReader

VOCAB = 64
LENGTH = 16
ROWS = 256
BATCH = 4
HEADING = "## Soak: kill and resume (benchmarks/soak.py)"


class Progress(TrainerCallback):
    """Appends ``{"step", "rss_mb"}`` to a JSONL file at the end of every step."""

    def __init__(self, path: Path):
        self.path = path

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with self.path.open("a") as f:
            f.write(json.dumps({"step": state.global_step, "rss_mb": rss / 2**20}) + "\n")


def train(folder: Path, steps: int, save_every: int, resume: bool) -> None:
    """One training process (the driver starts it, and kills it in the soak)."""
    quiet_transformers()
    torch.set_num_threads(1)
    sizes = llama(VOCAB, hidden=32, intermediate=64, layers=2, heads=2)
    model = causal_lm("LlamaConfig", "LlamaForCausalLM", **sizes, max_position_embeddings=LENGTH)
    rows = token_rows(ROWS, LENGTH, VOCAB, seed=0)
    target = [{"input_ids": r.tolist()} for r in token_rows(4, LENGTH, VOCAB, seed=1)]
    args = training_args(
        folder / "trainer",
        steps,
        BATCH,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=save_every,
        save_total_limit=2,
    )
    callbacks = [
        GradientCaptureCallback(store_dir=str(folder / "store"), layers="all"),
        DataSelectionCallback(
            target=target,
            fraction=0.25,
            layers="all",
            log_path=str(folder / "selection.jsonl"),
        ),
        Progress(folder / "progress.jsonl"),
    ]
    make_trainer(model, rows, args, callbacks).train(resume_from_checkpoint=resume or None)


def _child(folder: Path, steps: int, save_every: int, resume: bool) -> subprocess.Popen[bytes]:
    command = [sys.executable, __file__, "--child", str(folder), "--steps", str(steps)]
    command += ["--save-every", str(save_every)] + (["--resume"] if resume else [])
    return subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE)


def _last_step(folder: Path) -> int:
    path = folder / "progress.jsonl"
    if not path.exists():
        return -1
    lines = path.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else -1


def _finish(process: subprocess.Popen[bytes]) -> None:
    _, err = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"training process failed:\n{err.decode()[-4000:]}")


def soak(folder: Path, steps: int, save_every: int, kills: int, seed: int) -> list[int]:
    """Run, killing at ``kills`` random steps, until the run completes; the kill steps."""
    rng = random.Random(seed)
    # Distinct kill steps, each past a checkpoint that the previous resume can restart from.
    points = sorted(rng.sample(range(save_every + 1, steps), kills))
    killed, resume = [], False
    for point in points:
        process = _child(folder, steps, save_every, resume)
        while _last_step(folder) < point and process.poll() is None:
            time.sleep(0.01)
        if process.poll() is not None:
            _finish(process)
            break
        process.send_signal(signal.SIGKILL)
        process.wait()
        killed.append(_last_step(folder))
        resume = True
    else:
        _finish(_child(folder, steps, save_every, resume))
    return killed


def _by_key(store: Path) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    chunk = StoreReader(store).load_all()
    dense = {name: grads.materialize() for name, grads in chunk.layers.items()}
    return {
        (int(step), int(example)): {name: g[row] for name, g in dense.items()}
        for row, (step, example) in enumerate(zip(chunk.steps, chunk.example_ids, strict=True))
    }


def _selections(path: Path) -> dict[int, list[int]]:
    """Step -> dropped ids of its last logged selection (a resumed step is logged again)."""
    out: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = sorted(row["dropped_ids"])
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of ``(step, MB)`` points, MB per 1,000 steps."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    cov = sum((x - mean_x) * (y - mean_y) for x, y in points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return 1000 * cov / var


def check(reference: Path, soaked: Path, outside_before: dict[str, bytes]) -> dict[str, Any]:
    """Compare the two runs; the failed checks are listed under ``"failures"``."""
    failures = []
    want, got = _by_key(reference / "store"), _by_key(soaked / "store")
    if want.keys() != got.keys():
        failures.append(
            f"store keys differ: {len(want.keys() - got.keys())} missing, "
            f"{len(got.keys() - want.keys())} extra"
        )
    worst = 0.0
    for key in want.keys() & got.keys():
        for name, value in want[key].items():
            diff = (got[key][name] - value).norm() / value.norm().clamp_min(1e-30)
            worst = max(worst, float(diff))
    if worst > 1e-5:
        failures.append(f"stored gradients differ by {worst:.2e}")
    if _selections(reference / "selection.jsonl") != _selections(soaked / "selection.jsonl"):
        failures.append("selection differs from the uninterrupted run")
    own = {"store", "trainer", "progress.jsonl", "selection.jsonl"}
    outside = {k: v for k, v in _files(soaked).items() if k.split("/")[0] not in own}
    if outside != outside_before:
        failures.append("a file outside the store changed")
    leftovers = [p.name for p in (soaked / "store").rglob("*") if ".tmp-" in p.name]
    if leftovers:
        failures.append(f"temporary files left in the store: {leftovers[:3]}")
    rows = [json.loads(line) for line in (reference / "progress.jsonl").read_text().splitlines()]
    tail = [(r["step"], r["rss_mb"]) for r in rows[len(rows) // 10 :]]
    return {
        "examples": len(want),
        "worst_rel_error": worst,
        "rss_slope_mb_per_1000_steps": _slope(tail),
        "rss_mb_first_last": (tail[0][1], tail[-1][1]),
        "failures": failures,
    }


def main(argv: list[str]) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0, help="which steps the kills land on")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "soak")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        train(args.child, args.steps, args.save_every, args.resume)
        return 0
    if args.quick:
        args.steps, args.kills, args.save_every = 60, 2, 10
    reference, soaked = args.out / "reference", args.out / "soak"
    for folder in (reference, soaked):
        if folder.exists():
            raise SystemExit(f"{folder} exists: remove it or pass another --out")
        folder.mkdir(parents=True)
    (soaked / "sentinel.txt").write_text("a file beside the store that nothing may touch\n")
    outside = _files(soaked)
    start = time.perf_counter()
    _finish(_child(reference, args.steps, args.save_every, resume=False))
    plain = time.perf_counter() - start
    start = time.perf_counter()
    killed = soak(soaked, args.steps, args.save_every, args.kills, args.seed)
    soaked_time = time.perf_counter() - start
    result = check(reference, soaked, outside)
    result.update(killed_at=killed, wall_ratio=soaked_time / plain)
    print(json.dumps(result, indent=1))
    lines = [
        HEADING,
        "",
        f"Command: `{command_line('benchmarks/soak.py', argv)}`",
        "",
        f"Date: {utc_now()}. Machine: {machine_info()}.",
        "",
        f"Tiny Llama, full fine-tuning, capture and selection (`layers='all'`), {args.steps} "
        f"steps of {BATCH} examples, a checkpoint every {args.save_every} steps; killed "
        f"(SIGKILL) after steps {', '.join(map(str, killed))} and resumed each time.",
        "",
        "| check | result |",
        "|---|---|",
        f"| store equal to the uninterrupted run | {result['examples']} (step, id) pairs, "
        f"largest relative difference {result['worst_rel_error']:.1e} |",
        "| last selection of every step equal | "
        f"{'yes' if 'selection differs' not in str(result['failures']) else '**no**'} |",
        "| files outside the store untouched, no temporary file left | "
        f"{'yes' if not any('file' in f for f in result['failures']) else '**no**'} |",
        f"| RSS slope after the first tenth (uninterrupted run) | "
        f"{result['rss_slope_mb_per_1000_steps']:+.2f} MB per 1,000 steps "
        f"({result['rss_mb_first_last'][0]:.0f} -> {result['rss_mb_first_last'][1]:.0f} MB) |",
        f"| soak wall time / uninterrupted | {result['wall_ratio']:.2f}x |",
    ]
    write = args.write if args.write is not None else not args.quick
    publish("\n".join(lines), HEADING, args.results, write)
    if result["failures"]:
        print("FAILED: " + "; ".join(result["failures"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
