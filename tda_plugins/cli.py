"""The ``tda`` command line: capture per-example gradients, attribute, report.

    tda capture   --model DIR --data FILE.jsonl --out STORE [layer/projection options]
    tda attribute --store STORE --queries QSTORE --method graddot --top-k 10 --out DIR
    tda report    --scores DIR --store STORE --queries QSTORE --out report.html

Bad input ends with exit code 2 and a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tda_plugins.api import causal_lm_example_losses
from tda_plugins.capture import CaptureEngine, LayerSelection, LayerSelectionError, content_hash
from tda_plugins.grads import ProjectionConfig
from tda_plugins.methods import METHODS, Checkpoint, Scores, method_by_name
from tda_plugins.precondition import CurvatureAccumulator
from tda_plugins.report import write_html
from tda_plugins.store import GradientStore, StoreError, StoreReader

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _add_capture(sub: Any) -> None:
    p = sub.add_parser(
        "capture",
        help="per-example gradients of a JSONL dataset with a local model",
        description="Write the exact per-example gradients (each example's own summed token "
        "loss) of every example in --data to a gradient store, with inline K-FAC statistics.",
    )
    p.add_argument("--model", required=True, help="local transformers model directory")
    p.add_argument(
        "--data",
        required=True,
        help="JSONL: text | prompt+completion | "
        "messages | input_ids per line, optional integer 'id'",
    )
    p.add_argument("--out", required=True, help="gradient store directory to create/append")
    p.add_argument(
        "--layers",
        default="auto",
        choices=["auto", "linear", "lora", "all"],
        help="layer family (auto: LoRA adapters if present, else linear)",
    )
    p.add_argument("--include", help="regex: keep only layers whose name matches")
    p.add_argument("--exclude", help="regex: drop layers whose name matches")
    p.add_argument("--last-n-blocks", type=int, help="keep only the last N transformer blocks")
    p.add_argument(
        "--projection",
        default="none",
        choices=["none", "factor", "dense"],
        help="project gradients in the hook (factor = LoGra)",
    )
    p.add_argument("--k-a", type=int, default=16, help="factor projection: rows of P_a")
    p.add_argument("--k-g", type=int, default=16, help="factor projection: rows of P_g")
    p.add_argument("--k", type=int, default=256, help="dense projection: output dimension")
    p.add_argument(
        "--map",
        default="gaussian",
        choices=["gaussian", "rademacher", "sparse_jl"],
        help="random map of the projection",
    )
    p.add_argument("--seed", type=int, default=0, help="projection seed")
    p.add_argument("--batch-size", type=int, default=8, help="examples per forward/backward")
    p.add_argument("--max-length", type=int, default=512, help="truncate examples to this")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="model dtype")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--no-curvature", action="store_true", help="skip inline K-FAC statistics")
    p.add_argument(
        "--keep-tokens",
        action="store_true",
        help="store per-token factors (needed for token-level scores)",
    )
    p.set_defaults(run=_capture)


def _add_attribute(sub: Any) -> None:
    p = sub.add_parser(
        "attribute",
        help="score training examples against queries",
        description="Score every example of --store against every query of --queries. "
        "Both stores must be captured with the same layers, projection and seed.",
    )
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
        type=float,
        default=0.1,
        help="damping relative to the mean eigenvalue (kfac/ekfac/logra)",
    )
    p.add_argument(
        "--learning-rate", type=float, default=1.0, help="tracin: weight of --store/--queries"
    )
    p.add_argument(
        "--checkpoint",
        nargs=3,
        action="append",
        default=[],
        metavar=("STORE", "QUERIES", "LR"),
        help="tracin: another checkpoint",
    )
    p.add_argument("--top-k", type=int, default=10, help="examples per query in the top-k")
    p.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="training examples scored at once (default: the query count, between 8 and 256)",
    )
    p.add_argument("--out", required=True, help="output directory (scores, top-k, report)")
    p.set_defaults(run=_attribute)


def _add_report(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="HTML page of the top-k per query",
        description="Render saved scores as HTML, with texts where stored.",
    )
    p.add_argument("--scores", required=True, help="directory written by `tda attribute`")
    p.add_argument("--store", required=True, help="training store (for texts)")
    p.add_argument("--queries", required=True, help="query store (for texts)")
    p.add_argument("--top-k", type=int, default=10, help="examples per query")
    p.add_argument("--out", help="HTML file (default: SCORES/report.html)")
    p.set_defaults(run=_report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tda", description="Training-data attribution from per-example gradients."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_capture(sub)
    _add_attribute(sub)
    _add_report(sub)
    return parser


def _selection(args: argparse.Namespace) -> LayerSelection:
    return LayerSelection(
        kind=args.layers,
        include=args.include,
        exclude=args.exclude,
        last_n_blocks=args.last_n_blocks,
    )


def _projection(args: argparse.Namespace) -> ProjectionConfig | None:
    if args.projection == "none":
        return None
    return ProjectionConfig(
        kind=args.projection, k_a=args.k_a, k_g=args.k_g, k=args.k, map=args.map, seed=args.seed
    )


def _load_model(directory: str, dtype: torch.dtype, device: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(directory)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no transformers model at {path} (missing config.json)")
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(torch.device(device)).eval()
    has_tokenizer = any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return model, tokenizer


def _capture(args: argparse.Namespace) -> None:
    from tda_plugins.integrations.transformers.data import batches, read_examples

    model, tokenizer = _load_model(args.model, _DTYPES[args.dtype], args.device)
    examples = read_examples(args.data, tokenizer, args.max_length)
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    store = GradientStore(
        args.out,
        keep_tokens=args.keep_tokens,
        metadata={"model": str(args.model), "data": str(args.data)},
    )
    consumers: list[Any] = [store]
    if not args.no_curvature:
        consumers.append(CurvatureAccumulator(args.out))
    # capture only attributes: autograd need not build the model's own weight gradients
    engine = CaptureEngine(
        model, _selection(args), _projection(args), consumers, parameter_grads=False
    )
    texts: dict[int, str] = {}
    with engine, tqdm(total=len(examples), desc="capture", unit="ex") as bar:
        engine.resume_at_step(store.next_step)  # appending to a store continues its numbering
        for inputs, given, group in batches(examples, args.batch_size, pad_id):
            ids = (
                content_hash(inputs["input_ids"], inputs["attention_mask"])
                if given is None
                else given
            )
            texts.update(zip(ids.tolist(), (e.text for e in group), strict=True))
            inputs = {k: v.to(args.device) for k, v in inputs.items()}
            engine.set_example_ids(ids.to(args.device))
            labels = inputs.pop("labels")
            losses = causal_lm_example_losses(model(**inputs).logits, labels)
            losses.sum().backward()
            model.zero_grad(set_to_none=True)
            engine.optimizer_step()  # one committed store step per batch
            bar.update(len(group))
        engine.end()
    store.write_examples(texts)
    print(f"wrote {len(examples)} examples to {args.out}")


def _attribute(args: argparse.Namespace) -> None:
    store, queries = StoreReader(args.store), StoreReader(args.queries)
    options: dict[str, Any] = {"damping": args.damping}
    if args.method == "tracin":
        options["learning_rate"] = args.learning_rate
        options["extra"] = tuple(
            Checkpoint(StoreReader(s), StoreReader(q), float(lr)) for s, q, lr in args.checkpoint
        )
    elif args.checkpoint:
        raise ValueError("--checkpoint applies to --method tracin only")
    method = method_by_name(args.method, **options)
    scores = method.score(store, queries, chunk_examples=args.chunk, progress=True)
    out = Path(args.out)
    scores.save(out, k=args.top_k)
    write_html(out / "report.html", scores, store.texts(), queries.texts(), args.top_k)
    print(f"scored {scores.values.shape[0]} x {scores.values.shape[1]} with {args.method}: {out}")


def _report(args: argparse.Namespace) -> None:
    scores = Scores.load(args.scores)
    path = Path(args.out) if args.out else Path(args.scores) / "report.html"
    store, queries = StoreReader(args.store), StoreReader(args.queries)
    write_html(path, scores, store.texts(), queries.texts(), args.top_k)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tda`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (StoreError, LayerSelectionError, ValueError, FileNotFoundError) as exc:
        print(f"tda {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
