"""One rank of a DDP ``Trainer`` run with online data selection: the subject of the DDP test.

``python -m torch.distributed.run --standalone --nproc-per-node=2
tests/selection_ddp_worker.py OUT`` trains the tiny Llama (fp32, full fine-tuning,
``layers="all"``) for :data:`STEPS` optimizer steps with gloo DDP on CPU, accumulation
:data:`ACCUMULATION`, and ``DataSelectionCallback`` (bottom half of each rank's examples
dropped). Each rank writes, under ``OUT/rank<r>``, its :class:`SelectionAudit` (weights,
micro-batches and post-selection ``.grad`` per step) and ``history.json`` (its dropped ids
per step).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import Trainer

from tda_plugins.integrations.transformers import DataSelectionCallback
from tests.models import tiny_causal_lm
from tests.selection_helpers import SelectionAudit
from tests.trainers import pad_rows, token_rows, training_args

STEPS = 2
ACCUMULATION = 2
PER_DEVICE = 2
MAX_GRAD_NORM = 1e9  # no clipping: the test compares the unclipped corrected gradient


def main(out: Path) -> None:
    torch.set_num_threads(1)
    selection = DataSelectionCallback(
        target=[{"input_ids": r} for r in token_rows(3, seed=7)], fraction=0.5, layers="all"
    )
    audit = SelectionAudit()
    args = training_args(
        out / "trainer",
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        max_grad_norm=MAX_GRAD_NORM,
        ddp_backend="gloo",
        average_tokens_across_devices=True,
    )
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=args,
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(32)]),
        data_collator=pad_rows,
        callbacks=[selection, audit],
    )
    trainer.train()
    rank_dir = out / f"rank{args.process_index}"
    audit.save(rank_dir)
    history = {h.step: h.summary()["dropped_ids"] for h in selection.history}
    (rank_dir / "history.json").write_text(json.dumps(history))
    (rank_dir / "world.json").write_text(json.dumps({"world_size": args.world_size}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
