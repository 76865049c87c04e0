"""Attribution fidelity against leave-one-out retraining (the dattri-LLM protocol, small).

The protocol (dattri-LLM, appendix B.2, at CPU scale):

* **Model**: a GPT-2-architecture ``GPT2LMHeadModel`` built from a config (byte vocabulary
  of 256, random init with a fixed seed, dropout off, fp32).
* **Data**: real text available offline: Python's reference documentation
  (``pydoc_data.topics``) as UTF-8 bytes, cut into blocks of 128 byte tokens (the byte
  tokens of ``recipes/byte_text.py``); 512 distinct training blocks and 64 validation
  blocks drawn from it with a fixed seed.
* **Training**: one epoch, batch 32 in a fixed order (16 AdamW steps, constant learning
  rate), transformers' mean token loss, deterministic (one thread,
  ``torch.use_deterministic_algorithms``).
* **Leave-one-out**: for each of 50 removed training blocks (drawn with a fixed seed), the
  same run with that block skipped (its batch has 31 examples); the effect of block ``j``
  on validation block ``v`` is ``loss_v(without j) - loss_v(full)``, each loss the mean
  over the block's 127 predicted tokens, evaluated in fp64 on the fp32 weights. Results
  are cached under ``benchmarks/out/fidelity/`` keyed by the configuration, the data and
  the library versions.
* **Fidelity**: per validation block, the Spearman correlation between an attributor's
  scores of the 50 removed blocks and their leave-one-out effects; the mean over the 64
  validation blocks with a percentile bootstrap 95% interval (validation blocks
  resampled). Sign convention: a positive score predicts that removing the block raises
  the validation loss (it helped), so a faithful method correlates positively.
* **Linear datamodeling score (LDS)**: ``subsets`` runs, each on a random half of the
  training blocks (the same order restricted to them, the same seeds), cached like the
  leave-one-out runs. Per validation block, the Spearman correlation over the subsets
  between the sum of an attributor's scores of the subset's blocks and minus the
  validation loss of the run trained on it; mean and bootstrap interval as above.
* **Determinism**: a second run with nothing removed must reproduce the reference losses
  (the figure is the largest absolute difference); the rounding noise floor is a run on
  the same batches with each batch's rows in reverse order (the same gradient in exact
  arithmetic), compared with the size of the leave-one-out effects.

Attributors (``fidelity_methods.py``) get the trained state, the model factory, the
blocks and a replay of the training run, and return a ``(64, 512)`` score matrix (every
training block: the removed blocks' columns for leave-one-out, all of them for LDS); ours are
the library's methods, the peers' (``fidelity_peers.py``, the adapters of
``benchmarks/peers`` for every peer library installed) plug in through the same registry,
and the report compares our best method with the best peer by the paired bootstrap.

Usage::

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \\
        .venv/bin/python benchmarks/fidelity.py
    benchmarks/.venv-peers/bin/python benchmarks/fidelity.py   # ours and the peers
    .venv/bin/python benchmarks/fidelity.py --quick        # smoke run in seconds, no write
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import torch
import transformers
from attribution import spearman
from common import (
    REPO,
    Stopwatch,
    base_parser,
    command_line,
    load_average,
    load_text,
    machine_info,
    parameter_count,
    publish,
    tidy,
    utc_now,
)
from fidelity_methods import ATTRIBUTORS, FidelityTask, StepHook, per_layer_scores, store_method
from fidelity_peers import PeerAttributor
from peers.base import Unsupported
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

from tda_plugins import causal_lm_example_losses
from tda_plugins.capture.identity import content_hash

SECTION = "## Attribution fidelity (leave-one-out)"
SCRIPT = "benchmarks/fidelity.py"
CACHE = REPO / "benchmarks" / "out" / "fidelity"
JSON_OUT = REPO / "benchmarks" / "out" / "fidelity.json"
#: Bump when the training or evaluation code changes what a cached run holds.
PROTOCOL_VERSION = 1
VOCAB = 256
#: Relative dampings of the K-FAC / EK-FAC sweep (the methods' default is 0.1).
DAMPINGS = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0)


@dataclass(frozen=True)
class Config:
    """One fidelity configuration.

    Attributes:
        n_embd, n_layer, n_head: the GPT-2 shape (byte vocabulary, context ``block``).
        block: tokens (bytes) per block.
        train_blocks, val_blocks: training and held-out validation blocks.
        removed: training blocks retrained without, one at a time (and scored).
        batch: examples per AdamW step.
        learning_rate: AdamW's constant learning rate.
        model_seed: seed of the random init.
        data_seed: seed of the block draw, the removed blocks and the training order.
        bootstrap: resamples of the validation blocks for the intervals.
        subsets: LDS training runs, each on a random subset of the training blocks.
        subset_fraction: the share of the training blocks in each LDS subset.
    """

    n_embd: int = 128
    n_layer: int = 2
    n_head: int = 4
    block: int = 128
    train_blocks: int = 512
    val_blocks: int = 64
    removed: int = 50
    batch: int = 32
    learning_rate: float = 1e-3
    model_seed: int = 0
    data_seed: int = 0
    bootstrap: int = 2000
    subsets: int = 100
    subset_fraction: float = 0.5

    @property
    def steps(self) -> int:
        """Optimizer steps in the epoch (the last batch may be short)."""
        return -(-self.train_blocks // self.batch)


FULL = Config()
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
#: Config fields that no leave-one-out run depends on (left out of its cache key).
_NOT_IN_LOO_KEY = ("subsets", "subset_fraction")


# -- data, model, training ------------------------------------------------------------


@dataclass(frozen=True)
class Blocks:
    """The byte blocks of one configuration.

    Attributes:
        train: ``(N, T)`` int64 training blocks.
        validation: ``(M, T)`` int64 validation blocks.
        removed: ``(R,)`` int64 indices into ``train`` of the left-out blocks.
        order: ``(N,)`` int64 training order (batches are consecutive runs of it).
    """

    train: Tensor
    validation: Tensor
    removed: Tensor
    order: Tensor

    def fingerprint(self) -> str:
        """A short digest of every tensor (the cache key depends on the data)."""
        digest = hashlib.sha256()
        for t in (self.train, self.validation, self.removed, self.order):
            digest.update(t.numpy().tobytes())
        return digest.hexdigest()[:16]


def make_blocks(config: Config) -> Blocks:
    """Distinct ``block``-byte blocks of the Python reference (topics in sorted order,
    joined by blank lines), drawn without replacement with ``data_seed``."""
    text = "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")
    count = len(text) // config.block
    ids = torch.frombuffer(bytearray(text[: count * config.block]), dtype=torch.uint8)
    blocks = ids.long().view(count, config.block)
    gen = torch.Generator().manual_seed(config.data_seed)
    picked, seen = [], set()
    for index in torch.randperm(count, generator=gen).tolist():
        key = int(content_hash(blocks[index : index + 1])[0])
        if key not in seen:
            seen.add(key)
            picked.append(index)
        if len(picked) == config.train_blocks + config.val_blocks:
            break
    if len(picked) < config.train_blocks + config.val_blocks:
        raise ValueError(f"the text has only {len(picked)} distinct blocks of {config.block}")
    chosen = blocks[torch.tensor(picked)]
    return Blocks(
        train=chosen[: config.train_blocks],
        validation=chosen[config.train_blocks :],
        removed=torch.randperm(config.train_blocks, generator=gen)[: config.removed].sort().values,
        order=torch.randperm(config.train_blocks, generator=gen),
    )


def build_model(config: Config) -> nn.Module:
    """``GPT2LMHeadModel`` from a config: byte vocabulary, fp32, seeded init, no dropout."""
    gpt2 = GPT2Config(
        vocab_size=VOCAB,
        n_positions=config.block,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(config.model_seed)
    return GPT2LMHeadModel(gpt2).to(torch.float32)


def train(
    config: Config,
    blocks: Blocks,
    model: nn.Module,
    skip: int | None = None,
    reverse_rows: bool = False,
    hook: StepHook | None = None,
    subset: Tensor | None = None,
) -> torch.optim.AdamW:
    """One epoch of AdamW over ``blocks.train`` in ``blocks.order``, batches of ``batch``,
    without training block ``skip``; transformers' mean token loss. ``subset``: an
    ``(N,)`` bool mask of the blocks to train on (the order restricted to them, batched
    anew: fewer steps).

    ``reverse_rows`` feeds each batch's rows in reverse order (the same gradient in exact
    arithmetic: the rounding noise probe). ``hook(step, model)`` runs after each backward,
    before the optimizer step. Returns the optimizer (its state after the epoch).
    """
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)
    order = blocks.order if subset is None else blocks.order[subset[blocks.order]]
    with deterministic():
        for step in range(-(-order.numel() // config.batch)):
            rows = order[step * config.batch : (step + 1) * config.batch]
            rows = rows[rows != skip] if skip is not None else rows
            ids = blocks.train[rows.flip(0) if reverse_rows else rows]
            model(input_ids=ids, labels=ids).loss.backward()
            if hook is not None:
                hook(step, model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return optimizer


@contextmanager
def deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` inside the block, restored after."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def validation_losses(model: nn.Module, validation: Tensor) -> Tensor:
    """``(M,)`` fp64 mean token loss of each validation block, evaluated in fp64 (a copy
    of the model), so that evaluation adds no fp32 rounding to tiny differences."""
    exact = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        logits = exact(input_ids=validation).logits
    return causal_lm_example_losses(logits, validation) / (validation.shape[1] - 1)


def run_losses(config: Config, blocks: Blocks, **options: Any) -> Tensor:
    """``(M,)`` validation losses after a fresh training run with ``train``'s ``options``."""
    model = build_model(config)
    train(config, blocks, model, **options)
    return validation_losses(model, blocks.validation)


