"""Run by ``torchrun`` (or plainly, as one process): HF Trainer + GradientCaptureCallback.

Usage: python -m torch.distributed.run --nproc-per-node=2 tests/hf_ddp_worker.py STORE OUT
The learning rate is 0, so every per-example gradient is taken at the initial weights and
does not depend on which rank or step saw the example.
"""

from __future__ import annotations

import os
import sys

import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from tda_plugins.integrations.transformers import GradientCaptureCallback, pad_examples
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
    Trainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows()),
        data_collator=pad_examples,
        callbacks=[GradientCaptureCallback(store_dir=store, layers="all")],
    ).train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
