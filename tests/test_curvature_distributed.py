"""K-FAC statistics of 2 ranks (``torchrun``, gloo, a hand-written DDP loop: see
``tests/curvature_dist_worker.py``) equal those of one process on the same global batches,
under both reduction schedules, with each layer saved by its owner alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tda_plugins import LayerSelection
from tda_plugins.precondition import PlanInputs, load_curvature, plan_capture
from tda_plugins.precondition.plan import assign_owners
from tda_plugins.precondition.snapshots import KroneckerFactors, latest_set
from tests.curvature_dist_worker import SCHEDULES, run
from tests.launch import torchrun
from tests.models import tiny_causal_lm
from tests.stores import rel_error

#: fp32 products and sums, added in another order (and the DDP all-reduce's rounding).
TOL = 1e-5


def assert_same(got: dict[str, KroneckerFactors], ref: dict[str, KroneckerFactors]) -> None:
    assert got.keys() == ref.keys()
    for name, stats in ref.items():
        assert torch.equal(got[name].tokens, stats.tokens), name
        assert rel_error(got[name].a_sum, stats.a_sum) <= TOL, name
        assert rel_error(got[name].g_sum, stats.g_sum) <= TOL, name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_save_owned_layers_whose_union_equals_one_process(tmp_path: Path) -> None:
    torchrun("curvature_dist_worker.py", tmp_path / "ddp")
    run(tmp_path / "one")  # the reference: one process, whole global batches

    plan = plan_capture(
        tiny_causal_lm("llama", torch.float32),
        PlanInputs(LayerSelection("linear"), curvature_head=True, world_size=2),
    )
    owners = assign_owners(
        {n: a * a + s * s for n, (a, s) in plan.curvature_shapes.items()}, world_size=2
    )
    reference = load_curvature(tmp_path / "one" / "local")
    for schedule in SCHEDULES:
        root = tmp_path / "ddp" / schedule
        assert_same(load_curvature(root), reference)
        step_2 = latest_set(root, at_step=2)
        assert step_2 is not None
        one_step_2 = latest_set(tmp_path / "one" / "local", at_step=2)
        assert one_step_2 is not None
        assert_same(step_2.load(), one_step_2.load())
        for rank in (0, 1):
            with safe_open(root / f"rank-{rank}" / "curvature.safetensors", "pt") as f:
                saved = {key.rsplit("::", 1)[0] for key in f.keys()}  # noqa: SIM118
            assert saved == {n for n, r in owners.items() if r == rank}, (schedule, rank)
