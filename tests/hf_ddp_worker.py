"""The transformers callbacks inside data-parallel training, as ``torchrun`` runs them.

:func:`main` runs on every rank of a two-rank launch (``tests/ranks_worker.py``: gloo, CPU),
and in the test's own process for the one-process reference. Both runs of the script train
on the same global batches (:data:`GLOBAL_BATCH` examples per optimizer step) and write
under ``FOLDER/<world size>/``:

* ``trainer/``: HF ``Trainer`` (DDP across the ranks, through accelerate) with
  ``GradientCaptureCallback`` (every layer) and ``InfluenceLoggingCallback`` (GradDot,
  every layer, top-k over every example); ``store/``, ``report/`` and ``logs-<rank>.json``
  (the influence entries of ``state.log_history`` on that rank).
* ``sharded/``: the same two callbacks on a ``fully_shard``-ed model (FSDP2: each decoder
  layer and the root, DTensor parameters sharded over the ranks; one process: the plain
  model). Through the HF ``Trainer`` on CPU, accelerate silently trains an FSDP2 config as
  DDP, so this part drives the callbacks' trainer events by hand around a hand-written
  training step, in the ``Trainer``'s order: ``on_train_begin``; per step
  ``on_step_begin``, the micro-batches' forward and backward (loss as the ``Trainer``
  forms it: token sum over ``num_items_in_batch``, the global batch's label tokens, times
  the world size, which FSDP2's gradient reduction averages out), ``on_pre_optimizer_step``,
  ``optimizer.step()``, ``on_optimizer_step``, ``on_step_end``, ``on_log``; ``on_save``
  after :data:`SAVE_AT` steps; ``on_train_end``. Each rank takes its consecutive share of
  each global batch, one example per micro-batch (two micro-batches per step); the
  one-process run takes the global batch as two micro-batches of two.

AdamW with a non-zero learning rate: the ranks' averaged gradient equals the one-process
gradient, so both runs pass through the same weights at every step (to fp32 rounding).

Two ranks also resume a copy of the sharded store that lost rank 1's folder
(``without-rank-1/``, :func:`resume_without_a_rank`), and train :data:`MIXED_STEPS` steps
of the sharded run under FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``
with ``GradientCaptureCallback`` alone (``mixed/``, :func:`mixed_precision_run`).

``plan-<rank>.json``: the capture's memory plan of the training state each rank holds
under FSDP2 and HSDP (:func:`planned_training_bytes`).

Last, ``gathered-<rank>.json``: what :func:`~tda_plugins.parallel.gather.rank_gather`
returns on each rank for rows of unequal counts (none on rank 0) and for one object per
rank.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from tda_plugins.integrations.transformers import (
    GradientCaptureCallback,
    InfluenceLoggingCallback,
    pad_examples,
)
from tda_plugins.parallel.gather import rank_gather
from tda_plugins.session.capture import capture_plan
from tda_plugins.session.settings import CaptureSettings
from tda_plugins.store import StoreError, StoreReader
from tests.models import lm_batch, tiny_causal_lm

EXAMPLES = 16
GLOBAL_BATCH = 4
STEPS = EXAMPLES // GLOBAL_BATCH
SAVE_AT = 2
LEARNING_RATE = 1e-2
TOP_K = EXAMPLES  # the report lists every example
MIXED_STEPS = 2


def rows() -> list[dict[str, list[int]]]:
    batch = lm_batch(EXAMPLES, 12, lengths=tuple([12, 9, 7, 11] * 4), seed=5)
    keep = batch["attention_mask"].bool()
    return [{"input_ids": batch["input_ids"][i][keep[i]].tolist()} for i in range(EXAMPLES)]


def queries() -> list[dict[str, list[int]]]:
    batch = lm_batch(2, 8, lengths=(8, 6), seed=11)
    keep = batch["attention_mask"].bool()
    return [{"input_ids": batch["input_ids"][i][keep[i]].tolist()} for i in range(2)]


def callbacks(folder: Path) -> tuple[GradientCaptureCallback, InfluenceLoggingCallback]:
    capture = GradientCaptureCallback(store_dir=str(folder / "store"), layers="all")
    influence = InfluenceLoggingCallback(
        queries(), method="graddot", layers="all", top_k=TOP_K, report_dir=str(folder / "report")
    )
    return capture, influence


def save_logs(
    folder: Path, rank: int, logs: list[dict[str, Any]], influence: InfluenceLoggingCallback
) -> None:
    """This rank's logged influence metrics, and which report files it wrote."""
    (folder / f"report-{rank}.json").write_text(json.dumps(sorted(influence.report)))
    entries = [
        {k: v for k, v in entry.items() if k == "step" or k.startswith("influence/")}
        for entry in logs
        if "influence/q0_mean" in entry
    ]
    (folder / f"logs-{rank}.json").write_text(json.dumps(entries))


