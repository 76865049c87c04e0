"""The data selection demo's report: the comparison table, the plot of every arm's curve,
and the JSON of every run."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from demo_arms import ARMS, GOOD_KINDS, TASK_KINDS, RunResult, SeedResult
from demo_data import TASKS


def spread(values: Sequence[float], digits: int = 3, scale: float = 1.0, unit: str = "") -> str:
    """``mean ± std{unit}`` over seeds (the value alone for one seed; ``—`` where a seed
    lacks it, e.g. the gap closed without the clean run)."""
    values = [v * scale for v in values]
    if any(math.isnan(v) for v in values):
        return "—"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}{unit}"
    mean, std = statistics.mean(values), statistics.stdev(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f}{unit}"


def results_table(results: Sequence[SeedResult], arms: Sequence[str], steps: int) -> str:
    """One row per arm: final target eval loss (the tasks' mean, and each), its difference
    from no selection on the same seed (each seed has its own evaluation split, so the
    paired figures are the ones to compare across arms), the share of the
    no-selection-to-clean gap it closes, what it dropped, and its step CPU time over no
    selection's (over the seeds whose runs recorded CPU times, saying how many when not
    all: runs reused from before they were recorded have none)."""
    seeds = ", ".join(str(r.seed) for r in results)
    header = [
        f"arm (seeds {seeds}; {steps} steps)",
        "target eval loss",
        *(f"{task} eval loss" for task in TASKS),
        "minus no selection (same seed)",
        "gap closed",
        "drop precision",
        "corrupted dropped (recall)",
        "good dropped",
        "target-task dropped",
        "CPU time / no selection",
    ]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for arm in arms:

        def each(read: Callable[[RunResult], float], arm: str = arm) -> list[float]:
            return [read(r.runs[arm]) for r in results]

        selects = results[0].runs[arm].selects
        cells = [
            ARMS[arm].label,
            spread(each(lambda run: run.final_loss)),
            *(spread(each(lambda run, t=task: run.final_task_loss(t))) for task in TASKS),
            "—"
            if arm == "none"
            else spread([r.runs[arm].final_loss - r.runs["none"].final_loss for r in results]),
            spread([r.gap_closed(arm) for r in results], 0, 100, " %")
            if arm not in ("none", "clean")
            else "—",
        ]
        if selects:
            cells += [
                spread(each(lambda run: run.precision), 0, 100, " %"),
                spread(each(lambda run: run.recall), 0, 100, " %"),
                spread(each(lambda run: run.share(GOOD_KINDS)), 0, 100, " %"),
                spread(each(lambda run: run.share(TASK_KINDS)), 0, 100, " %"),
            ]
        else:
            cells += ["—"] * 4
        ratios = [x for x in (r.time_ratio(arm) for r in results) if not math.isnan(x)]
        timed = "" if len(ratios) == len(results) else f" ({len(ratios)} of {len(results)} seeds)"
        cells.append(spread(ratios, 2) + "x" + timed if ratios else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(results: Sequence[SeedResult], arms: Sequence[str], path: Path, title: str) -> None:
    """Every arm's target eval loss (the tasks' mean) against the optimizer step: the mean
    over seeds, and with several seeds their range as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.2, 4.4))
    colors = plt.get_cmap("tab10")
    for index, arm in enumerate(arms):
        curves = [r.runs[arm].curve() for r in results]
        steps = [s for s, _ in curves[0]]
        losses = [[loss for _, loss in c] for c in curves]
        mean = [statistics.mean(column) for column in zip(*losses, strict=True)]
        style = "--" if arm in ("none", "clean") else "-"
        color = colors(index % 10)
        axes.plot(steps, mean, style, color=color, marker="o", markersize=3, label=ARMS[arm].label)
        if len(results) > 1:
            low = [min(column) for column in zip(*losses, strict=True)]
            high = [max(column) for column in zip(*losses, strict=True)]
            axes.fill_between(steps, low, high, color=color, alpha=0.12)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("target eval loss (mean of the two tasks)")
    axes.set_title(title)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(
    results: Sequence[SeedResult],
    arms: Sequence[str],
    out: Path,
    steps: int,
    context: dict[str, Any],
) -> str:
    """``results.json``, ``results.md`` (the table) and ``eval_loss.png`` into ``out``;
    returns the table."""
    write_json(results, arms, out, context)
    table = results_table(results, arms, steps)
    (out / "results.md").write_text(table + "\n")
    title = f"{context['model']}: LoRA SFT, {steps} steps"
    plot_curves(results, arms, out / "eval_loss.png", title)
    return table


def write_json(
    results: Sequence[SeedResult], arms: Sequence[str], out: Path, context: dict[str, Any]
) -> None:
    """Every run of ``results`` into ``out/results.json`` (also after each run, so that an
    interrupted job keeps what it measured)."""
    summary = {
        **context,
        "arms": list(arms),
        "seeds": [
            {"seed": r.seed, "runs": {a: dataclasses.asdict(run) for a, run in r.runs.items()}}
            for r in results
        ],
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1))


def read_results(path: Path) -> tuple[list[SeedResult], list[str], dict[str, Any]]:
    """The seeds, arms and context of a ``results.json``."""
    summary = json.loads(path.read_text())
    seeds = [
        SeedResult(s["seed"], {arm: RunResult(**run) for arm, run in s["runs"].items()})
        for s in summary.pop("seeds")
    ]
    return seeds, summary.pop("arms"), summary


def merge(out: Path, parts: Sequence[Path]) -> str:
    """One report from the ``results.json`` of runs of one seed each (the seeds of
    ``make demo-seeds`` run as parallel processes): the same arms and options but the seed
    are required. Writes the merged outputs into ``out``; returns the table."""
    seeds: list[SeedResult] = []
    arms: list[str] = []
    context: dict[str, Any] = {}
    for part in parts:
        found, part_arms, part_context = read_results(part / "results.json")
        options = {k: v for k, v in part_context["options"].items() if k not in ("seed", "out")}
        if context and (part_arms != arms or options != context["options"]):
            raise ValueError(f"{part} ran other arms or options than {parts[0]}")
        arms, context = part_arms, {**part_context, "options": options}
        context["parts"] = [*context.get("parts", []), part_context["command"]]
        seeds += found
    context["command"] = "merged: " + " && ".join(context.pop("parts"))
    out.mkdir(parents=True, exist_ok=True)
    steps = int(context["options"]["steps"])
    return write_outputs(sorted(seeds, key=lambda s: s.seed), arms, out, steps, context)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=merge.__doc__)
    parser.add_argument("--out", type=Path, required=True, help="where the merged report goes")
    parser.add_argument("parts", type=Path, nargs="+", help="output folders of one seed each")
    arguments = parser.parse_args()
    print(merge(arguments.out, arguments.parts))