# -- leave-one-out, cached ---------------------------------------------------------------


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


def cache_key(config: Config, blocks: Blocks) -> str:
    """Digest of what a leave-one-out run depends on: the configuration (less the
    bootstrap), the data, and the torch / transformers versions."""
    kept = {
        k: v for k, v in asdict(replace(config, bootstrap=0)).items() if k not in _NOT_IN_LOO_KEY
    }
    facts = kept | {
        "protocol": PROTOCOL_VERSION,
        "data": blocks.fingerprint(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def cached_runs(path: Path | None, train_all: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
    """The tensors saved at ``path`` when it exists, else ``train_all()``'s, saved there
    (``path=None``: always ``train_all()``)."""
    if path is not None and path.exists():
        return load_file(path)
    tensors = train_all()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path)
    return tensors


def leave_one_out(config: Config, blocks: Blocks, cache: Path | None) -> LeaveOneOut:
    """The leave-one-out runs of ``config``, read from ``cache`` when there (and written
    there otherwise); ``cache=None`` always retrains."""
    path = None if cache is None else cache / f"loo-{cache_key(config, blocks)}.safetensors"

    def train_all() -> dict[str, Tensor]:
        with Stopwatch() as watch:
            full = run_losses(config, blocks)
            repeat = run_losses(config, blocks)
            reversed_rows = run_losses(config, blocks, reverse_rows=True)
            removed = blocks.removed.tolist()
            without = torch.stack(
                [
                    run_losses(config, blocks, skip=j)
                    for j in tqdm(removed, desc="leave-one-out runs")
                ]
            )
        seconds = torch.tensor(watch.sample.wall / (len(removed) + 3))
        return {"full": full, "without": without, "repeat": repeat} | {
            "reversed_rows": reversed_rows,
            "seconds": seconds,
        }

    t = cached_runs(path, train_all)
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


def subset_runs(config: Config, blocks: Blocks, cache: Path | None) -> SubsetRuns:
    """One training run per subset of :func:`subset_masks`, cached as
    :func:`leave_one_out` (the key adds the subset draw)."""
    key = cache_key(config, blocks) + f"-{config.subsets}x{config.subset_fraction:g}"
    path = None if cache is None else cache / f"lds-{key}.safetensors"
    masks = subset_masks(config)

    def train_all() -> dict[str, Tensor]:
        with Stopwatch() as watch:
            losses = torch.stack(
                [run_losses(config, blocks, subset=m) for m in tqdm(masks, desc="LDS subset runs")]
            )
        return {"losses": losses, "seconds": torch.tensor(watch.sample.wall / len(masks))}

    t = cached_runs(path, train_all)
    return SubsetRuns(masks, t["losses"], float(t["seconds"]))


# -- attribution and the metric ----------------------------------------------------------


def make_task(config: Config, blocks: Blocks, work: Path) -> FidelityTask:
    """The reference training run, packed for the attributors."""
    model = build_model(config)
    optimizer = train(config, blocks, model)

    def replay(fresh: nn.Module, hook: StepHook | None) -> torch.optim.Optimizer:
        return train(config, blocks, fresh, hook=hook)

    return FidelityTask(
        model_factory=lambda: build_model(config),
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        optimizer_state=copy.deepcopy(optimizer.state_dict()),
        learning_rate=config.learning_rate,
        batch=config.batch,
        train=blocks.train,
        validation=blocks.validation,
        replay=replay,
        work=work,
    )


@dataclass(frozen=True)
class Fidelity:
    """One attributor's agreement with leave-one-out.

    Attributes:
        name: the attributor (and its variant).
        per_query: ``(M,)`` fp64 Spearman of each validation block.
        resamples: bootstrap resamples of the validation blocks.
        seconds: wall seconds the attributor took (NaN where not timed).
    """

    name: str
    per_query: Tensor
    resamples: int
    seconds: float = float("nan")

    @property
    def mean(self) -> float:
        """Mean Spearman over validation blocks."""
        return float(self.per_query.mean())

    def interval(self, minus: Fidelity | None = None) -> tuple[float, float]:
        """Percentile bootstrap 95% interval of the mean, or of the mean difference to
        ``minus`` (paired: the same validation blocks resampled for both)."""
        values = self.per_query if minus is None else self.per_query - minus.per_query
        gen = torch.Generator().manual_seed(0)
        draws = torch.randint(0, values.shape[0], (self.resamples, values.shape[0]), generator=gen)
        means = values[draws].mean(dim=1)
        low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=means.dtype))
        return float(low), float(high)