def trainer_run(folder: Path, world: int) -> None:
    """HF ``Trainer``; DDP across the ranks when ``world > 1``."""
    args = TrainingArguments(
        output_dir=str(folder / "out"),
        per_device_train_batch_size=GLOBAL_BATCH // world,
        max_steps=STEPS,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        logging_strategy="steps",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        seed=0,
        **({"ddp_backend": "gloo"} if world > 1 else {}),
    )
    capture, influence = callbacks(folder)
    trainer = Trainer(
        model=tiny_causal_lm("llama", torch.float32),
        args=args,
        train_dataset=Dataset.from_list(rows()),
        data_collator=pad_examples,
        callbacks=[capture, influence],
    )
    trainer.train()
    save_logs(folder, args.process_index, trainer.state.log_history, influence)


def shard(model: nn.Module, policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """FSDP2 over the default process group: each decoder layer, then the root."""
    mixed = {} if policy is None else {"mp_policy": policy}
    for layer in model.model.layers:
        fully_shard(layer, **mixed)
    fully_shard(model, **mixed)
    return model


def backward(model: nn.Module, batch: list[dict[str, list[int]]], world: int, rank: int) -> Any:
    """This process's micro-batches of the global ``batch`` forward and backward, the
    loss as the ``Trainer`` forms it; the last micro-batch's loss."""
    tokens = sum(len(e["input_ids"]) - 1 for e in batch)  # the labels the loss sums
    share = GLOBAL_BATCH // world
    mine = batch[rank * share : (rank + 1) * share]
    micro = [mine[:1], mine[1:]] if world > 1 else [mine[:2], mine[2:]]
    for examples in micro:
        loss = model(**pad_examples(examples), num_items_in_batch=tokens).loss
        (loss * world).backward()
    return loss


def sharded_run(folder: Path, world: int, rank: int) -> None:
    """The callbacks' events driven by hand around a training step of a sharded model."""
    model = tiny_causal_lm("llama", torch.float32).train()
    if world > 1:
        shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = TrainingArguments(output_dir=str(folder / "out"), use_cpu=True, report_to=[])
    state, control = TrainerState(), TrainerControl()
    hooks = callbacks(folder)
    events: dict[str, Any] = {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler}
    data = rows()
    logs: list[dict[str, Any]] = []
    for cb in hooks:
        cb.on_train_begin(args, state, control, **events)
    for step in range(STEPS):
        for cb in hooks:
            cb.on_step_begin(args, state, control, **events)
        loss = backward(model, data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH], world, rank)
        for cb in hooks:
            cb.on_pre_optimizer_step(args, state, control, **events)
        optimizer.step()
        for cb in hooks:
            cb.on_optimizer_step(args, state, control, **events)
        scheduler.step()
        optimizer.zero_grad()
        state.global_step = step + 1
        for cb in hooks:
            cb.on_step_end(args, state, control, **events)
        entry: dict[str, Any] = {"loss": float(loss.detach()), "step": state.global_step}
        for cb in hooks:
            cb.on_log(args, state, control, logs=entry, **events)
        logs.append(entry)
        if state.global_step == SAVE_AT:
            for cb in hooks:
                cb.on_save(args, state, control, **events)
    for cb in hooks:
        cb.on_train_end(args, state, control, **events)
    save_logs(folder, rank, logs, hooks[1])


