"""K-FAC statistics of a hand-written DDP loop (gloo), into one store per reduction
schedule: :func:`main` on every rank of a two-rank launch (``tests/ranks_worker.py``, job
``curvature_dist_worker:KIND,...``), :func:`run` in one process for the reference.

``KIND``: ``linear`` (a tiny Llama's linear layers, its head included) or ``all`` (every
layer of a tiny GPT-2: embeddings, norm scales, the head tied to the input embedding);
each into ``FOLDER/<kind>``.

Each rank trains on its half of every global batch, backpropagating ``world`` times its
summed loss (DDP averages gradients, so every update is that of the global summed loss, as
in one process), with the engine told the scale ``1 / world``. Two accumulators watch the
same engine: ``OUT/local`` (sums reduced to the owners at each commit) and ``OUT/owner``
(each micro-batch's products reduced to the owners, in blocks of a few rows here, so that
a product takes several reductions). Both commit after step 2 and at the end.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tda_plugins import CaptureEngine, LayerSelection
from tda_plugins.precondition import CurvatureAccumulator, PlanInputs, plan, plan_capture
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import ManualScale, summed_loss

STEPS = 3
GLOBAL_BATCH = 4
SCHEDULES = ("local", "owner")


#: Model and layers of each kind of run.
KINDS = {"linear": ("llama", LayerSelection("linear")), "all": ("gpt2", LayerSelection("all"))}


def run(out: Path, rank: int = 0, world: int = 1, kind: str = "linear") -> None:
    arch, selection = KINDS[kind]
    model = tiny_causal_lm(arch, torch.float32)
    planned = plan_capture(model, PlanInputs(selection, curvature_head=True, world_size=world))
    accumulators = [
        CurvatureAccumulator(
            out / schedule,
            rank,
            shapes=planned.curvature_shapes,
            world_size=world,
            schedule=schedule,
        )
        for schedule in SCHEDULES
    ]
    trained = DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = ManualScale()
    scale.value = 1 / world
    share = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    with CaptureEngine(
        model, layers=selection, consumers=accumulators, normalization=scale
    ) as engine:
        for step in range(STEPS):
            batch = lm_batch(GLOBAL_BATCH, 10, lengths=(10, 7, 9, 5), seed=step)
            (world * summed_loss(trained, {k: v[share] for k, v in batch.items()})).backward()
            engine.optimizer_step()
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                for accumulator in accumulators:
                    accumulator.commit(2)
        engine.end()


def main(folder: Path, *kinds: str) -> None:
    """Each kind in turn, a few rows of each product per reduction under the owner
    schedule (the block size restored after)."""
    block = plan.REDUCE_BLOCK_BYTES
    plan.REDUCE_BLOCK_BYTES = 1024
    try:
        for kind in kinds:
            run(folder / kind, dist.get_rank(), dist.get_world_size(), kind)
    finally:
        plan.REDUCE_BLOCK_BYTES = block
