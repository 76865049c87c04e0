"""One rank of the transformers data-parallel selection runs: the subject of the DDP and
FSDP2 test in ``tests/test_hf_distributed.py``.

:func:`main`, on every rank of a two-rank launch (``tests/ranks_worker.py``), runs on the
tiny Llama (fp32, full fine-tuning,
``layers="all"``), gloo on CPU:

1. ``ddp``: a real ``Trainer`` under DDP for :data:`STEPS` steps, accumulation
   :data:`ACCUMULATION`, token counts averaged across ranks, with ``DataSelectionCallback``
   (half of each step's global batch dropped) and a :class:`SelectionAudit` after it.
2. ``fsdp``: the same model ``fully_shard``-ed (each block, then the root: DTensor
   parameters sharded on dim 0), trained by a hand-written loop that drives the callback's
   trainer events (``on_train_begin``, ``on_step_begin``, ``on_pre_optimizer_step``,
   ``on_train_end``) as ``Trainer`` does: accelerate on CPU drops FSDP2 to DDP, so the
   ``Trainer`` cannot run it here. Each micro-batch's loss is the model's
   ``num_items_in_batch`` mean times the world size, as ``Trainer`` computes it with
   ``average_tokens_across_devices``. Step 0 lets the cost model route every layer's
   correction; steps 1 and 2 force the ``gather`` and the ``reduce`` route.

Each rank writes under ``OUT/<mode>/rank<r>``: the audit (weights, its micro-batches, the
full ``.grad`` after selection), ``history.json`` (the global outcome per step), and for
FSDP ``routes.json`` and ``memory.json`` (the most bytes the selection held at once: the
gathered target, and per step the surgery's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainerControl, TrainerState

from tda_plugins.data_selection import StepSelection
from tda_plugins.integrations.transformers import DataSelectionCallback
from tests.models import tiny_causal_lm
from tests.selection_helpers import PINNED, SelectionAudit, StepAudit, label_counts
from tests.trainers import pad_rows, token_rows, training_args

STEPS = 3
ACCUMULATION = 2
PER_DEVICE = 2
FRACTION = 0.5
MAX_GRAD_NORM = 1e9  # no clipping: the tests compare the unclipped corrected gradient
TARGET_SEED = 7
#: Steps of the FSDP run whose correction route is forced (the others: the cost model's).
FORCED = {1: "gather", 2: "reduce"}


def target_rows() -> list[dict[str, Any]]:
    return [{"input_ids": r} for r in token_rows(3, seed=TARGET_SEED)]


def history_json(history: list[StepSelection]) -> dict[int, dict[str, Any]]:
    return {h.step: h.summary() for h in history}


def ddp(out: Path) -> None:
    selection = DataSelectionCallback(target_rows(), fraction=FRACTION, layers="all", **PINNED)
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
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(48)]),
        data_collator=pad_rows,
        callbacks=[selection, audit],
    )
    trainer.train()
    rank_dir = out / f"rank{args.process_index}"
    audit.save(rank_dir)
    (rank_dir / "history.json").write_text(json.dumps(history_json(selection.history)))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def sharded_llama() -> nn.Module:
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", torch.float32)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def fsdp(out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = sharded_llama()
    args = training_args(
        out / "trainer",
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUMULATION,
        max_grad_norm=MAX_GRAD_NORM,
        ddp_backend="gloo",
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    selection = DataSelectionCallback(target_rows(), fraction=FRACTION, layers="all", **PINNED)
    state, control = TrainerState(), TrainerControl()
    selection.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    assert selection.session is not None
    surgery = selection.session.selector.surgery
    rows = token_rows(STEPS * world * ACCUMULATION * PER_DEVICE, seed=3)
    audit: dict[int, StepAudit] = {}
    routes: dict[int, dict[str, str]] = {}
    peaks: dict[int, int] = {}
    per_rank = ACCUMULATION * PER_DEVICE
    for step in range(STEPS):
        state.global_step = step
        surgery.forced = FORCED.get(step)
        surgery.peak_bytes = 0
        window = rows[step * world * per_rank : (step + 1) * world * per_rank]
        mine = window[rank * per_rank : (rank + 1) * per_rank]
        micro = [pad_rows([{"input_ids": r} for r in mine[j::ACCUMULATION]]) for j in range(2)]
        tokens = int(label_counts(pad_rows([{"input_ids": r} for r in window])).sum())
        selection.on_step_begin(args, state, control, model=model)
        weights = {k: _full(v) for k, v in model.state_dict().items()}
        for batch in micro:
            output = model(**batch, num_items_in_batch=torch.tensor(tokens))
            (output.loss * world).backward()
        selection.on_pre_optimizer_step(args, state, control, model=model)
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        audit[step] = StepAudit(weights, micro, [float(tokens)] * len(micro), grads=grads)
        routes[step] = dict(surgery.routes)
        peaks[step] = surgery.peak_bytes
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    selection.on_train_end(args, state, control, model=model)
    rank_dir = out / f"rank{rank}"
    saver = SelectionAudit()
    saver.steps = audit
    saver.save(rank_dir)
    (rank_dir / "history.json").write_text(json.dumps(history_json(selection.history)))
    (rank_dir / "routes.json").write_text(json.dumps(routes))
    memory = {
        "target_peak_bytes": selection.session.selector.target_peak_bytes,
        "surgery_peak_bytes": peaks,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "max_grad_norm_restored": args.max_grad_norm == MAX_GRAD_NORM,
    }
    (rank_dir / "memory.json").write_text(json.dumps(memory))


def main(out: Path) -> None:
    ddp(out / "ddp")
    fsdp(out / "fsdp")
