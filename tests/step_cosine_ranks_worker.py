"""``step_cosine`` with Adam's metric on two data-parallel ranks: one step of
:class:`~tda_plugins.data_selection.DataSelector` over a global batch that the ranks split,
under DDP (``DistributedDataParallel``) and FSDP2 (``fully_shard`` on each block and the
root: DTensor parameters and sharded Adam moments).

:func:`main`, on every rank of a two-rank launch (``tests/ranks_worker.py``), per mode:
the tiny fp64 Llama (``layers="all"``) after one Adam step on :func:`warm_batch` (the same
on every rank, so the weights and moments are one process's), then :func:`window` split
over the ranks (rank ``r`` its examples ``[4r, 4r + 4)`` as two micro-batches of two, the
loss over the global batch's label tokens times the world size, which the data-parallel
reduction averages out) against :func:`target_batch`, ``margin`` :data:`MARGIN`, the
target computed once over the ranks as the session computes it. Rank 0 writes
``<mode>.pt``: the global outcome's dropped mask (in global example order) as each rank
saw it, the whole ``.grad`` after selection and the weights the step started from. Under
DDP the surgery's all-reduce buckets are cut at 4 KiB, so that there are many.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from tda_plugins import CaptureEngine, LayerSelection
from tda_plugins.data_selection import DataSelector, rule_by_name, surgery
from tda_plugins.data_selection.parallel import Ranks
from tda_plugins.data_selection.target import shared_target
from tda_plugins.integrations.transformers.selection import causal_lm_token_counts
from tda_plugins.session.batch import causal_lm_losses
from tests.models import VOCAB, lm_batch, tiny_causal_lm
from tests.selection_helpers import example_losses, label_counts
from tests.stores import ManualScale

MARGIN = 0.001
PER_RANK = 4
MICRO = 2
MODES = ("ddp", "fsdp")
BUCKET_BYTES = surgery.REDUCE_BUCKET_BYTES


def window() -> dict[str, torch.Tensor]:
    """Eight examples: four, then the same four with their fourth token changed. Each of
    rank 0's examples has a near-twin on rank 1, so the pairs across the ranks weigh in
    the rule (a Gram matrix of each rank's own pairs alone keeps another set here)."""
    first = lm_batch(4, 10, lengths=(10, 7, 9, 5), seed=3)
    twins = {k: v.clone() for k, v in first.items()}
    twins["input_ids"][:, 3] = (twins["input_ids"][:, 3] + 1) % VOCAB
    twins["labels"][:, 3] = twins["input_ids"][:, 3]
    return {k: torch.cat([first[k], twins[k]]) for k in first}


def target_batch() -> dict[str, torch.Tensor]:
    return lm_batch(2, 8, lengths=(8, 5), seed=2)


def warm_batch() -> dict[str, torch.Tensor]:
    return lm_batch(4, 10, lengths=(10, 6, 8, 9), seed=3)


def warmed(model: nn.Module) -> torch.optim.Adam:
    """One Adam step on :func:`warm_batch` (every rank the same batch, whose gradient the
    data-parallel reduction averages into one process's)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = warm_batch()
    (example_losses(model, batch).sum() / label_counts(batch).sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run(mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", torch.float64)
    hooked: nn.Module = model
    if mode == "ddp":
        wrapped = DistributedDataParallel(model)
        optimizer = warmed(wrapped)
    else:
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
        optimizer = warmed(model)
    weights = {k: _full(v) for k, v in model.state_dict().items()}
    whole = window()
    tokens = float(label_counts(whole).sum())
    mine = {k: v[rank * PER_RANK : (rank + 1) * PER_RANK] for k, v in whole.items()}
    normalization = ManualScale()
    normalization.value = tokens / world
    forward = wrapped if mode == "ddp" else model
    with CaptureEngine(hooked, layers=LayerSelection("all"), normalization=normalization) as engine:
        selector = DataSelector(
            engine.captured_layers,
            rule=rule_by_name("step_cosine", margin=MARGIN),
            token_counts=causal_lm_token_counts,
            score="adam",
            optimizer=optimizer,
        )
        engine.add_consumer(selector)
        with engine.paused():  # computed as the session does: once, over the ranks
            selector.set_target(
                shared_target(
                    forward,
                    engine.captured_layers,
                    target_batch(),
                    causal_lm_losses,
                    ranks=Ranks.current(),
                    divide=float(world),
                )
            )
        for j in range(0, PER_RANK, MICRO):
            part = {k: v[j : j + MICRO] for k, v in mine.items()}
            first = rank * PER_RANK + j
            engine.set_example_ids(torch.arange(first, first + MICRO))
            (example_losses(forward, part).sum() / tokens * world).backward()
        engine.optimizer_step()
    (outcome,) = selector.history
    order = torch.argsort(outcome.example_ids)
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return outcome.dropped[order], grads, weights


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for mode in MODES:
        # DDP's replicated sums all-reduced in many small buckets (a tiny model's layers
        # would otherwise all fit one): every bucket's cut and split is exercised
        surgery.REDUCE_BUCKET_BYTES = 4096 if mode == "ddp" else BUCKET_BYTES
        dropped, grads, weights = run(mode)
        every = [torch.empty_like(dropped) for _ in range(dist.get_world_size())]
        dist.all_gather(every, dropped)
        if dist.get_rank() == 0:
            torch.save(
                {"dropped": every, "grads": grads, "weights": weights}, folder / f"{mode}.pt"
            )