def fidelity(
    name: str, scores: Tensor, effects: Tensor, resamples: int, seconds: float = float("nan")
) -> Fidelity:
    """Spearman per validation block of ``(M, K)`` scores against ``(M, K)`` effects."""
    if scores.shape != effects.shape:
        raise ValueError(
            f"{name} gave scores of shape {tuple(scores.shape)}, expected "
            f"{tuple(effects.shape)} (validation blocks x removed blocks or subsets)"
        )
    rho = spearman(scores.T.double(), effects.T.double())
    return Fidelity(name, rho, resamples, seconds)


@dataclass(frozen=True)
class GroundTruth:
    """What an attributor's ``(M, N)`` scores are measured against.

    Attributes:
        loo: the leave-one-out runs.
        removed: ``(R,)`` the training blocks they left out.
        subsets: the LDS runs.
        resamples: bootstrap resamples.
    """

    loo: LeaveOneOut
    removed: Tensor
    subsets: SubsetRuns
    resamples: int

    def leave_one_out(self, name: str, scores: Tensor, seconds: float = float("nan")) -> Fidelity:
        """The removed blocks' scores against their leave-one-out effects."""
        self._check(name, scores)
        return fidelity(name, scores[:, self.removed], self.loo.effects, self.resamples, seconds)

    def lds(self, name: str, scores: Tensor) -> Fidelity:
        """Per validation block, the Spearman over the subsets of the summed scores of each
        subset's blocks against minus the loss of the run trained on it."""
        self._check(name, scores)
        predicted = scores.double() @ self.subsets.masks.double().T
        return fidelity(name, predicted, -self.subsets.losses.T, self.resamples)

    def _check(self, name: str, scores: Tensor) -> None:
        expected = (self.loo.full.shape[0], self.subsets.masks.shape[1])
        if tuple(scores.shape) != expected:
            raise ValueError(
                f"{name} returned scores of shape {tuple(scores.shape)}, expected {expected} "
                "(validation blocks x training blocks)"
            )


