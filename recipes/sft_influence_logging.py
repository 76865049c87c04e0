"""Live influence logging during TRL SFT with LoRA, then the top-k report.

A TRL ``SFTTrainer`` fine-tunes a LoRA model; ``InfluenceLoggingCallback`` scores every
step's training examples against a few query examples from the training backward itself
and puts ``influence/q<j>_mean`` / ``_max`` into the trainer's logs. The run ends with
``influence.json``, ``influence.html`` (running top-k helpful and harmful examples with
their texts) and ``influence.png`` (influence over training).

Default: a byte-level Llama-architecture model built from a config, trained on Python
reference paragraphs (CPU, under a minute, nothing downloaded). ``--model DIR`` trains a
local transformers model instead, with its own tokenizer on the same paragraphs;
``--smollm2`` trains SmolLM2-135M-Instruct (the cache ``make demo`` writes to
``.cache/smollm2-135m``).

    python recipes/sft_influence_logging.py --out runs/influence
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from byte_text import byte_tokenizer, split_rows, tiny_llama  # the script's folder is on sys.path
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from smollm2 import add_model_flags, load_pretrained, model_dir, tokenize_rows
from trl import SFTConfig, SFTTrainer

from tda_plugins.integrations.transformers import InfluenceLoggingCallback


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_flags(p)
    p.add_argument("--out", default="runs/influence", help="output directory")
    p.add_argument("--train-examples", type=int, default=64, help="training paragraphs")
    p.add_argument("--queries", type=int, default=3, help="query paragraphs")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="per-device batch size")
    p.add_argument("--learning-rate", type=float, default=2e-3, help="LoRA learning rate")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank")
    p.add_argument(
        "--method", default="gradcos", choices=["gradcos", "graddot"], help="live influence score"
    )
    p.add_argument("--top-k", type=int, default=5, help="examples per query in the report")
    p.add_argument("--seed", type=int, default=0, help="data and model seed")
    args = p.parse_args(argv)
    args.model_dir = model_dir(args, p)
    return args


def load(args: argparse.Namespace) -> tuple[Any, Any, list[dict], list[dict]]:
    """Model, tokenizer, training rows and query rows (``input_ids`` per row)."""
    train, queries = split_rows(args.train_examples, args.queries, args.seed)
    if args.model_dir is None:
        return tiny_llama(args.seed), byte_tokenizer(), train, queries
    model, tokenizer = load_pretrained(args.model_dir)
    return model, tokenizer, tokenize_rows(tokenizer, train), tokenize_rows(tokenizer, queries)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    model, tokenizer, train, queries = load(args)
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        target_modules="all-linear",
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    config = SFTConfig(
        output_dir=str(out / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        logging_steps=2,
        packing=False,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=args.seed,
    )
    dataset = Dataset.from_list([{"input_ids": r["input_ids"]} for r in train])
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    influence = InfluenceLoggingCallback(
        queries=[{"input_ids": r["input_ids"]} for r in queries],
        method=args.method,
        top_k=args.top_k,
        report_dir=str(out),
    ).add_to(trainer)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "influence/q0_mean" in h]
    print(
        f"{len(logged)} log entries carry influence metrics; last: "
        f"{ {k: round(v, 4) for k, v in logged[-1].items() if k.startswith('influence')} }"
    )
    for kind, path in influence.report.items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
