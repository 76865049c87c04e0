"""What each ``tda`` command does once its arguments are parsed (:mod:`.commands`): the
library, torch and transformers are imported here, not by the parser, so that ``tda
--help`` and usage errors return at once."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from tda_plugins.capture import LayerSelectionError
from tda_plugins.capture.layers import lora_adapter_names
from tda_plugins.cli.choices import DEFAULT_TOP_K
from tda_plugins.cli.models import ModelSource
from tda_plugins.cli.option_types import positive_float
from tda_plugins.methods import Checkpoint, Scores, attribute, method_by_name
from tda_plugins.methods.scores import saved_sources, saved_top_k
from tda_plugins.parallel.ranks import Ranks, launch_size, launched_ranks
from tda_plugins.report import render_html, write_html
from tda_plugins.report.tokens import TOKENS_FILE, require_token_scores, token_report
from tda_plugins.session.dataset import capture_examples
from tda_plugins.session.scoring import score_examples
from tda_plugins.session.settings import (
    LAYER_OPTION_DEFAULTS,
    LAYER_OPTION_NAMES,
    PROJECTION_OPTION_NAMES,
    CaptureSettings,
    StoreSettings,
    layer_settings,
)
from tda_plugins.store import StoreError, StoreReader
from tda_plugins.store.io import atomic_write_json, refuse_existing, staged_directory


def _settings(args: argparse.Namespace) -> CaptureSettings:
    """What ``tda capture`` records, as the trainer callbacks' settings: the layer and
    projection options are the callbacks' own (their parser destinations are the
    settings' option names); with ``--like`` they are the store's, and refused here."""
    layer_names = LAYER_OPTION_NAMES | PROJECTION_OPTION_NAMES
    options = {name: getattr(args, name) for name in layer_names}
    if args.like is not None:
        given = sorted(n for n, v in options.items() if v != LAYER_OPTION_DEFAULTS[n])
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            raise ValueError(
                f"--like takes the layers and projection of {args.like}; leave out {flags}"
            )
        options = {}
    sizing: dict[str, Any] = {
        "curvature_head": args.curvature_head or None,
        "curvature_budget_gb": args.curvature_budget_gb,
    }
    sized = {name: value for name, value in sizing.items() if value is not None}
    if sized and args.curvature is False:
        flags = ", ".join("--" + name.replace("_", "-") for name in sized)
        raise ValueError(f"{flags} size the K-FAC statistics --no-curvature turns off; leave out")
    return CaptureSettings(
        StoreSettings(str(args.out), keep_tokens=args.keep_tokens),
        layers=layer_settings(**options),
        curvature=args.curvature,
        **sized,
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
    # under --like, the adapter takes the name the store's layers hold (PEFT's default
    # else), so that a run's named adapter matches its store
    names = sorted(lora_adapter_names(StoreReader(args.like).layer_names)) if args.like else []
    model, tokenizer = source.load(
        getattr(torch, args.dtype), ranks.device, args.device_map, *names[:1]
    )
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
        completion_only_loss=args.completion_only_loss,
        assistant_only_loss=args.assistant_only_loss,
        durability=args.durability,
        wait_durable=True,  # exit status 0 only with the store on disk
        like=args.like,
    )
    if ranks.rank == 0:
        print(f"wrote the examples of {args.data} to {args.out} ({ranks.size} rank(s))")


def _attribute(args: argparse.Namespace) -> None:
    for store, queries, rate in args.checkpoint or ():
        try:
            positive_float(rate)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--checkpoint {store} {queries} {rate}: its LR {exc}") from None
    checkpoints = [path for s, q, _ in args.checkpoint or () for path in (s, q)]
    refuse_existing(args.out, args.force, [args.store, args.queries, *checkpoints])
    _attribute_on(args, launched_ranks(args.device))


def _attribute_on(args: argparse.Namespace, ranks: Ranks) -> None:
    """``tda attribute`` on this rank: each rank scores its part of the store on
    ``ranks.device``; rank 0 writes the merged scores, top-k and report."""
    store, queries = StoreReader(args.store), StoreReader(args.queries)
    options: dict[str, Any] = {} if args.damping is None else {"damping": args.damping}
    if args.method == "tracin":
        options["learning_rate"] = 1.0 if args.learning_rate is None else args.learning_rate
        options["extra"] = tuple(
            Checkpoint(StoreReader(s), StoreReader(q), positive_float(lr))
            for s, q, lr in args.checkpoint
        )
    elif args.checkpoint or args.learning_rate is not None:
        flag = "--checkpoint" if args.checkpoint else "--learning-rate"
        raise ValueError(f"{flag} applies to --method tracin only")
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
    sources = {"store": store.rows_digest(), "queries": queries.rows_digest()}
    _write_scores(args.out, scores, args.top_k, tokens, sources)
    n, m = scores.values.shape
    print(
        f"scored {n} x {m} with {args.method} in {seconds:.2f} s on {ranks.size} rank(s) "
        f"({ranks.device}): {args.out}"
    )


def _write_scores(
    out: Path,
    scores: Scores,
    top_k: int,
    tokens: Any = None,
    sources: dict[str, str] | None = None,
) -> None:
    """``out`` made whole at once: the scores, their top-k (with the scored stores' row
    digests, ``sources``), ``tokens.json`` (token scores, where asked) and
    ``report.html``."""
    with staged_directory(out) as stage:
        scores.save(stage, k=top_k, sources=sources)
        if tokens is not None:
            atomic_write_json(stage / TOKENS_FILE, tokens)
        page = render_html(scores, scores.train_texts, scores.query_texts, k=top_k, tokens=tokens)
        write_html(stage / "report.html", page)


def _score(args: argparse.Namespace) -> None:
    """``tda score``: :func:`~tda_plugins.session.scoring.score_examples`, one process."""
    inputs = [args.data, args.queries, args.model, *([args.adapter] if args.adapter else [])]
    refuse_existing(args.out, args.force, inputs)
    if launch_size() > 1:
        raise ValueError(
            "tda score runs in one process, where every rank would score every row; under "
            "torchrun use tda capture and tda attribute, which split the work over the ranks"
        )
    source = ModelSource.resolve(args.model, args.adapter)
    model, tokenizer = source.load(getattr(torch, args.dtype), torch.device(args.device), None)
    start = time.perf_counter()
    scores = score_examples(
        model,
        args.data,
        args.queries,
        tokenizer=tokenizer,
        method=args.method,
        batch_size=args.batch_size,
        max_length=args.max_length,
        eos=args.eos,
        completion_only_loss=args.completion_only_loss,
        assistant_only_loss=args.assistant_only_loss,
        **{name: getattr(args, name) for name in LAYER_OPTION_NAMES | PROJECTION_OPTION_NAMES},
    )
    seconds = time.perf_counter() - start
    _write_scores(args.out, scores, args.top_k)
    n, m = scores.values.shape
    print(f"scored {n} x {m} with {args.method} in {seconds:.2f} s, no store: {args.out}")


def _report(args: argparse.Namespace) -> None:
    if launch_size() > 1:
        raise ValueError(
            "tda report runs in one process (every rank would write the same page); run it "
            "without torchrun"
        )
    path = args.out if args.out is not None else Path(args.scores) / "report.html"
    scores = Scores.load(args.scores)
    if path.is_dir():
        raise IsADirectoryError(f"--out {path} is a folder; give the report's file path")
    refuse_existing(path, args.force, [args.scores, args.store, args.queries])
    top_k = args.top_k or saved_top_k(args.scores) or DEFAULT_TOP_K
    store, queries = StoreReader(args.store), StoreReader(args.queries)
    recorded = saved_sources(args.scores)
    _require_scored(store, scores.train_ids, "--store", args.scores, recorded.get("store"))
    _require_scored(queries, scores.query_ids, "--queries", args.scores, recorded.get("queries"))
    saved = Path(args.scores) / TOKENS_FILE  # from `tda attribute --tokens`
    tokens = json.loads(saved.read_text()) if saved.is_file() else None
    page = render_html(scores, store.lazy_texts(), queries.texts(), k=top_k, tokens=tokens)
    write_html(path, page)
    print(f"wrote {path}")


def _require_scored(
    store: StoreReader, ids: torch.Tensor, flag: str, scores: Path, digest: str | None
) -> None:
    """Refuse a store that is not the one the scores' side ``ids`` came from: its rows'
    ``digest`` where ``tda attribute`` recorded it, else every id held. A report from
    another store would show other examples' texts."""
    if digest is not None and store.rows_digest() != digest:
        raise ValueError(
            f"{flag} {store.root} is not the store the scores in {scores} were computed "
            "from (its rows differ): give that store (tda attribute's --store and --queries)"
        )
    held = {i for step in store.step_example_ids().values() for i in step}
    missing = [i for i in ids.tolist() if i not in held]
    if missing:
        raise ValueError(
            f"{flag} {store.root} holds no example {missing[0]} of the scores in {scores} "
            f"({len(missing)} of their {len(ids)} ids missing): give the store they were "
            "scored from (tda attribute's --store and --queries)"
        )


#: What a user's input can cause; each ends the command with exit code 2 and one line.
USER_ERRORS = (
    StoreError,
    LayerSelectionError,
    ValueError,
    OSError,  # missing, unreadable or unwritable files and folders
    SafetensorError,
)


def run(args: argparse.Namespace) -> None:
    """Run the parsed command ``args.command``."""
    commands = {"capture": _capture, "attribute": _attribute, "report": _report, "score": _score}
    commands[args.command](args)