def attribute(
    task: FidelityTask, names: Sequence[str], truth: GroundTruth
) -> tuple[list[Fidelity], dict[str, Fidelity], dict[str, str]]:
    """Run each named attributor on ``task``; returns its leave-one-out fidelity, its LDS
    (by name) and, for the attributors that could not run, name -> why."""
    results, lds, skipped = [], {}, {}
    for name in tqdm(names, desc="attributors"):
        try:
            with Stopwatch() as watch:
                scores = ATTRIBUTORS[name](task)
        except Unsupported as why:
            skipped[name] = str(why)
            continue
        results.append(truth.leave_one_out(name, scores, watch.sample.wall))
        lds[name] = truth.lds(name, scores)
    return results, lds, skipped


@dataclass(frozen=True)
class Diagnostics:
    """Why a curvature method does or does not beat GradDot.

    Attributes:
        damping: relative damping -> (K-FAC, EK-FAC) with it.
        layers: layer name -> (GradDot, EK-FAC) from that layer alone.
        shares: layer name -> its share of GradDot's score magnitude (the sum over layers
            of mean ``|score|`` is 1): how much each layer weighs in the all-layer sum.
    """

    damping: dict[float, tuple[Fidelity, Fidelity]]
    layers: dict[str, tuple[Fidelity, Fidelity]]
    shares: dict[str, float]


