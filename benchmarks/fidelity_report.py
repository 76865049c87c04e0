"""The results of the fidelity benchmark: one markdown section per replica (the protocol,
the table of every attributor, the peers' notes, the diagnostics) and its JSON.

What an attribution process found is an :class:`AttributionRun`; ``fidelity.py`` makes
one per replica and renders it here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from common import command_line, load_text, machine_info, tidy, utc_now
from fidelity_methods import ATTRIBUTORS
from fidelity_metric import Fidelity
from fidelity_peers import PeerAttributor
from fidelity_training import VOCAB
from fidelity_truth import FineTuning, LeaveOneOut, Replica

SECTION = "## Attribution fidelity (leave-one-out)"
SCRIPT = "benchmarks/fidelity.py"


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
        start_loss: mean validation loss at the initial weights (before fine-tuning).
        params: model parameters.
        seconds: wall seconds of attribution and diagnostics.
    """

    results: list[Fidelity]
    lds: dict[str, Fidelity]
    subset_seconds: float
    skipped: dict[str, str]
    diagnostics: Diagnostics
    reproduced: float
    start_loss: float
    params: int
    seconds: float


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
            paired = float((r.per_query - base.per_query).nanmean())
            diff = f"{paired:+.3f} {interval_text(r.interval(base))}"
        peer = peer_of(r.name)
        library = "ours" if peer is None else f"**peer**: {peer.version}"
        datamodel = lds[r.name]
        blocks = len(r.per_query)
        name = r.name if r.scored == blocks else f"{r.name} ({r.scored} of {blocks} blocks)"
        lines.append(
            f"| {name} | {library} | {r.mean:.3f} | {interval_text(r.interval())} | {diff} "
            f"| {datamodel.mean:.3f} {interval_text(datamodel.interval())} | {r.seconds:.1f} |"
        )
    return "\n".join(lines)


