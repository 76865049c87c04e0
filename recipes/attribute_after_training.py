"""Attribute after training: from a gradient store to top-k examples and an HTML report.

With ``--store`` and ``--queries`` it scores existing stores (written by the trainer
callbacks or ``tda capture``). Without them it runs the whole job on CPU in about a
minute: it trains a byte-level Llama-architecture model on paragraphs of Python's
reference documentation for one epoch with the HF ``Trainer`` and
``GradientCaptureCallback`` (the run ends attribution-ready: per-example gradients and
K-FAC statistics, no second pass), captures a few query paragraphs at the final weights,
and writes ``scores.safetensors``, ``topk.json`` and ``report.html``.

``--model DIR`` (a local transformers directory) or ``--smollm2`` (SmolLM2-135M-Instruct,
the cache ``make demo`` writes) runs the same job on a real model, with its own tokenizer
on the same paragraphs. Only the linear layers of its last ``--train-blocks`` decoder
blocks are trained, and captured; the rest is frozen, so the backward stops there (with
SmolLM2 the whole job takes about a minute on CPU, a step about 3.5 s, and each query's
top training example is the paragraph it was made from).

    python recipes/attribute_after_training.py --out runs/attribute --method gradcos
    python recipes/attribute_after_training.py --smollm2 --out runs/attribute-smollm2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from byte_text import split_rows, tiny_llama  # the script's own folder is on sys.path
from datasets import Dataset
from smollm2 import (
    add_model_flags,
    load_pretrained,
    model_dir,
    tokenize_rows,
    train_only_last_blocks,
)
from torch import nn
from transformers import Trainer, TrainingArguments

from tda_plugins import CaptureEngine, causal_lm_example_losses
from tda_plugins.capture import content_hash
from tda_plugins.integrations.transformers import GradientCaptureCallback, pad_examples
from tda_plugins.methods import METHODS, attribute
from tda_plugins.precondition import CurvatureAccumulator
from tda_plugins.report import render_html, write_html
from tda_plugins.store import GradientStore


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--store", help="existing training store (skip the demo training)")
    p.add_argument("--queries", help="existing query store (with --store)")
    p.add_argument(
        "--method",
        default="gradcos",
        choices=list(METHODS),
        help="attribution method (gradcos suits gradients captured across training; K-FAC "
        "and EK-FAC statistics mix every step's weights)",
    )
    p.add_argument("--top-k", type=int, default=5, help="examples per query in the report")
    p.add_argument("--out", default="runs/attribute", help="output directory")
    p.add_argument("--train-examples", type=int, default=96, help="demo: training paragraphs")
    p.add_argument("--queries-count", type=int, default=4, help="demo: query paragraphs")
    p.add_argument("--batch-size", type=int, default=8, help="demo: training batch size")
    p.add_argument(
        "--learning-rate",
        type=float,
        help="demo: AdamW learning rate (default: 3e-3 for the tiny model, 1e-4 for a real one)",
    )
    p.add_argument("--seed", type=int, default=0, help="demo: data and model seed")
    add_model_flags(p)
    p.add_argument(
        "--train-blocks",
        type=int,
        default=2,
        help="demo with a real model: train and capture the linear layers of the last n "
        "decoder blocks, freeze the rest",
    )
    args = p.parse_args(argv)
    if (args.store is None) != (args.queries is None):
        p.error("give both --store and --queries, or neither (to run the demo)")
    if args.store is not None and (args.model or args.smollm2):
        p.error("--model/--smollm2 choose the demo's model; with --store there is no training")
    args.model_dir = model_dir(args, p)
    if args.learning_rate is None:
        args.learning_rate = 3e-3 if args.model_dir is None else 1e-4
    return args


def _texts(rows: list[dict]) -> dict[int, str]:
    batch = pad_examples(rows)
    ids = content_hash(batch["input_ids"], batch["attention_mask"])
    return dict(zip(ids.tolist(), (r["text"] for r in rows), strict=True))


def demo_model(args: argparse.Namespace) -> tuple[nn.Module, list[dict], list[dict]]:
    """The model to train, training rows and query rows (``input_ids`` and ``text``): the
    tiny byte-level model, or a real one with its tokenizer and its last blocks trainable."""
    train_rows, query_rows = split_rows(args.train_examples, args.queries_count, args.seed)
    if args.model_dir is None:
        return tiny_llama(args.seed), train_rows, query_rows
    model, tokenizer = load_pretrained(args.model_dir)
    trained = train_only_last_blocks(model, args.train_blocks)
    print(f"{args.model_dir}: training and capturing {len(trained)} linear layers, {trained[0]}...")
    return model, tokenize_rows(tokenizer, train_rows), tokenize_rows(tokenizer, query_rows)


def train_with_capture(args: argparse.Namespace, out: Path) -> tuple[Path, Path]:
    """Train one epoch with the capture callback; capture the queries at the end."""
    model, train_rows, query_rows = demo_model(args)
    # curvature_head: the untied head's dense vocab x vocab output factor (cheap at this
    # vocabulary; by default its diagonal, as a vocabulary-wide factor would not fit)
    capture = GradientCaptureCallback(
        store_dir=str(out / "train_store"), layers="linear", curvature=True, curvature_head=True
    )  # K-FAC/EK-FAC below need the statistics however large (default: only when cheap)
    training = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=args.batch_size,
        num_train_epochs=1,
        learning_rate=args.learning_rate,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=4,
        seed=args.seed,
    )
    dataset = Dataset.from_list([{"input_ids": r["input_ids"]} for r in train_rows])
    Trainer(
        model=model,
        args=training,
        train_dataset=dataset,
        data_collator=pad_examples,
        callbacks=[capture],
    ).train()
    GradientStore(out / "train_store").write_examples(_texts(train_rows))
    query_dir = out / "query_store"
    capture_queries(model, query_rows, query_dir, capture)
    return out / "train_store", query_dir


def capture_queries(
    model: torch.nn.Module, rows: list[dict], path: Path, like: GradientCaptureCallback
) -> None:
    """Each query's own summed-loss gradient, with the training capture's settings."""
    store = GradientStore(path)
    layers = like.settings.layers
    consumers = [store, CurvatureAccumulator(path)]
    batch = pad_examples(rows)
    model.eval()
    with CaptureEngine(
        model, layers=layers.selection, projection=layers.projection, consumers=consumers
    ) as e:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        causal_lm_example_losses(model(**inputs).logits, batch["labels"]).sum().backward()
        e.end()
    store.write_examples(_texts(rows))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.store is None:
        store_dir, query_dir = train_with_capture(args, out)
    else:
        store_dir, query_dir = Path(args.store), Path(args.queries)
    scores = attribute(store_dir, query_dir, args.method, progress=True)
    scores.save(out / "scores", k=args.top_k)
    page = render_html(scores, scores.train_texts, scores.query_texts, k=args.top_k)
    report = write_html(out / "report.html", page)
    for entry in scores.top_k(1):
        if not entry["helpful"]:
            print(f"query {entry['query_id']}: no training example lowers its loss")
            continue
        best = entry["helpful"][0]["id"]
        print(f"query {entry['query_id']}: most helpful training example {best}:")
        print("   ", (scores.train_texts.get(best) or "(no text)")[:100])
    print(
        f"{args.method}: {scores.values.shape[0]} training x {scores.values.shape[1]} query "
        f"scores in {out / 'scores'}; report: {report}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
