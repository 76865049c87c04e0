"""The ``tda`` command line: capture per-example gradients, attribute, report.

    tda capture   --model DIR --data FILE.jsonl --out STORE [layer/projection options]
    tda attribute --store STORE --queries QSTORE --method graddot --top-k 10 --out DIR
    tda report    --scores DIR --store STORE --queries QSTORE --out report.html

Bad input ends with exit code 2 and a one-line reason on stderr.

Under ``torchrun --nproc-per-node N -m tda_plugins.cli ...`` the work is spread over the N
ranks (:mod:`tda_plugins.parallel.ranks`): ``capture`` deals the batches round robin, each rank
writing its own ``rank-<r>`` directory of one store (a full model replica per rank: data
parallel); ``attribute`` splits the training store between the ranks and rank 0 writes the
merged scores. Both give what one process gives.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import SafetensorError

from tda_plugins.capture import LayerSelectionError
from tda_plugins.cli.models import ModelSource
from tda_plugins.cli.option_types import (
    device,
    finite_float,
    non_negative_float,
    positive_int,
    regex,
)
from tda_plugins.methods import METHODS, Checkpoint, Scores, attribute, method_by_name
from tda_plugins.parallel.ranks import Ranks, launch_size, launched_ranks
from tda_plugins.report import render_html, write_html
from tda_plugins.report.tokens import TOKENS_FILE, require_token_scores, token_report
from tda_plugins.session.dataset import capture_examples
from tda_plugins.session.settings import (
    LAYER_OPTION_NAMES,
    PROJECTION_OPTION_NAMES,
    CaptureSettings,
    StoreSettings,
    layer_settings,
)
from tda_plugins.store import StoreError, StoreReader
from tda_plugins.store.io import atomic_write_json, refuse_existing, staged_directory
from tda_plugins.store.writer import DURABILITY

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


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
}


def _subcommand(sub: Any, name: str) -> argparse.ArgumentParser:
    summary, description = _SUBCOMMANDS[name]
    return sub.add_parser(name, help=summary, description=description)


def _add_capture(sub: Any) -> None:
    p = _subcommand(sub, "capture")
    p.add_argument(
        "--model",
        required=True,
        help="local transformers model directory, or a PEFT adapter directory (its base "
        "from adapter_config.json)",
    )
    p.add_argument(
        "--adapter", help="PEFT adapter directory to load on --model (LoRA layers captured)"
    )
    p.add_argument(
        "--data",
        required=True,
        help="JSONL: text | prompt+completion | "
        "messages | input_ids per line, optional integer 'id'",
    )
    p.add_argument("--out", required=True, type=Path, help="gradient store directory to create")
    p.add_argument(
        "--append",
        action="store_true",
        help="add to an existing store of the same model and options (new steps after its own)",
    )
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
    p.add_argument("--k-a", type=positive_int, default=16, help="factor projection: rows of P_a")
    p.add_argument("--k-g", type=positive_int, default=16, help="factor projection: rows of P_g")
    p.add_argument("--k", type=positive_int, default=256, help="dense projection: output dimension")
    p.add_argument(
        "--map",
        dest="projection_map",
        default="gaussian",
        choices=["gaussian", "rademacher", "sparse_jl"],
        help="random map of the projection",
    )
    p.add_argument("--seed", type=int, default=0, help="projection seed")
    p.add_argument(
        "--batch-size", type=positive_int, default=8, help="examples per forward/backward"
    )
    p.add_argument(
        "--max-length",
        type=positive_int,
        help="truncate examples to this many tokens (default and most: the model's positions; "
        "512 for a model without a positions limit)",
    )
    p.add_argument(
        "--eos",
        action="store_true",
        help="end text and completion rows in the tokenizer's end-of-sequence token, as "
        "TRL's SFTTrainer trains them",
    )
    p.add_argument(
        "--durability",
        default="end",
        choices=sorted(DURABILITY),
        help="end (default): no fsync while capturing, every file made durable in one pass "
        "once the capture ends (the command returns after it); step: each step durable "
        "before the next (a long capture to resume with --append after a machine crash); "
        "none: never fsynced (a scratch store)",
    )
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="model dtype")
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
        default=8.0,
        help="most GiB of K-FAC statistics per process; more is refused before any work",
    )
    p.add_argument(
        "--keep-tokens",
        action="store_true",
        help="store per-token factors (needed for token-level scores)",
    )
    p.set_defaults(run=_capture)


def _add_attribute(sub: Any) -> None:
    p = _subcommand(sub, "attribute")
    p.add_argument("--store", required=True, help="training gradient store")
    p.add_argument("--queries", required=True, help="query gradient store")
    p.add_argument(
        "--method",
        required=True,
        choices=sorted(METHODS),
        help="graddot/gradcos: plain/cosine dot; tracin: learning-rate weighted "
        "sum over checkpoints; kfac/ekfac: curvature-preconditioned; logra: "
        "K-FAC on factor-projected gradients; less: Adam-preconditioned cosine",
    )
    p.add_argument(
        "--damping",
        type=non_negative_float,
        default=None,
        help="damping relative to the mean eigenvalue (kfac/ekfac/logra; default 0.1)",
    )
    p.add_argument(
        "--learning-rate",
        type=finite_float,
        default=1.0,
        help="tracin: weight of --store/--queries",
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
    p.add_argument("--top-k", type=positive_int, default=10, help="examples per query in the top-k")
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
    p.set_defaults(run=_attribute)


def _add_report(sub: Any) -> None:
    p = _subcommand(sub, "report")
    p.add_argument("--scores", required=True, help="directory written by `tda attribute`")
    p.add_argument("--store", required=True, help="training store (for texts)")
    p.add_argument("--queries", required=True, help="query store (for texts)")
    p.add_argument("--top-k", type=positive_int, default=10, help="examples per query")
    p.add_argument("--out", type=Path, help="HTML file (default: SCORES/report.html)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.set_defaults(run=_report)


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
    return parser


def _settings(args: argparse.Namespace) -> CaptureSettings:
    """What ``tda capture`` records, as the trainer callbacks' settings: the layer and
    projection options are the callbacks' own (their parser destinations are the
    settings' option names)."""
    layer_names = LAYER_OPTION_NAMES | PROJECTION_OPTION_NAMES
    return CaptureSettings(
        StoreSettings(str(args.out), keep_tokens=args.keep_tokens),
        layers=layer_settings(**{name: getattr(args, name) for name in layer_names}),
        curvature=args.curvature,
        curvature_head=args.curvature_head,
        curvature_budget_gb=args.curvature_budget_gb,
    )


