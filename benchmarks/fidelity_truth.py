"""The ground truth of the fidelity benchmark: its replicas and their cached retrains.

A **replica** is one fine-tuning problem: a :class:`~fidelity_training.Config`, the text
its blocks are cut from, and the weights its runs start from (a :class:`Start`):

* ``random``: the seeded random init, blocks from the whole documentation text;
* ``pretrained``: the same GPT-2 pre-trained on the leading topics of the text
  (:class:`~fidelity_training.Pretraining`, cached), blocks from the remaining topics.

For a replica made concrete (:class:`FineTuning`: its blocks and initial weights), the
leave-one-out runs (:func:`leave_one_out`) and the LDS subset runs (:func:`subset_runs`)
are cached under ``benchmarks/out/fidelity/``, keyed by the configuration, the data, the
initial weights and the torch / transformers versions; the runs may be spread over
worker processes (one torch thread each), which give the same losses bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any, Protocol

import torch
import transformers
from common import REPO, Stopwatch
from fidelity_training import (
    Blocks,
    Config,
    PretrainedWeights,
    Pretraining,
    build_model,
    documentation_text,
    make_blocks,
    pretrain,
    state_digest,
    train,
    validation_losses,
)
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

CACHE = REPO / "benchmarks" / "out" / "fidelity"
#: Bump when the training or evaluation code changes what a cached run holds.
PROTOCOL_VERSION = 2
#: Config fields that no leave-one-out run depends on (left out of its cache key).
_NOT_IN_LOO_KEY = ("bootstrap", "subsets", "subset_fraction")


# -- replicas ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartingPoint:
    """The weights a replica's runs start from.

    Attributes:
        state: the initial weights (``model.state_dict()``).
        pretrained: the pre-training that produced them, or ``None`` (a random init).
    """

    state: dict[str, Tensor]
    pretrained: PretrainedWeights | None = None


class Start(Protocol):
    """Where a replica's fine-tuning starts, and on which text."""

    def fine_tuning_text(self) -> bytes:
        """The UTF-8 text the training and validation blocks are cut from."""
        ...

    def starting_point(self, config: Config, cache: Path | None) -> StartingPoint:
        """The initial weights (read from ``cache`` when there)."""
        ...

    def describe(self, config: Config, point: StartingPoint) -> str:
        """Markdown: where the runs start and which text the blocks come from."""
        ...


@dataclass(frozen=True)
class RandomInit:
    """The seeded random init (``config.model_seed``); blocks from the whole text."""

    def fine_tuning_text(self) -> bytes:
        """Every topic of the documentation."""
        return documentation_text()

    def starting_point(self, config: Config, cache: Path | None) -> StartingPoint:
        """:func:`~fidelity_training.build_model`'s weights (nothing to cache)."""
        return StartingPoint(build_model(config).state_dict())

    def describe(self, config: Config, point: StartingPoint) -> str:
        """Markdown: the seed and the text."""
        return (
            f"Start: the random init (seed {config.model_seed}); the blocks are drawn from "
            f"the whole text (all {len(topics)} topics in sorted order, "
            f"{len(self.fine_tuning_text()) / 1e3:.0f} kB)."
        )


