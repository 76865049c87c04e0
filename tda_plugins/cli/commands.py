"""The ``tda`` command line: capture per-example gradients, attribute, report.

    tda capture   --model DIR --data FILE.jsonl --out STORE [layer/projection options]
    tda attribute --store STORE --queries QSTORE --method graddot --top-k 10 --out DIR
    tda report    --scores DIR --store STORE --queries QSTORE --out report.html
    tda score     --model DIR --data FILE.jsonl --queries Q.jsonl --out DIR  (no store)

Bad input ends with exit code 2 and a one-line reason on stderr. This module is the parser
and imports no torch: ``--help`` and usage errors return at once; the command itself runs
in :mod:`.runs`.

Under ``torchrun --nproc-per-node N -m tda_plugins.cli ...`` the work is spread over the N
ranks (:mod:`tda_plugins.parallel.ranks`): ``capture`` deals the batches round robin, each rank
writing its own ``rank-<r>`` directory of one store (a full model replica per rank: data
parallel); ``attribute`` splits the training store between the ranks and rank 0 writes the
merged scores. Both give what one process gives.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from tda_plugins.cli.choices import (
    DEFAULT_TOP_K,
    DTYPE_HELP,
    DTYPES,
    DURABILITY,
    LIVE_METHODS,
    METHODS,
)
from tda_plugins.cli.option_types import (
    device,
    non_negative_float,
    positive_float,
    positive_int,
    regex,
)

#: Each subcommand's one-line summary (``tda --help``) and its description (``--help``).
_SUBCOMMANDS = {
    "capture": (
        "per-example gradients of a JSONL dataset with a local model",
        "Write the exact per-example gradients (each example's own summed token loss) of "
        "every example in --data to a gradient store, with inline K-FAC statistics.",
    ),
    "attribute": (
        "score training examples against queries",
        "Score every example of --store against every query of --queries. Both stores must "
        "be captured with the same layers, projection and seed.",
    ),
    "report": (
        "HTML page of the top-k per query",
        "Render saved scores as HTML, with texts where stored.",
    ),
    "score": (
        "GradDot/GradCos of a JSONL dataset against JSONL queries, with no store",
        "Score every example of --data against every query of --queries in one pass: the "
        "queries' gradients are taken first and each training batch is scored as its "
        "backward finishes, so nothing is written but the scores (one process). For other "
        "methods, or queries that come later, use capture and attribute.",
    ),
}


def _subcommand(sub: Any, name: str) -> argparse.ArgumentParser:
    summary, description = _SUBCOMMANDS[name]
    return sub.add_parser(name, help=summary, description=description)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """``--model`` and ``--adapter``."""
    p.add_argument(
        "--model",
        required=True,
        help="local transformers model directory, or a PEFT adapter directory (its base "
        "from adapter_config.json)",
    )
    p.add_argument(
        "--adapter", help="PEFT adapter directory to load on --model (LoRA layers captured)"
    )


def _add_layer_options(p: argparse.ArgumentParser) -> None:
    """The layer and projection options (the callbacks' own names)."""
    p.add_argument(
        "--layers",
        default="auto",
        choices=["auto", "linear", "lora", "all"],
        help="layer family (auto: LoRA adapters if present, else linear)",
    )
    p.add_argument("--include", type=regex, help="regex: keep only layers whose name matches")
    p.add_argument("--exclude", type=regex, help="regex: drop layers whose name matches")
    p.add_argument(
        "--last-n-blocks", type=positive_int, help="keep only the last N transformer blocks"
    )
    p.add_argument(
        "--projection",
        default="none",
        choices=["none", "factor", "dense"],
        help="project gradients in the hook (factor = LoGra)",
    )
    p.add_argument("--k-a", type=positive_int, help="factor projection: rows of P_a (default 16)")
    p.add_argument("--k-g", type=positive_int, help="factor projection: rows of P_g (default 16)")
    p.add_argument(
        "--k", type=positive_int, help="dense projection: output dimension (default 256)"
    )
    p.add_argument(
        "--map",
        dest="projection_map",
        choices=["gaussian", "rademacher", "sparse_jl"],
        help="random map of the projection (default gaussian)",
    )
    p.add_argument("--seed", type=int, help="projection seed (default 0)")


def _add_row_options(p: argparse.ArgumentParser) -> None:
    """How the JSONL rows become batches."""
    p.add_argument(
        "--batch-size", type=positive_int, default=8, help="examples per forward/backward"
    )
    p.add_argument(
        "--max-length",
        type=positive_int,
        help="truncate examples to this many tokens (default: with --like, the run's "
        "max_length where it cut rows; the model's positions, and at most those; 512 for a "
        "model without a positions limit)",
    )
    p.add_argument(
        "--eos",
        action=argparse.BooleanOptionalAction,
        help="end text and completion rows in the tokenizer's end-of-sequence token, as "
        "TRL's SFTTrainer trains them (default off; with --like, as the store's run "
        "trained: on for an SFTTrainer run)",
    )
    p.add_argument(
        "--completion-only-loss",
        action=argparse.BooleanOptionalAction,
        help="a prompt-completion row's loss on its completion alone (default, as TRL's "
        "SFTConfig; with --like, as the store's run trained)",
    )
    p.add_argument(
        "--assistant-only-loss",
        action=argparse.BooleanOptionalAction,
        help="a conversation's loss on the assistant's tokens alone (TRL's SFTConfig "
        "switch; default off; with --like, as the store's run trained)",
    )


def _add_capture(sub: Any) -> None:
    p = _subcommand(sub, "capture")
    _add_model_options(p)
    p.add_argument(
        "--data",
        required=True,
        help="JSONL: text | prompt+completion (strings, or lists of chat messages) | "
        "messages | input_ids per line, optional integer 'id'",
    )
    p.add_argument("--out", required=True, type=Path, help="gradient store directory to create")
    p.add_argument(
        "--append",
        action="store_true",
        help="add to an existing store of the same model and options (new steps after its own)",
    )
    _add_layer_options(p)
    p.add_argument(
        "--like",
        metavar="STORE",
        help="capture the layers and projection of this gradient store (the training "
        "store, for its queries), in place of the layer and projection options",
    )
    _add_row_options(p)
    p.add_argument(
        "--durability",
        default="end",
        choices=DURABILITY,
        help="end (default): no fsync while capturing, every file made durable in one pass "
        "once the capture ends (the command returns after it); step: each step durable "
        "before the next (a long capture to resume with --append after a machine crash); "
        "none: never fsynced (a scratch store)",
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument(
        "--device",
        type=device,
        default="cpu",
        help="torch device (under torchrun: cpu, or cuda for each rank's LOCAL_RANK GPU)",
    )
    p.add_argument(
        "--device-map",
        help="transformers device_map (e.g. auto) for a model larger than one device; "
        "replaces --device",
    )
    curvature = p.add_mutually_exclusive_group()
    curvature.add_argument(
        "--curvature",
        dest="curvature",
        action="store_const",
        const=True,
        default="auto",
        help="inline K-FAC statistics for kfac/ekfac/logra however large (default: only "
        "up to 64 MiB per process)",
    )
    curvature.add_argument(
        "--no-curvature",
        dest="curvature",
        action="store_const",
        const=False,
        help="no inline K-FAC statistics",
    )
    p.add_argument(
        "--curvature-head",
        action="store_true",
        help="a dense vocab x vocab output factor for an untied vocabulary-wide head "
        "(default: its diagonal)",
    )
    p.add_argument(
        "--curvature-budget-gb",
        type=non_negative_float,
        help="most GiB of K-FAC statistics per process (default 8); more is refused before "
        "any work",
    )
    p.add_argument(
        "--keep-tokens",
        action="store_true",
        help="store per-token factors (needed for token-level scores)",
    )


def _add_attribute(sub: Any) -> None:
    p = _subcommand(sub, "attribute")
    p.add_argument("--store", required=True, help="training gradient store")
    p.add_argument("--queries", required=True, help="query gradient store")
    p.add_argument(
        "--method",
        required=True,
        choices=METHODS,
        help="graddot/gradcos: plain/cosine dot; tracin: learning-rate weighted "
        "sum over checkpoints; kfac/ekfac: curvature-preconditioned; logra: "
        "K-FAC on factor-projected gradients; less: Adam-preconditioned cosine; "
        "adamw_influence / adamw_own_step / adamw_unrolled: each example's effect through "
        "the recorded AdamW steps that followed it / its own step alone / with each later "
        "step's empirical Fisher (a store captured with record_trajectory=True)",
    )
    p.add_argument(
        "--damping",
        type=non_negative_float,
        default=None,
        help="damping relative to the mean eigenvalue (kfac/ekfac/logra; default 0.1)",
    )
    p.add_argument(
        "--learning-rate",
        type=positive_float,
        help="tracin: weight of --store/--queries (default 1)",
    )
    p.add_argument(
        "--checkpoint",
        nargs=3,
        action="append",
        default=[],
        metavar=("STORE", "QUERIES", "LR"),
        help="tracin: another checkpoint",
    )
    p.add_argument(
        "--exclude-params",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="graddot/gradcos/tracin/less: leave out of both sides every parameter whose "
        "name within its layer (bias, weight) or full name <layer>.<name> matches a glob "
        "pattern, e.g. --exclude-params bias '*.ln_*'",
    )
    p.add_argument(
        "--layer-norm",
        action="store_true",
        help="graddot/gradcos/tracin/less: unit-normalize each layer's gradient per example "
        "before the dot, so that every layer weighs alike",
    )
    p.add_argument(
        "--top-k", type=positive_int, default=DEFAULT_TOP_K, help="examples per query in the top-k"
    )
    p.add_argument(
        "--tokens",
        action="store_true",
        help="also score each token of the top-k examples (tokens.json, shaded in the report); "
        "needs a store captured with --keep-tokens",
    )
    p.add_argument(
        "--chunk",
        type=positive_int,
        default=None,
        help="training examples scored at once (default: the query count, between 8 and 256)",
    )
    p.add_argument(
        "--out", required=True, type=Path, help="output directory (scores, top-k, report)"
    )
    p.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="score queries although they come from another model than the store's",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument(
        "--device",
        type=device,
        default="cpu",
        help="where to score (cpu: the reference; cuda: under torchrun, each rank's "
        "LOCAL_RANK GPU)",
    )


def _add_report(sub: Any) -> None:
    p = _subcommand(sub, "report")
    p.add_argument("--scores", required=True, help="directory written by `tda attribute`")
    p.add_argument("--store", required=True, help="training store (for texts)")
    p.add_argument("--queries", required=True, help="query store (for texts)")
    p.add_argument(
        "--top-k",
        type=positive_int,
        help=f"examples per query (default: the k `tda attribute` saved, else {DEFAULT_TOP_K})",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="HTML file (default: SCORES/report.html, which `tda attribute` wrote: pass --force)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing report file")


def _add_score(sub: Any) -> None:
    p = _subcommand(sub, "score")
    _add_model_options(p)
    p.add_argument(
        "--data",
        required=True,
        help="JSONL training examples, as tda capture --data takes them",
    )
    p.add_argument("--queries", required=True, help="JSONL query examples, likewise")
    p.add_argument(
        "--method",
        default="graddot",
        choices=LIVE_METHODS,
        help="graddot: dot product of the gradients; gradcos: their cosine",
    )
    _add_layer_options(p)
    _add_row_options(p)
    p.add_argument("--dtype", default="float32", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--device", type=device, default="cpu", help="torch device")
    p.add_argument(
        "--top-k", type=positive_int, default=DEFAULT_TOP_K, help="examples per query in the top-k"
    )
    p.add_argument(
        "--out", required=True, type=Path, help="output directory (scores, top-k, report)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing --out")


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, ``tda <command>: error: <what>``, and exit code 2."""

    def error(self, message: str) -> NoReturn:
        reason = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {reason} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tda", description="Training-data attribution from per-example gradients."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_capture(sub)
    _add_attribute(sub)
    _add_report(sub)
    _add_score(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tda`` console script; returns the exit code (2: bad input,
    with one line on stderr naming it)."""
    args = build_parser().parse_args(argv)
    # The library (torch, transformers) loads once the arguments are known to be good.
    from tda_plugins.cli.runs import USER_ERRORS, run

    try:
        run(args)
    except USER_ERRORS as exc:
        reason = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"tda {args.command}: error: {reason}", file=sys.stderr)
        return 2
    return 0