def mixed_precision_run(folder: Path, world: int, rank: int) -> None:
    """:func:`sharded_run`'s first :data:`MIXED_STEPS` steps, the model sharded with
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (bf16 forward, backward and
    gradient reduction; fp32 sharded weights and optimizer), ``GradientCaptureCallback``
    alone. ``record.pt`` (rank 0): each step's fp32 weights before it and ``.grad`` after
    the ranks' reduction, both gathered whole."""
    model = tiny_causal_lm("llama", torch.float32).train()
    shard(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    args = TrainingArguments(output_dir=str(folder / "out"), use_cpu=True, report_to=[])
    state, control = TrainerState(), TrainerControl()
    capture = GradientCaptureCallback(store_dir=str(folder / "store"), layers="all")
    events: dict[str, Any] = {"model": model, "optimizer": optimizer}
    record: dict[str, list[dict[str, torch.Tensor]]] = {"weights": [], "grads": []}
    capture.on_train_begin(args, state, control, **events)
    for step in range(MIXED_STEPS):
        record["weights"].append({n: p.detach().full_tensor() for n, p in model.named_parameters()})
        capture.on_step_begin(args, state, control, **events)
        backward(model, rows()[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH], world, rank)
        record["grads"].append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        capture.on_pre_optimizer_step(args, state, control, **events)
        optimizer.step()
        capture.on_optimizer_step(args, state, control, **events)
        optimizer.zero_grad()
        state.global_step = step + 1
        capture.on_step_end(args, state, control, **events)
    capture.on_train_end(args, state, control, **events)
    if rank == 0:
        torch.save(record, folder / "record.pt")


def resume_without_a_rank(sharded: Path, folder: Path, rank: int) -> None:
    """Both ranks resume, at step :data:`SAVE_AT`, a copy of the sharded run's store from
    which rank 1's folder was removed (a store as one process writes it): rank 1 finds no
    step of its own, rank 0 finds its steps whole. ``refused-<rank>.json``: each rank's
    refusal (``null``: none), and the steps and rank folders the store holds after."""
    store = folder / "store"
    if rank == 0:
        shutil.copytree(sharded / "store", store)
        shutil.rmtree(store / "rank-1")
    dist.barrier()
    model = shard(tiny_causal_lm("llama", torch.float32).train())
    args = TrainingArguments(output_dir=str(folder / "out"), use_cpu=True, report_to=[])
    state = TrainerState(global_step=SAVE_AT)
    # without statistics, whose set at SAVE_AT lost rank 1's part: rank 0 then passes
    capture = GradientCaptureCallback(store_dir=str(store), layers="all", curvature=False)
    try:
        capture.on_train_begin(args, state, TrainerControl(), model=model)
        refusal = None
    except StoreError as error:
        refusal = str(error)
    dist.barrier()
    steps = StoreReader(store).step_example_ids()
    outcome = {
        "refusal": refusal,
        "steps": {str(k): len(v) for k, v in steps.items()},
        "rank_folders": sorted(p.name for p in store.glob("rank-*")),
    }
    (folder / f"refused-{rank}.json").write_text(json.dumps(outcome))


def planned_training_bytes(folder: Path, world: int, rank: int) -> None:
    """The memory plan's training state on this rank for the tiny Llama sharded over the
    ``world`` ranks (FSDP2), and replicated on each as one shard (HSDP, mesh world x 1):
    ``plan-<rank>.json``."""
    planned = {}
    for name, dims in (("fsdp", {"shard": world}), ("hsdp", {"replicate": world, "shard": 1})):
        model = tiny_causal_lm("llama", torch.float32)
        mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
        fully_shard(model, mesh=mesh)
        planned[name] = capture_plan(plan_settings(folder), model, rank).training_bytes
    (folder / f"plan-{rank}.json").write_text(json.dumps(planned))


def plan_settings(folder: Path) -> CaptureSettings:
    """Capture settings to plan with (nothing is written)."""
    return CaptureSettings.from_options(store_dir=str(folder / "unwritten"))


def unequal_gather(folder: Path, rank: int) -> None:
    """Rank ``r`` gathers ``r * 3`` rows of ``(r, row)`` pairs (rank 0: none) and the token
    lists of ``r + 1`` examples: ``gathered-<rank>.json``."""
    gather = rank_gather()
    values = torch.tensor([[rank, row] for row in range(rank * 3)], dtype=torch.float32)
    rows_ = gather.rows(values.reshape(-1, 2)).tolist()
    objects = gather.objects({rank * 10 + i: [rank] * (i + 1) for i in range(rank + 1)})
    (folder / f"gathered-{rank}.json").write_text(json.dumps({"rows": rows_, "objects": objects}))


def main(folder: Path) -> None:
    """Both runs and the gather into ``folder/<world size>``: the launch's world size
    under ``tests/ranks_worker.py`` (accelerate joins its gloo group), else 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = folder / str(world)
    trainer_run(out / "trainer", world)
    rank = dist.get_rank() if world > 1 else 0
    sharded_run(out / "sharded", world, rank)
    if world > 1:
        resume_without_a_rank(out / "sharded", out / "without-rank-1", rank)
        mixed_precision_run(out / "mixed", world, rank)
        planned_training_bytes(out, world, rank)
    unequal_gather(out, rank)