@dataclass(frozen=True)
class Pretrained:
    """Weights pre-trained on the leading topics; blocks from the remaining ones."""

    pretraining: Pretraining

    def fine_tuning_text(self) -> bytes:
        """The topics after the pre-training text."""
        return documentation_text(self.pretraining.split)

    def starting_point(self, config: Config, cache: Path | None) -> StartingPoint:
        """The pre-trained weights, read from ``cache/pretrain-<key>.safetensors`` when
        there, else pre-trained (minutes) and saved there; ``cache=None``: pre-trained."""
        facts = {
            "pretraining": asdict(self.pretraining),
            "model": {k: getattr(config, k) for k in ("n_embd", "n_layer", "n_head", "block")},
            "batch": config.batch,
            "model_seed": config.model_seed,
            "text": hashlib.sha256(documentation_text()).hexdigest()[:16],
        }
        path = None if cache is None else cache / f"pretrain-{digest(facts)}.safetensors"

        def run() -> dict[str, Tensor]:
            done = pretrain(config, self.pretraining, build_model(config))
            history = {
                "losses": done.losses,
                "probe_steps": done.probe_steps,
                "probe_losses": done.probe_losses,
                "seconds": torch.tensor(done.seconds),
            }
            return {f"state.{k}": v for k, v in done.state.items()} | history

        t = cached_runs(path, run)
        state = {k.removeprefix("state."): v for k, v in t.items() if k.startswith("state.")}
        pretrained = PretrainedWeights(
            state, t["losses"], t["probe_steps"], t["probe_losses"], float(t["seconds"])
        )
        return StartingPoint(state, pretrained)

    def describe(self, config: Config, point: StartingPoint) -> str:
        """Markdown: the pre-training, its held-out loss curve, and the two texts."""
        done, p = point.pretrained, self.pretraining
        if done is None:
            raise ValueError("a pre-trained starting point carries its pre-training")
        names = sorted(topics)
        before, after = names[: p.split], names[p.split :]
        probes = ", ".join(
            f"{int(s)}: {float(x):.3f}"
            for s, x in zip(done.probe_steps, done.probe_losses, strict=True)
        )
        tenth = max(1, p.steps // 10)
        return (
            f"Start: the same GPT-2 pre-trained from its random init (seed "
            f"{config.model_seed}) for {p.steps} AdamW steps of {config.batch} windows of "
            f"{config.block} bytes at random offsets (seed {p.seed}) of the first "
            f"{len(before)} topics in sorted order (`{before[0]}` to `{before[-1]}`, "
            f"{len(documentation_text(0, p.split)) / 1e3:.0f} kB, {p.text_share:.0%} of the "
            f"bytes), peak learning rate {p.learning_rate:g} (linear warm-up over "
            f"{p.warmup} steps, cosine decay to 0, weight decay 0.01), {done.seconds:.0f} s "
            f"(cached). Loss on {p.probe_windows} windows of the other topics, which "
            f"pre-training never sees, after each number of steps: {probes}; training loss "
            f"over the last {tenth} steps {float(done.losses[-tenth:].mean()):.3f}. The "
            f"fine-tuning blocks are drawn from those other {len(after)} topics "
            f"(`{after[0]}` to `{after[-1]}`, {len(self.fine_tuning_text()) / 1e3:.0f} kB)."
        )


@dataclass(frozen=True)
class Replica:
    """One fine-tuning problem of the benchmark.

    Attributes:
        name: its ``--replicas`` name.
        title: its words in the results heading.
        config: the fine-tuning configuration.
        start: the initial weights and the text.
    """

    name: str
    title: str
    config: Config
    start: Start


#: The full configurations. The pre-trained start fine-tunes at 3e-4: of 1e-4, 3e-4 and
#: 1e-3, the rate with the lowest validation loss after the 16 steps (1.287, 1.281 and
#: 1.332 nats/byte, from 1.323 at the start), picked on that loss before any attribution.
FULL = Config()
FULL_PRETRAINED = replace(FULL, learning_rate=3e-4)
QUICK = Config(
    n_embd=32,
    n_layer=1,
    n_head=2,
    block=32,
    train_blocks=64,
    val_blocks=8,
    removed=6,
    batch=8,
    subsets=8,
)
#: name -> (full, quick) replica.
REPLICAS: dict[str, tuple[Replica, Replica]] = {
    "random": (
        Replica("random", "random init", FULL, RandomInit()),
        Replica("random", "random init", QUICK, RandomInit()),
    ),
    "pretrained": (
        Replica("pretrained", "pre-trained start", FULL_PRETRAINED, Pretrained(Pretraining())),
        Replica(
            "pretrained",
            "pre-trained start",
            replace(QUICK, learning_rate=3e-4),
            Pretrained(Pretraining(steps=40, warmup=5, probes=2, probe_windows=8)),
        ),
    ),
}


def replica(name: str, quick: bool = False) -> Replica:
    """The replica registered under ``name`` (its quick configuration with ``quick``)."""
    full, small = REPLICAS[name]
    return small if quick else full


@dataclass(frozen=True)
class FineTuning:
    """A replica made concrete: its blocks and starting point.

    Attributes:
        config: the fine-tuning configuration.
        blocks: the training and validation blocks.
        start: the initial weights (and the pre-training behind them, if any).
    """

    config: Config
    blocks: Blocks
    start: StartingPoint

    def model(self) -> nn.Module:
        """A fresh model holding the initial weights."""
        model = build_model(self.config)
        model.load_state_dict(self.start.state)
        return model

    def losses(self, **options: Any) -> Tensor:
        """``(M,)`` validation losses after a fresh run with ``train``'s ``options``."""
        model = self.model()
        train(self.config, self.blocks, model, **options)
        return validation_losses(model, self.blocks.validation)


def prepare(chosen: Replica, cache: Path | None) -> FineTuning:
    """The blocks and the starting point of ``chosen`` (pre-trained or read from
    ``cache``)."""
    blocks = make_blocks(chosen.config, chosen.start.fine_tuning_text())
    return FineTuning(chosen.config, blocks, chosen.start.starting_point(chosen.config, cache))


# -- cached runs ---------------------------------------------------------------------------


def digest(facts: dict[str, Any]) -> str:
    """A short digest of JSON-able ``facts`` plus the protocol and library versions."""
    facts = facts | {
        "protocol": PROTOCOL_VERSION,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def cache_key(fine: FineTuning) -> str:
    """Digest of what a leave-one-out run depends on: the configuration (less the
    bootstrap and the LDS settings), the data and the initial weights."""
    kept = {k: v for k, v in asdict(fine.config).items() if k not in _NOT_IN_LOO_KEY}
    return digest(
        kept | {"data": fine.blocks.fingerprint(), "start": state_digest(fine.start.state)}
    )


def cached_runs(path: Path | None, run_all: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
    """The tensors saved at ``path`` when it exists, else ``run_all()``'s, saved there
    (``path=None``: always ``run_all()``)."""
    if path is not None and path.exists():
        return load_file(path)
    tensors = run_all()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return tensors


def timed_losses(fine: FineTuning, options: dict[str, Any]) -> tuple[Tensor, float]:
    """:meth:`FineTuning.losses` with ``options`` and its wall seconds (one torch thread,
    in whichever process runs it)."""
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    with Stopwatch() as watch:
        losses = fine.losses(**options)
    return losses, watch.sample.wall


def many_losses(
    fine: FineTuning, runs: Sequence[dict[str, Any]], workers: int, desc: str
) -> tuple[Tensor, float]:
    """``(K, M)`` validation losses of one fresh run per ``options`` in ``runs``, spread
    over ``workers`` processes (spawned; 1: this process), and the mean wall seconds of a
    run. Every run is deterministic, so the worker that runs it does not matter."""
    one = partial(timed_losses, fine)
    if workers == 1:
        done = [one(options) for options in tqdm(runs, desc=desc)]
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            done = list(tqdm(pool.map(one, runs), total=len(runs), desc=desc))
    losses = torch.stack([losses for losses, _ in done])
    return losses, sum(seconds for _, seconds in done) / len(done)


@dataclass(frozen=True)
class LeaveOneOut:
    """Leave-one-out ground truth.

    Attributes:
        full: ``(M,)`` validation losses of the reference run (nothing removed).
        without: ``(R, M)`` validation losses of the run without each removed block.
        repeat: ``(M,)`` losses of a second run with nothing removed (determinism).
        reversed_rows: ``(M,)`` losses of the run with each batch's rows reversed.
        seconds: wall seconds per training run (mean over the runs made).
    """

    full: Tensor
    without: Tensor
    repeat: Tensor
    reversed_rows: Tensor
    seconds: float

    @property
    def effects(self) -> Tensor:
        """``(M, R)`` ``loss_v(without j) - loss_v(full)``."""
        return (self.without - self.full).T

    @property
    def determinism(self) -> float:
        """Largest ``|loss|`` difference between two runs with nothing removed."""
        return float((self.repeat - self.full).abs().max())

    @property
    def rounding_noise(self) -> float:
        """Largest ``|loss|`` difference made by reordering each batch's rows."""
        return float((self.reversed_rows - self.full).abs().max())


def leave_one_out(fine: FineTuning, cache: Path | None, workers: int = 1) -> LeaveOneOut:
    """The leave-one-out runs of ``fine`` (the reference run, its repeat, the reversed
    rows probe, one run per removed block), read from ``cache`` when there and written
    there otherwise; ``cache=None`` always retrains."""
    path = None if cache is None else cache / f"loo-{cache_key(fine)}.safetensors"

    def run_all() -> dict[str, Tensor]:
        removed = fine.blocks.removed.tolist()
        runs = [{}, {}, {"reverse_rows": True}] + [{"skip": j} for j in removed]
        losses, seconds = many_losses(fine, runs, workers, "leave-one-out runs")
        return {
            "full": losses[0],
            "repeat": losses[1],
            "reversed_rows": losses[2],
            "without": losses[3:],
            "seconds": torch.tensor(seconds),
        }

    t = cached_runs(path, run_all)
    return LeaveOneOut(
        t["full"], t["without"], t["repeat"], t["reversed_rows"], float(t["seconds"])
    )


@dataclass(frozen=True)
class SubsetRuns:
    """LDS ground truth: training runs on random subsets of the training blocks.

    Attributes:
        masks: ``(S, N)`` bool, the training blocks of each run.
        losses: ``(S, M)`` validation losses after each run.
        seconds: wall seconds per training run.
    """

    masks: Tensor
    losses: Tensor
    seconds: float


def subset_masks(config: Config) -> Tensor:
    """``(S, N)`` bool masks of ``subset_fraction`` of the training blocks each, drawn with
    seed ``data_seed + 1`` (the leave-one-out draws stay as they were)."""
    gen = torch.Generator().manual_seed(config.data_seed + 1)
    size = round(config.train_blocks * config.subset_fraction)
    masks = torch.zeros(config.subsets, config.train_blocks, dtype=torch.bool)
    for mask in masks:
        mask[torch.randperm(config.train_blocks, generator=gen)[:size]] = True
    return masks


def subset_runs(fine: FineTuning, cache: Path | None, workers: int = 1) -> SubsetRuns:
    """One training run per subset of :func:`subset_masks`, cached as
    :func:`leave_one_out` (the key adds the subset draw)."""
    config = fine.config
    key = cache_key(fine) + f"-{config.subsets}x{config.subset_fraction:g}"
    path = None if cache is None else cache / f"lds-{key}.safetensors"
    masks = subset_masks(config)

    def run_all() -> dict[str, Tensor]:
        runs = [{"subset": mask} for mask in masks]
        losses, seconds = many_losses(fine, runs, workers, "LDS subset runs")
        return {"losses": losses, "seconds": torch.tensor(seconds)}

    t = cached_runs(path, run_all)
    return SubsetRuns(masks, t["losses"], float(t["seconds"]))