def diagnose(task: FidelityTask, truth: GroundTruth) -> Diagnostics:
    """Damping sweep of K-FAC and EK-FAC, and per-layer GradDot and EK-FAC (leave-one-out)."""
    measured = truth.leave_one_out

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


# -- report ------------------------------------------------------------------------------


def peer_of(name: str) -> PeerAttributor | None:
    """The peer attributor registered under ``name``, or ``None`` for ours."""
    attributor = ATTRIBUTORS.get(name)
    return attributor if isinstance(attributor, PeerAttributor) else None


def interval_text(bounds: tuple[float, float]) -> str:
    """``[low, high]``."""
    return f"[{bounds[0]:.3f}, {bounds[1]:.3f}]"


def results_table(results: Sequence[Fidelity], lds: dict[str, Fidelity]) -> str:
    """Markdown: attributor, library (peers marked), mean Spearman, interval, paired
    difference to our GradDot, LDS [interval], time."""
    base = next((r for r in results if r.name == "graddot"), None)
    lines = [
        "| method | library | mean Spearman vs LOO | bootstrap 95% interval "
        "| minus our GradDot [paired interval] | LDS [interval] | attribution s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(results, key=lambda r: -r.mean):
        diff = "—"
        if base is not None and r is not base:
            diff = f"{r.mean - base.mean:+.3f} {interval_text(r.interval(base))}"
        peer = peer_of(r.name)
        library = "ours" if peer is None else f"**peer**: {peer.version}"
        datamodel = lds[r.name]
        lines.append(
            f"| {r.name} | {library} | {r.mean:.3f} | {interval_text(r.interval())} | {diff} "
            f"| {datamodel.mean:.3f} {interval_text(datamodel.interval())} | {r.seconds:.1f} |"
        )
    return "\n".join(lines)


def best_against_best(results: Sequence[Fidelity], metric: str) -> str:
    """Markdown: our best method against the best peer by ``metric``'s paired bootstrap
    (``results`` holds both)."""
    best = max((r for r in results if peer_of(r.name) is None), key=lambda r: r.mean)
    rival = max((r for r in results if peer_of(r.name) is not None), key=lambda r: r.mean)
    low, high = best.interval(rival)
    if low > 0:
        verdict = "more faithful (interval above 0): target met"
    elif high < 0:
        verdict = "less faithful (interval below 0): target missed"
    else:
        verdict = "not distinguishable (interval contains 0): not worse at 95%, target met"
    return (
        f"**Our best method against the best peer, {metric}**: `{best.name}` {best.mean:.3f} "
        f"vs `{rival.name}` {rival.mean:.3f}, difference {best.mean - rival.mean:+.3f}, "
        f"paired bootstrap 95% interval {interval_text((low, high))}: ours is {verdict}."
    )


def peers_text(
    results: Sequence[Fidelity], lds: dict[str, Fidelity], skipped: dict[str, str]
) -> str:
    """Markdown: what each peer row ran with, our best method against the best peer (the
    paired bootstrap, leave-one-out and LDS), and the peer methods that could not run,
    grouped by reason."""
    theirs = [(r, peer) for r in results if (peer := peer_of(r.name)) is not None]
    if not theirs:
        return (
            "No peer attributor ran in this environment (the peer libraries are installed "
            "in `benchmarks/.venv-peers`)."
        )
    notes = [f"- `{r.name}`: {peer.note or 'the adapter defaults'}" for r, peer in theirs]
    lines = [
        "Peer rows, as run:",
        "",
        *notes,
        "",
        best_against_best(results, "leave-one-out"),
        "",
        best_against_best([lds[r.name] for r in results], "LDS"),
    ]
    reasons: dict[str, list[str]] = {}
    for name, why in skipped.items():
        reasons.setdefault(why, []).append(f"`{name}`")
    if reasons:
        lines += ["", "Could not run:", ""]
        lines += [f"- {', '.join(names)}: {why}" for why, names in reasons.items()]
    return "\n".join(lines)


def diagnostics_text(found: Diagnostics) -> str:
    """Markdown: the damping sweep and the per-layer table (mean Spearman [interval])."""

    def cell(r: Fidelity) -> str:
        return f"{r.mean:.3f} {interval_text(r.interval())}"

    sweep = ["| relative damping | K-FAC | EK-FAC |", "|---:|---:|---:|"]
    sweep += [f"| {d:g} | {cell(k)} | {cell(e)} |" for d, (k, e) in found.damping.items()]
    layers = [
        "| layer alone | share of GradDot's score | GradDot | EK-FAC (damping 0.1) |",
        "|---|---:|---:|---:|",
    ]
    layers += [
        f"| `{n}` | {found.shares[n]:.0%} | {cell(g)} | {cell(e)} |"
        for n, (g, e) in found.layers.items()
    ]
    return "\n".join(sweep) + "\n\n" + "\n".join(layers)


def report(
    config: Config,
    loo: LeaveOneOut,
    run: AttributionRun,
    argv: Sequence[str],
    loads: Sequence[float],
) -> str:
    """The results section."""
    effects = loo.effects.abs()
    return tidy(f"""{SECTION}

Command: `{command_line(SCRIPT, argv)}`

Date: {utc_now()}. Machine: {machine_info()}; {load_text(loads)}. Leave-one-out runs: \
{config.removed + 3} training runs of {loo.seconds:.1f} s each (cached); attribution and \
diagnostics: {run.seconds:.0f} s.

Protocol (dattri-LLM appendix B.2, small): `GPT2LMHeadModel` from a config (byte \
vocabulary 256, n_embd={config.n_embd}, n_layer={config.n_layer}, n_head={config.n_head}, \
{run.params / 1e6:.2f}M parameters, random init with seed {config.model_seed}, dropout off, \
fp32) trained for one epoch on {config.train_blocks} blocks of {config.block} byte tokens \
of Python's reference documentation (`pydoc_data.topics`), batch {config.batch}, fixed \
order, {config.steps} AdamW steps at a constant learning rate {config.learning_rate:g}, \
transformers' mean token loss; validation loss after training \
{float(loo.full.mean()):.3f} nats/byte (from {math.log(VOCAB):.3f} at init). \
Leave-one-out: {config.removed} removed blocks, one retrain each (the block skipped, its \
batch one smaller); effect = validation loss without the block - with it, on \
{config.val_blocks} held-out validation blocks (mean token loss, evaluated in fp64). \
Fidelity: per validation block, Spearman of the method's {config.removed} scores against \
the effects; mean over validation blocks with a percentile bootstrap 95% interval \
({config.bootstrap} resamples of the validation blocks; the difference to GradDot is \
resampled paired). Sign: a positive score predicts that removing the block raises the \
validation loss. LDS (linear datamodeling score): {config.subsets} more training runs, \
each on a random {config.subset_fraction:.0%} of the training blocks ({run.subset_seconds:.1f} s \
each, cached; the same order restricted to the subset, the same seeds); per validation \
block, the Spearman over the runs between the summed scores of the run's blocks and \
minus its validation loss; mean and bootstrap interval as above.

Determinism: a second run with nothing removed reproduces the reference validation losses \
to max |diff| = {loo.determinism:.3g} (one thread, `torch.use_deterministic_algorithms`), \
and so does the reference run of the attribution process against the cached one \
({run.reproduced:.3g}); the rounding noise floor (each batch's rows reversed, the same \
gradient in exact arithmetic) moves them by up to {loo.rounding_noise:.3g}, against \
leave-one-out effects of median |effect| {float(effects.median()):.3g} (max \
{float(effects.max()):.3g}).

Our methods: all GPT-2 Conv1D layers (`LayerSelection(kind="linear")`; `lm_head` is tied \
to `wte`, embeddings and norms are left out), exact per-example gradients of each block's \
summed token loss at the trained weights, captured into stores with inline K-FAC \
statistics and the final AdamW moments, then `method_by_name(m).score` (damping 0.1 \
relative to the mean eigenvalue; LoGra: factor projection k_a = k_g = 32; LESS: AdamW \
update direction, cosine). TracIn: the engine attached to a replay of the training run \
(which ends on the reference weights bit for bit), each block's learning-rate-weighted \
dot with the validation gradients at the weights of the step that trained it \
(`InfluenceLogger`). Attribution seconds include capturing the stores, shared by the \
store-based methods (charged to the first of them).

Peers (`benchmarks/fidelity_peers.py`): each installed peer library's adapter from \
`benchmarks/peers` (the peer comparison's) on the same problem: the trained model, all \
{config.train_blocks} training blocks (curvature statistics from all of them, as ours), \
the validation blocks as queries, the same Conv1D layers (libraries that hook \
`nn.Linear` only get an equivalent `nn.Linear` copy), each block's summed token loss, \
micro-batches of {config.batch}, projected GradDot at k = 32 per side (our LoGra's), \
damping 0.1 x the mean eigenvalue where the library exposes it. TRAK (`traker`) has no \
adapter in `benchmarks/peers`: its glue is in `fidelity_peers.py`. Our best method is \
compared with the best peer by the paired bootstrap of the difference of their means \
(both picked as the best on these same validation blocks): the target is met unless the \
interval lies below 0.

{results_table(run.results, run.lds)}

{peers_text(run.results, run.lds, run.skipped)}

EK-FAC against GradDot: the damping sweep (relative to the mean eigenvalue) and each layer \
alone, mean Spearman [bootstrap 95% interval]. A large damping turns EK-FAC into GradDot \
with each layer divided by its own mean eigenvalue, so the sweep separates reweighting the \
layers from preconditioning within them; the share column shows which layers dominate \
GradDot's sum.

{diagnostics_text(run.diagnostics)}
""")


def to_json(config: Config, loo: LeaveOneOut, run: AttributionRun) -> dict[str, Any]:
    """Everything the section shows, plus the effects and per-validation-block correlations."""

    def entry(r: Fidelity) -> dict[str, Any]:
        peer = peer_of(r.name)
        return {
            "library": "ours" if peer is None else peer.version,
            "mean_spearman": r.mean,
            "interval": list(r.interval()),
            "seconds": r.seconds,
            "per_query": r.per_query.tolist(),
        }

    return {
        "config": asdict(config),
        "determinism_max_abs": loo.determinism,
        "reproduced_max_abs": run.reproduced,
        "rounding_noise_max_abs": loo.rounding_noise,
        "seconds_per_training_run": loo.seconds,
        "full_losses": loo.full.tolist(),
        "effects": loo.effects.tolist(),
        "methods": {r.name: entry(r) for r in run.results},
        "lds": {name: entry(r) for name, r in run.lds.items()},
        "could_not_run": run.skipped,
        "damping": {
            f"{d:g}": {"kfac": entry(k), "ekfac": entry(e)}
            for d, (k, e) in run.diagnostics.damping.items()
        },
        "layers": {
            name: {"graddot": dot.mean, "ekfac": ekfac.mean, "share": run.diagnostics.shares[name]}
            for name, (dot, ekfac) in run.diagnostics.layers.items()
        },
    }


@dataclass(frozen=True)
class AttributionRun:
    """What the attribution process found.

    Attributes:
        results: one per attributor that ran (leave-one-out).
        lds: attributor name -> its linear datamodeling score.
        subset_seconds: wall seconds per LDS training run.
        skipped: attributor name -> why it could not run (version, reason).
        diagnostics: damping sweep and per-layer fidelity of our methods.
        reproduced: max |diff| of its reference run's validation losses to the cached ones.
        params: model parameters.
        seconds: wall seconds of attribution and diagnostics.
    """

    results: list[Fidelity]
    lds: dict[str, Fidelity]
    subset_seconds: float
    skipped: dict[str, str]
    diagnostics: Diagnostics
    reproduced: float
    params: int
    seconds: float


def run_attribution(
    config: Config, blocks: Blocks, truth: GroundTruth, names: Sequence[str], work: Path
) -> AttributionRun:
    """The reference run, every named attributor, and the diagnostics."""
    with Stopwatch() as watch:
        task = make_task(config, blocks, work)
        losses = validation_losses(task.trained_model(), blocks.validation)
        results, lds, skipped = attribute(task, names, truth)
        found = diagnose(task, truth)
    reproduced = float((losses - truth.loo.full).abs().max())
    params = parameter_count(task.trained_model())
    return AttributionRun(
        results,
        lds,
        truth.subsets.seconds,
        skipped,
        found,
        reproduced,
        params,
        watch.sample.wall,
    )


# -- command line ------------------------------------------------------------------------


def main(argv: Sequence[str]) -> None:
    """Leave-one-out and LDS runs (cached), every attributor, the table, JSON and the
    results file."""
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", choices=sorted(ATTRIBUTORS), help="default: all")
    p.add_argument("--cache", type=Path, default=CACHE, help="leave-one-out and LDS cache")
    p.add_argument("--no-cache", action="store_true", help="retrain even if cached")
    p.add_argument("--json", type=Path, help=f"JSON output (default {JSON_OUT}; quick: none)")
    args = p.parse_args(argv)
    config = QUICK if args.quick else FULL
    write = args.write if args.write is not None else not args.quick
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    loads = [load_average()]
    blocks = make_blocks(config)
    cache = None if args.no_cache else args.cache
    loo = leave_one_out(config, blocks, cache)
    truth = GroundTruth(loo, blocks.removed, subset_runs(config, blocks, cache), config.bootstrap)
    loads.append(load_average())
    names = args.methods or sorted(ATTRIBUTORS)
    with tempfile.TemporaryDirectory(prefix="tda-fidelity-") as work:
        run = run_attribution(config, blocks, truth, names, Path(work))
    loads.append(load_average())
    section = report(config, loo, run, argv, loads)
    json_path = args.json or (None if args.quick else JSON_OUT)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(to_json(config, loo, run), indent=1))
    publish(section, SECTION, args.results, write)


if __name__ == "__main__":
    main(sys.argv[1:])