def ceiling_text(results: Sequence[Fidelity]) -> str:
    """Markdown: our best method (the metagradient rows aside) and each approximation of
    the metagradient (``metagradient:<variant>``) against the exact metagradient, paired on
    the validation blocks the metagradient scored."""
    ceiling = next((r for r in results if r.name == "metagradient"), None)
    if ceiling is None:
        return ""
    ours = [r for r in results if peer_of(r.name) is None and not r.name.startswith("metagrad")]
    compared = [max(ours, key=lambda r: r.mean)] if ours else []
    compared += [r for r in results if r.name.startswith("metagradient:")]
    lines = []
    for row in compared:
        same = row.per_query[ceiling.per_query.isfinite()]
        low, high = row.interval(ceiling)
        lines.append(
            f"**Against the exact metagradient** (on its {ceiling.scored} validation blocks): "
            f"`{row.name}` {float(same.nanmean()):.3f} vs `metagradient` {ceiling.mean:.3f}, "
            f"difference {float(same.nanmean()) - ceiling.mean:+.3f}, paired bootstrap 95% "
            f"interval {interval_text((low, high))}."
        )
    return "\n\n".join(lines)


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
    chosen: Replica,
    fine: FineTuning,
    loo: LeaveOneOut,
    run: AttributionRun,
    argv: Sequence[str],
    loads: Sequence[float],
) -> str:
    """The results section of one replica."""
    config = fine.config
    effects = loo.effects.abs()
    return tidy(f"""{SECTION}: {chosen.title}

Command: `{command_line(SCRIPT, argv)}`

Date: {utc_now()}. Machine: {machine_info()}; {load_text(loads)}. Leave-one-out runs: \
{config.removed + 3} training runs of {loo.seconds:.1f} s each (cached; wall time in the \
worker process that made it); attribution and diagnostics: {run.seconds:.0f} s.

Protocol (dattri-LLM appendix B.2, small): `GPT2LMHeadModel` from a config (byte \
vocabulary {VOCAB}, n_embd={config.n_embd}, n_layer={config.n_layer}, \
n_head={config.n_head}, {run.params / 1e6:.2f}M parameters, dropout off, fp32) fine-tuned \
for one epoch on {config.train_blocks} blocks of {config.block} byte tokens of Python's \
reference documentation (`pydoc_data.topics`), batch {config.batch}, fixed order, \
{config.steps} AdamW steps at a constant learning rate {config.learning_rate:g} (fresh \
optimizer state), transformers' mean token loss; validation loss {run.start_loss:.3f} \
nats/byte before fine-tuning, {float(loo.full.mean()):.3f} after.

{chosen.start.describe(config, fine.start)}

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
to max |diff| = {loo.determinism:.3g} (one thread, `torch.use_deterministic_algorithms`; \
the retrains may run in separate worker processes), and so does the reference run of the \
attribution process against the cached one ({run.reproduced:.3g}); the rounding noise \
floor (each batch's rows reversed, the same gradient in exact arithmetic) moves them by up \
to {loo.rounding_noise:.3g}, against leave-one-out effects of median |effect| \
{float(effects.median()):.3g} (max {float(effects.max()):.3g}).

Our methods: all GPT-2 Conv1D layers (`LayerSelection(kind="linear")`; `lm_head` is tied \
to `wte`, embeddings and norms are left out), exact per-example gradients of each block's \
summed token loss at the trained weights, captured into stores with the final AdamW \
moments (and inline K-FAC statistics for the methods that precondition with them), then \
`method_by_name(m).score` (damping 0.1 relative to the mean eigenvalue; LoGra: factor \
projection k_a = k_g = 32; LESS: AdamW update direction, cosine). TracIn: the engine \
attached to a replay of the training run (which ends on the reference weights bit for \
bit), each block's learning-rate-weighted dot with the validation gradients at the \
weights of the step that trained it (`InfluenceLogger`). Variants: `kfac:all-layers` and \
`ekfac:all-layers` on every layer (`LayerSelection("all")`: the Conv1D layers, token and \
position embeddings, norm scales and the tied head, its uses of `wte` counted once); \
`graddot:no-bias` and `tracin:no-bias` with the biases left out \
(`exclude_params=("bias",)`); `graddot:layer-norm` with each layer's gradient normalized \
(`normalize_layers=True`). Trajectory-aware (`fidelity_trajectory.py`): `adamw_influence` \
and `adamw_own_step` from a store recorded by the capture session \
(`record_trajectory=True`) attached to a replay of the training run (per-step gradients \
and AdamW state; queries at the final weights); `metagradient` (and \
`metagradient:fixed-denominator`, Adam's denominator held at each step's value), the exact \
derivative through all {config.steps} AdamW steps (`tda_plugins.metagradient`, \
`micro_batch_mean` loss convention with one micro-batch per step, the replay checked \
against the trained weights), on a seeded subset of the validation blocks (its cost is \
per query; the table names how many; comparisons with it are paired on those blocks). \
Attribution seconds: each \
method's whole cost alone, in its own scratch directory (its captures included: nothing \
is shared between rows), so fidelity can be read against cost.

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

{ceiling_text(run.results)}

{peers_text(run.results, run.lds, run.skipped)}

EK-FAC against GradDot: the damping sweep (relative to the mean eigenvalue) and each layer \
alone, mean Spearman [bootstrap 95% interval]. A large damping turns EK-FAC into GradDot \
with each layer divided by its own mean eigenvalue, so the sweep separates reweighting the \
layers from preconditioning within them; the share column shows which layers dominate \
GradDot's sum.

{diagnostics_text(run.diagnostics)}
""")


def to_json(fine: FineTuning, loo: LeaveOneOut, run: AttributionRun) -> dict[str, Any]:
    """Everything the section shows, plus the effects and per-validation-block correlations."""

    def entry(r: Fidelity) -> dict[str, Any]:
        peer = peer_of(r.name)
        return {
            "library": "ours" if peer is None else peer.version,
            "mean_spearman": r.mean,
            "interval": list(r.interval()),
            "seconds": r.seconds,
            "scored_blocks": r.scored,
            "per_query": r.per_query.tolist(),
        }

    return {
        "config": asdict(fine.config),
        "start_loss": run.start_loss,
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
