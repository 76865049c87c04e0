"""Attribution fidelity against leave-one-out retraining (the dattri-LLM protocol, small).

The protocol (dattri-LLM, appendix B.2, at CPU scale), on two replicas
(``fidelity_truth.py``):

* **Model**: a GPT-2-architecture ``GPT2LMHeadModel`` built from a config (byte vocabulary
  of 256, dropout off, fp32), starting from its seeded random init (replica ``random``)
  or from that model pre-trained on the leading topics of the text (replica
  ``pretrained``; cached).
* **Data**: real text available offline: Python's reference documentation
  (``pydoc_data.topics``) as UTF-8 bytes, cut into blocks of 128 byte tokens (the byte
  tokens of ``recipes/byte_text.py``); 512 distinct training blocks and 64 validation
  blocks drawn from it with a fixed seed (``pretrained``: from the topics pre-training
  never saw).
* **Training**: one epoch, batch 32 in a fixed order (16 AdamW steps, constant learning
  rate, fresh optimizer state), transformers' mean token loss, deterministic (one thread,
  ``torch.use_deterministic_algorithms``; ``fidelity_training.py``).
* **Leave-one-out**: for each of 50 removed training blocks (drawn with a fixed seed), the
  same run with that block skipped (its batch has 31 examples); the effect of block ``j``
  on validation block ``v`` is ``loss_v(without j) - loss_v(full)``, each loss the mean
  over the block's 127 predicted tokens, evaluated in fp64 on the fp32 weights. Results
  are cached under ``benchmarks/out/fidelity/`` keyed by the configuration, the data, the
  initial weights and the library versions.
* **Fidelity** (``fidelity_metric.py``): per validation block, the Spearman correlation
  between an attributor's scores of the 50 removed blocks and their leave-one-out effects;
  the mean over the 64 validation blocks with a percentile bootstrap 95% interval.
* **Linear datamodeling score (LDS)**: 100 runs, each on a random half of the training
  blocks, cached like the leave-one-out runs; per validation block, the Spearman over the
  subsets between the sum of an attributor's scores of the subset's blocks and minus the
  validation loss of the run trained on it.
* **Determinism**: a second run with nothing removed must reproduce the reference losses
  (the figure is the largest absolute difference); the rounding noise floor is a run on
  the same batches with each batch's rows in reverse order (the same gradient in exact
  arithmetic), compared with the size of the leave-one-out effects.

Attributors (``fidelity_methods.py``) get the trained state, the model factory, the
blocks and the training run, and return a ``(64, 512)`` score matrix; ours are the
library's methods, the peers' (``fidelity_peers.py``) plug in through the same registry,
and the report (``fidelity_report.py``, one section per replica) compares our best method
with the best peer by the paired bootstrap.

Usage::

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \\
        .venv/bin/python benchmarks/fidelity.py
    benchmarks/.venv-peers/bin/python benchmarks/fidelity.py   # ours and the peers
    .venv/bin/python benchmarks/fidelity.py --replicas pretrained --methods graddot ekfac
    .venv/bin/python benchmarks/fidelity.py --quick        # smoke run in seconds, no write
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import fidelity_trajectory  # noqa: F401  (registers the trajectory-aware rows)
import torch
import transformers
from common import REPO, Stopwatch, base_parser, load_average, parameter_count, publish
from fidelity_methods import (
    ATTRIBUTORS,
    FidelityTask,
    TrainingRun,
    per_layer_scores,
    store_method,
)
from fidelity_metric import Fidelity, GroundTruth
from fidelity_report import SECTION, AttributionRun, Diagnostics, report, to_json
from fidelity_training import StepHook, batches, train, validation_losses
from fidelity_truth import (
    CACHE,
    REPLICAS,
    FineTuning,
    leave_one_out,
    prepare,
    replica,
    subset_runs,
)
from peers.base import Unsupported
from torch import nn
from tqdm.auto import tqdm

JSON_OUT = REPO / "benchmarks" / "out" / "fidelity.json"
#: Relative dampings of the K-FAC / EK-FAC sweep (the methods' default is 0.1).
DAMPINGS = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0)


def make_task(fine: FineTuning, work: Path) -> FidelityTask:
    """The reference training run of ``fine``, packed for the attributors."""
    config, blocks = fine.config, fine.blocks
    model = fine.model()
    optimizer = train(config, blocks, model)

    def replay(
        fresh: nn.Module,
        hook: StepHook | None,
        *,
        after_update: StepHook | None = None,
        optimizer: torch.optim.AdamW | None = None,
    ) -> torch.optim.Optimizer:
        return train(
            config, blocks, fresh, hook=hook, after_update=after_update, optimizer=optimizer
        )

    run = TrainingRun(
        initial_state=fine.start.state,
        batches=tuple(batches(config, blocks)),
        adamw=config.adamw,
        replay=replay,
    )
    return FidelityTask(
        model_factory=fine.model,
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        optimizer_state=copy.deepcopy(optimizer.state_dict()),
        batch=config.batch,
        train=blocks.train,
        validation=blocks.validation,
        run=run,
        work=work,
    )


def attribute(
    task: FidelityTask, names: Sequence[str], truth: GroundTruth
) -> tuple[list[Fidelity], dict[str, Fidelity], dict[str, str]]:
    """Run each named attributor on ``task``, each in its own scratch directory (so its
    time is its whole cost); returns its leave-one-out fidelity, its LDS (by name) and,
    for the attributors that could not run, name -> why."""
    results, lds, skipped = [], {}, {}
    for name in tqdm(names, desc="attributors"):
        alone = replace(task, work=task.work / "attributors" / name.replace(":", "-"))
        try:
            with Stopwatch() as watch:
                scores = ATTRIBUTORS[name](alone)
        except Unsupported as why:
            skipped[name] = str(why)
            continue
        results.append(truth.leave_one_out(name, scores, watch.sample.wall))
        lds[name] = truth.lds(name, scores)
    return results, lds, skipped


def diagnose(task: FidelityTask, truth: GroundTruth) -> Diagnostics:
    """Damping sweep of K-FAC and EK-FAC, and per-layer GradDot and EK-FAC (leave-one-out)."""
    measured = truth.leave_one_out
    task = replace(task, work=task.work / "diagnostics")

    damping = {
        d: (
            measured(f"kfac damping={d:g}", store_method("kfac", None, task, damping=d)),
            measured(f"ekfac damping={d:g}", store_method("ekfac", None, task, damping=d)),
        )
        for d in tqdm(DAMPINGS, desc="damping sweep")
    }
    graddot, ekfac = per_layer_scores(task, "graddot"), per_layer_scores(task, "ekfac")
    layers = {n: (measured(n, graddot[n]), measured(n, ekfac[n])) for n in graddot}
    sizes = {n: float(scores[:, truth.removed].abs().mean()) for n, scores in graddot.items()}
    shares = {n: size / sum(sizes.values()) for n, size in sizes.items()}
    return Diagnostics(damping, layers, shares)


def run_attribution(
    fine: FineTuning, truth: GroundTruth, names: Sequence[str], work: Path
) -> AttributionRun:
    """The reference run, every named attributor, and the diagnostics."""
    with Stopwatch() as watch:
        task = make_task(fine, work)
        losses = validation_losses(task.trained_model(), fine.blocks.validation)
        results, lds, skipped = attribute(task, names, truth)
        found = diagnose(task, truth)
    start = validation_losses(fine.model(), fine.blocks.validation)
    return AttributionRun(
        results=results,
        lds=lds,
        subset_seconds=truth.subsets.seconds,
        skipped=skipped,
        diagnostics=found,
        reproduced=float((losses - truth.loo.full).abs().max()),
        start_loss=float(start.mean()),
        params=parameter_count(task.trained_model()),
        seconds=watch.sample.wall,
    )


def main(argv: Sequence[str]) -> None:
    """Per replica: leave-one-out and LDS runs (cached), every attributor, its section of
    the results file; one JSON with every replica's figures."""
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--replicas", nargs="+", choices=list(REPLICAS), default=list(REPLICAS), metavar="R"
    )
    p.add_argument("--methods", nargs="+", choices=sorted(ATTRIBUTORS), help="default: all")
    p.add_argument("--cache", type=Path, default=CACHE, help="pre-training and retrain cache")
    p.add_argument("--no-cache", action="store_true", help="retrain even if cached")
    p.add_argument("--workers", type=int, default=2, help="processes for the retrains")
    p.add_argument("--json", type=Path, help=f"JSON output (default {JSON_OUT}; quick: none)")
    args = p.parse_args(argv)
    write = args.write if args.write is not None else not args.quick
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    cache = None if args.no_cache else args.cache
    names = args.methods or sorted(ATTRIBUTORS)
    figures = {}
    for name in args.replicas:
        chosen = replica(name, args.quick)
        loads = [load_average()]
        fine = prepare(chosen, cache)
        loo = leave_one_out(fine, cache, args.workers)
        subsets = subset_runs(fine, cache, args.workers)
        truth = GroundTruth(loo, fine.blocks.removed, subsets, chosen.config.bootstrap)
        loads.append(load_average())
        with tempfile.TemporaryDirectory(prefix="tda-fidelity-") as work:
            run = run_attribution(fine, truth, names, Path(work))
        loads.append(load_average())
        figures[name] = to_json(fine, loo, run)
        section = report(chosen, fine, loo, run, argv, loads)
        publish(section, f"{SECTION}: {chosen.title}", args.results, write)
    json_path = args.json or (None if args.quick else JSON_OUT)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
