"""The default selection rule on data-parallel ranks: what ``step_cosine``'s global Gram
matrix costs against a rule over scores, and whether 2 ranks drop what one process drops.

SmolLM2-135M-Instruct (the demo's converted checkpoint, ``recipes/smollm2.py``, converted
once if missing) with PEFT LoRA r=8 on every linear layer, TRL's ``SFTTrainer``, ``--rows``
prompt/completion rows of Python's own documentation (``pydoc_data.topics``: "Explain
<topic> (part k)." and the topic's k-th 60 words, first parts first; ids from 1000), on 2
ranks under ``torchrun`` (gloo on the CPU, ``use_cpu=True``), 2 rows per rank and step (a
global batch of 4), one epoch, against a target of 3 rows (two training rows and one
written apart). Arms, alternated round by round: ``plain`` (no callback),
``bottom_fraction`` (``DataSelectionCallback(target, rule="bottom_fraction")``:
Adam-metric scores, a few floats per example gathered) and ``step_cosine`` (the
callback's defaults: every example's gradient gathered for the Gram matrix), and
``step_cosine_per_layer``, the same with each layer's ``.grad`` correction all-reduced
on its own (``surgery.REDUCE_BUCKET_BYTES = 0``, as before the bucketed all-reduce). Timed:
``trainer.train()`` on rank 0. Reported: each arm's median (range) over the rounds and its
ratio to ``plain``, and ``step_cosine`` over ``bottom_fraction`` and over
``step_cosine_per_layer``. Last, per size,
``step_cosine`` once in one process with batches of 4 on the same rows: its
``selection.jsonl`` against the first 2-rank run's, step by step.

    python benchmarks/selection_ranks.py --rows 24 40 --rounds 2
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, base_parser, heading, load_average, publish, rotated, tidy

SECTION = "## The default rule on data-parallel ranks (step_cosine's global Gram)"
ARMS = ("plain", "bottom_fraction", "step_cosine", "step_cosine_per_layer")
RANKS = 2
PER_RANK = 2
TARGET_EXTRA = {
    "prompt": "Explain loops.",
    "completion": "A for loop repeats its body for each item.",
}


def available_rows(topics: dict[str, str]) -> list[dict[str, str]]:
    """Prompt/completion rows of the documentation topics: each topic's consecutive
    60-word parts (at most 4), the first parts of every topic first."""
    parts: list[list[dict[str, str]]] = [[] for _ in range(4)]
    for key, text in sorted(topics.items()):
        words = text.split()
        for k in range(min(4, len(words) // 60)):
            part = " ".join(words[60 * k : 60 * (k + 1)])
            parts[k].append({"prompt": f"Explain {key} (part {k + 1}).", "completion": part})
    return [row for rows in parts for row in rows]


def write_rows(folder: Path, count: int) -> tuple[Path, Path]:
    """``train.jsonl`` (``count`` rows) and ``target.jsonl`` (3 rows) in ``folder``."""
    from pydoc_data.topics import topics

    rows = available_rows(topics)
    rows = [{**row, "id": 1000 + i} for i, row in enumerate(rows[:count])]
    train, target = folder / "train.jsonl", folder / "target.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    target_rows = [rows[0], rows[min(7, count - 1)], {**TARGET_EXTRA, "id": 1}]
    target.write_text("".join(json.dumps(r) + "\n" for r in target_rows))
    return train, target


def worker(arm: str, folder: Path, batch: int) -> None:
    """One training run of ``arm`` (under torchrun or alone); rank 0 writes
    ``folder/result.json`` (its train seconds)."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    sys.path.insert(0, str(REPO))
    from recipes.smollm2 import DEFAULT_CACHE, smollm2_checkpoint
    from tda_plugins import DataSelectionCallback, use_id_column
    from tda_plugins.data_selection import surgery

    torch.manual_seed(0)
    checkpoint = smollm2_checkpoint(DEFAULT_CACHE)
    if checkpoint is None:
        raise SystemExit("SmolLM2-135M-Instruct is not installed: run `make demo` once")
    target = str(folder.parent / "target.jsonl")
    callbacks = {
        "plain": [],
        "bottom_fraction": [DataSelectionCallback(target=target, rule="bottom_fraction")],
        "step_cosine": [DataSelectionCallback(target=target)],
        "step_cosine_per_layer": [DataSelectionCallback(target=target)],
    }[arm]
    if arm == "step_cosine_per_layer":  # each layer's correction all-reduced on its own
        surgery.REDUCE_BUCKET_BYTES = 0
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(checkpoint),
        args=SFTConfig(
            output_dir=str(folder),
            num_train_epochs=1,
            per_device_train_batch_size=batch,
            report_to=[],
            bf16=False,
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
        ),
        train_dataset=load_dataset(
            "json", data_files=str(folder.parent / "train.jsonl"), split="train"
        ),
        processing_class=AutoTokenizer.from_pretrained(checkpoint),
        peft_config=LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=callbacks,
    )
    use_id_column(trainer, "id")
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    if trainer.args.process_index == 0:
        (folder / "result.json").write_text(json.dumps({"seconds": seconds}))


