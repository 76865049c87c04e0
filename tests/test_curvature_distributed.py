"""K-FAC statistics of 2 ranks (``tests.launch.forked_ranks``, gloo, a hand-written DDP loop: see
``tests/curvature_dist_worker.py``) equal those of one process on the same global batches,
under both reduction schedules, with each layer saved by its owner alone: a tiny Llama's
linear layers, and a tiny GPT-2's every layer type, from one launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tda_plugins import LayerSelection
from tda_plugins.precondition import PlanInputs, load_curvature, plan_capture
from tda_plugins.precondition.plan import assign_owners
from tda_plugins.precondition.snapshots import KroneckerFactors, latest_set, read_set
from tests.curvature_dist_worker import SCHEDULES, run
from tests.launch import forked_ranks
from tests.models import tiny_causal_lm
from tests.stores import rel_error
from tests.zygote import Zygote

#: fp32 products and sums, added in another order (and the DDP all-reduce's rounding).
TOL = 1e-5


def assert_same(got: dict[str, KroneckerFactors], ref: dict[str, KroneckerFactors]) -> None:
    assert got.keys() == ref.keys()
    for name, stats in ref.items():
        assert torch.equal(got[name].tokens, stats.tokens), name
        assert rel_error(got[name].a_sum, stats.a_sum) <= TOL, name
        assert rel_error(got[name].g_sum, stats.g_sum) <= TOL, name


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, zygote: Zygote) -> Path:
    """``<root>/curvature_dist_worker/<kind>``: both kinds from one two-rank launch."""
    root = tmp_path_factory.mktemp("curvature-ranks")
    forked_ranks(zygote, root, "curvature_dist_worker:linear,all")
    return root


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_save_owned_layers_whose_union_equals_one_process(launched: Path) -> None:
    ranks, one = launched / "curvature_dist_worker" / "linear", launched / "one" / "linear"
    run(one)  # the reference: one process, whole global batches

    plan = plan_capture(
        tiny_causal_lm("llama", torch.float32),
        PlanInputs(LayerSelection("linear"), curvature_head=True, world_size=2),
    )
    owners = assign_owners(
        {n: a * a + s * s for n, (a, s) in plan.curvature_shapes.items()}, world_size=2
    )
    reference = load_curvature(one / "local")
    for schedule in SCHEDULES:
        root = ranks / schedule
        assert_same(load_curvature(root), reference)
        step_2 = latest_set(root, at_step=2)
        assert step_2 is not None
        one_step_2 = latest_set(one / "local", at_step=2)
        assert one_step_2 is not None
        assert_same(step_2.load(), one_step_2.load())
        for rank in (0, 1):
            with safe_open(root / f"rank-{rank}" / "curvature.safetensors", "pt") as f:
                saved = {key.rsplit("::", 1)[0] for key in f.keys()}  # noqa: SIM118
            assert saved == {n for n, r in owners.items() if r == rank}, (schedule, rank)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_sum_every_layer_type_as_one_process(launched: Path) -> None:
    """Statistics of a tiny fp32 GPT-2's every layer (embeddings' token counts, the tied
    head's diagonal, norm scales' single factor) from 2 ranks of a hand-written DDP loop
    (the launch) equal one process's on the same global batches, under both reduction
    schedules (the owner schedule reducing a diagonal whole and a dense factor a few rows
    at a time), each layer saved by its owner."""
    run(launched / "one" / "all", kind="all")
    reference = load_curvature(launched / "one" / "all" / "local")
    forms = {tuple(len(t.shape) for t in (s.a_sum, s.g_sum)) for s in reference.values()}
    assert {(1, 2), (2, 1)} <= forms  # an embedding's diagonal A, the tied head's S
    assert any(s.a_sum.numel() == 0 for s in reference.values())  # norm scales
    for schedule in SCHEDULES:
        root = launched / "curvature_dist_worker" / "all" / schedule
        got = load_curvature(root)
        assert got.keys() == reference.keys()
        assert read_set(root).units == [("transformer.wte", "lm_head")]
        for name, stats in reference.items():
            assert torch.equal(got[name].tokens, stats.tokens), (schedule, name)
            assert rel_error(got[name].a_sum, stats.a_sum) <= 1e-5, (schedule, name)
            assert rel_error(got[name].g_sum, stats.g_sum) <= 1e-5, (schedule, name)