def _capture(args: argparse.Namespace) -> None:
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; give a store directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "store.json").exists():
        raise FileExistsError(f"--out {out} is a non-empty folder that holds no gradient store")
    if args.device_map is not None and (args.device != "cpu" or launch_size() > 1):
        raise ValueError(
            "--device-map places the model itself: give it without --device and without "
            "torchrun (under torchrun every rank holds a whole replica on --device)"
        )
    _capture_on(args, launched_ranks(args.device))


def _capture_on(args: argparse.Namespace, ranks: Ranks) -> None:
    """``tda capture`` on this rank (:func:`~tda_plugins.session.dataset.capture_examples`)."""
    source = ModelSource.resolve(args.model, args.adapter)
    model, tokenizer = source.load(_DTYPES[args.dtype], ranks.device, args.device_map)
    capture_examples(
        model,
        args.data,
        args.out,
        tokenizer=tokenizer,
        settings=_settings(args),
        batch_size=args.batch_size,
        max_length=args.max_length,
        append=args.append,
        metadata={**source.metadata(), "data": str(args.data)},
        ranks=ranks,
        eos=args.eos,
        durability=args.durability,
    )
    if ranks.rank == 0:
        print(f"wrote the examples of {args.data} to {args.out} ({ranks.size} rank(s))")


def _attribute(args: argparse.Namespace) -> None:
    refuse_existing(args.out, args.force)
    _attribute_on(args, launched_ranks(args.device))


def _attribute_on(args: argparse.Namespace, ranks: Ranks) -> None:
    """``tda attribute`` on this rank: each rank scores its part of the store on
    ``ranks.device``; rank 0 writes the merged scores, top-k and report."""
    store, queries = StoreReader(args.store), StoreReader(args.queries)
    options: dict[str, Any] = {} if args.damping is None else {"damping": args.damping}
    if args.method == "tracin":
        options["learning_rate"] = args.learning_rate
        options["extra"] = tuple(
            Checkpoint(StoreReader(s), StoreReader(q), finite_float(lr))
            for s, q, lr in args.checkpoint
        )
    elif args.checkpoint:
        raise ValueError("--checkpoint applies to --method tracin only")
    if args.exclude_params:
        options["exclude_params"] = tuple(args.exclude_params)
    if args.layer_norm:
        options["normalize_layers"] = True
    if args.tokens:
        require_token_scores(store, args.method)
    start = time.perf_counter()
    scores = attribute(
        store,
        queries,
        args.method,
        allow_mismatch=args.allow_mismatch,
        chunk_examples=args.chunk,
        progress=True,
        ranks=ranks,
        **options,
    )
    seconds = time.perf_counter() - start
    if ranks.rank != 0:
        return
    tokens = (
        token_report(method_by_name(args.method, **options), store, queries, scores, args.top_k)
        if args.tokens
        else None
    )
    with staged_directory(args.out) as stage:
        scores.save(stage, k=args.top_k)
        if tokens is not None:
            atomic_write_json(stage / TOKENS_FILE, tokens)
        page = render_html(
            scores, scores.train_texts, scores.query_texts, k=args.top_k, tokens=tokens
        )
        write_html(stage / "report.html", page)
    n, m = scores.values.shape
    print(
        f"scored {n} x {m} with {args.method} in {seconds:.2f} s on {ranks.size} rank(s) "
        f"({ranks.device}): {args.out}"
    )


def _report(args: argparse.Namespace) -> None:
    path = args.out if args.out is not None else Path(args.scores) / "report.html"
    if args.out is not None:
        refuse_existing(path, args.force)
    scores = Scores.load(args.scores)
    store, queries = StoreReader(args.store), StoreReader(args.queries)
    saved = Path(args.scores) / TOKENS_FILE  # from `tda attribute --tokens`
    tokens = json.loads(saved.read_text()) if saved.is_file() else None
    page = render_html(scores, store.texts(), queries.texts(), k=args.top_k, tokens=tokens)
    write_html(path, page)
    print(f"wrote {path}")


#: What a user's input can cause; each ends the command with exit code 2 and one line.
USER_ERRORS = (
    StoreError,
    LayerSelectionError,
    ValueError,
    OSError,  # missing, unreadable or unwritable files and folders
    SafetensorError,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tda`` console script; returns the exit code (2: bad input,
    with one line on stderr naming it)."""
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except USER_ERRORS as exc:
        reason = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"tda {args.command}: error: {reason}", file=sys.stderr)
        return 2
    return 0