def launch(arm: str, folder: Path, ranks: int) -> float:
    """``arm`` on ``ranks`` processes (a global batch of ``RANKS * PER_RANK`` either way);
    its train seconds."""
    folder.mkdir(parents=True)
    batch = RANKS * PER_RANK // ranks
    script = [str(Path(__file__).resolve()), "--worker", arm, str(folder), str(batch)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command = (
        [*launcher, f"--nproc-per-node={ranks}", *script]
        if ranks > 1
        else [
            sys.executable,
            *script,
        ]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{arm} on {ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    return float(json.loads((folder / "result.json").read_text())["seconds"])


def dropped(folder: Path) -> dict[int, list[int]]:
    lines = (folder / "selection.jsonl").read_text().splitlines()
    return {row["step"]: sorted(row["dropped_ids"]) for row in map(json.loads, lines)}


def spread(values: list[float]) -> str:
    low, high = min(values), max(values)
    middle = statistics.median(values)
    return f"{middle:.2f}" if high - low < 0.005 else f"{middle:.2f} ({low:.2f}-{high:.2f})"


def measure(rows: int, rounds: int, loads: list[float]) -> tuple[str, str]:
    """The arms alternated ``rounds`` times on ``rows`` rows, then the one-process run: this
    size's table rows (times, ratios) and its comparison line."""
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="selection-ranks-") as temp:
        root = Path(temp)
        write_rows(root, rows)
        for round_ in range(rounds):
            for arm in rotated(ARMS, round_):
                times[arm].append(launch(arm, root / f"{arm}-{round_}", RANKS))
                print(
                    f"  {rows} rows, round {round_ + 1} {arm}: {times[arm][-1]:.1f} s", flush=True
                )
            loads.append(load_average())
        launch("step_cosine", root / "one-process", 1)
        two, one = dropped(root / "step_cosine-0"), dropped(root / "one-process")
    base = times["plain"]
    table = "\n".join(
        f"| {rows} | {arm} | {spread(times[arm])} | "
        f"{spread([t / b for t, b in zip(times[arm], base, strict=True)])}x |"
        for arm in ARMS
    )
    over = [c / b for c, b in zip(times["step_cosine"], times["bottom_fraction"], strict=True)]
    buckets = [
        c / b for c, b in zip(times["step_cosine"], times["step_cosine_per_layer"], strict=True)
    ]
    same = sum(two.get(step) == ids for step, ids in one.items())
    total = sum(len(ids) for ids in one.values())
    line = f"| {rows} | {spread(over)}x | {spread(buckets)}x | {same} of {len(one)} | {total} |"
    return table, line


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--worker":
        worker(argv[1], Path(argv[2]), int(argv[3]))
        return
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--rows", type=int, nargs="+", default=[40], help="training rows (multiples of 4)"
    )
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds of the arms")
    a = p.parse_args(argv)
    sizes, rounds = ([8], 1) if a.quick else (a.rows, a.rounds)
    from pydoc_data.topics import topics

    most = len(available_rows(topics))
    if max(sizes) > most or any(rows % (RANKS * PER_RANK) for rows in sizes):
        p.error(f"--rows: multiples of {RANKS * PER_RANK}, at most {most} (the documentation's)")
    loads: list[float] = []
    measured = [measure(rows, rounds, loads) for rows in sizes]
    tables = "\n".join(table for table, _ in measured)
    lines = "\n".join(line for _, line in measured)
    section = tidy(
        f"""{heading(SECTION, "benchmarks/selection_ranks.py", argv, loads)}

{RANKS} ranks x {PER_RANK} rows a step, {rounds} round(s); seconds of `trainer.train()` on
rank 0, median (range over the rounds):

| rows | arm | seconds | over plain |
|---|---|---:|---:|
{tables}

`step_cosine` over `bottom_fraction` and over `step_cosine_per_layer` (per round), and
`step_cosine` on {RANKS} ranks against one process (batches of {RANKS * PER_RANK}, the
same rows): the steps at which both dropped the same examples, and how many the
one-process run dropped:

| rows | step_cosine / bottom_fraction | / step_cosine_per_layer | same drops | dropped |
|---|---:|---:|---:|---:|
{lines}
"""
    )
    publish(section, SECTION, a.results, a.write if a.write is not None else not a.quick)


if __name__ == "__main__":
    main(sys.argv[1:])
