"""Run by ``torchrun`` (or plainly, as one process): HF Trainer + GradientCaptureCallback
+ InfluenceLoggingCallback.

Usage: python -m torch.distributed.run --nproc-per-node=2 tests/hf_ddp_worker.py STORE OUT
The learning rate is 0, so every per-example gradient is taken at the initial weights and
does not depend on which rank or step saw the example. Each rank writes what its
influence logger logged to ``OUT/influence-rank<r>.json`` (the report itself goes to
``OUT/influence/``, from rank 0 alone).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from tda_plugins.integrations.transformers import (
    GradientCaptureCallback,
    InfluenceLoggingCallback,
    pad_examples,
)
from tests.models import lm_batch, tiny_causal_lm

EXAMPLES = 16
GLOBAL_BATCH = 4


def rows() -> list[dict[str, list[int]]]:
    batch = lm_batch(EXAMPLES, 12, lengths=tuple([12, 9, 7, 11] * 4), seed=5)
    keep = batch["attention_mask"].bool()
    return [{"input_ids": batch["input_ids"][i][keep[i]].tolist()} for i in range(EXAMPLES)]


def main(store: str, out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = {"ddp_backend": "gloo"} if world > 1 else {}
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        max_steps=EXAMPLES // GLOBAL_BATCH,
        learning_rate=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        seed=0,
        **distributed,
    )
    model = tiny_causal_lm("llama", torch.float32)
    influence = InfluenceLoggingCallback(
        queries=queries(), method="graddot", top_k=EXAMPLES, layers="all"
    )
    Trainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows()),
        data_collator=pad_examples,
        callbacks=[influence, GradientCaptureCallback(store_dir=store, layers="all")],
    ).train()
    logged = [
        {
            "step": h.step,
            "mean": h.mean.tolist(),
            "max": h.max.tolist(),
            "ids": h.example_ids.tolist(),
        }
        for h in influence.logger.history
    ]
    Path(out, f"influence-rank{args.process_index}.json").write_text(json.dumps(logged))


def queries() -> list[dict[str, list[int]]]:
    batch = lm_batch(2, 10, seed=11)
    return [{"input_ids": row.tolist()} for row in batch["input_ids"]]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
