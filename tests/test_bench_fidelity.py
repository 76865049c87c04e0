"""Smoke test of benchmarks/fidelity.py on its --quick configuration (our library only)."""

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import fidelity
import fidelity_peers

CONFIG = fidelity.QUICK


@pytest.fixture(scope="module")
def blocks() -> fidelity.Blocks:
    return fidelity.make_blocks(CONFIG)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("loo-cache")


@pytest.fixture(scope="module")
def loo(blocks: fidelity.Blocks, cache: Path) -> fidelity.LeaveOneOut:
    return fidelity.leave_one_out(CONFIG, blocks, cache)


@pytest.fixture(scope="module")
def subsets(blocks: fidelity.Blocks, cache: Path) -> fidelity.SubsetRuns:
    return fidelity.subset_runs(CONFIG, blocks, cache)


def test_blocks_are_distinct_and_removed_are_training_indices(blocks: fidelity.Blocks) -> None:
    both = torch.cat([blocks.train, blocks.validation])
    assert both.shape == (CONFIG.train_blocks + CONFIG.val_blocks, CONFIG.block)
    assert torch.unique(both, dim=0).shape[0] == both.shape[0]
    assert blocks.removed.unique().numel() == CONFIG.removed
    assert int(blocks.removed.max()) < CONFIG.train_blocks
    assert torch.equal(blocks.order.sort().values, torch.arange(CONFIG.train_blocks))


def test_nothing_removed_is_exactly_zero_effect(
    blocks: fidelity.Blocks, loo: fidelity.LeaveOneOut
) -> None:
    assert loo.determinism == 0.0
    again = fidelity.run_losses(CONFIG, blocks)
    assert torch.equal(again - loo.full, torch.zeros_like(loo.full))
    # Each removal does change the run: no removed block has an all-zero effect row.
    assert loo.effects.shape == (CONFIG.val_blocks, CONFIG.removed)
    assert bool((loo.effects.abs().amax(dim=0) > 0).all())


def test_cache_returns_the_same_runs(
    blocks: fidelity.Blocks, loo: fidelity.LeaveOneOut, cache: Path
) -> None:
    assert len(list(cache.glob("loo-*.safetensors"))) == 1
    cached = fidelity.leave_one_out(CONFIG, blocks, cache)
    assert torch.equal(cached.without, loo.without) and torch.equal(cached.full, loo.full)
    other = replace(CONFIG, learning_rate=2e-3)
    assert fidelity.cache_key(other, blocks) != fidelity.cache_key(CONFIG, blocks)


def test_metric_is_one_for_the_effects_themselves(loo: fidelity.LeaveOneOut) -> None:
    same = fidelity.fidelity("self", loo.effects, loo.effects, 200, 0.0)
    flipped = fidelity.fidelity("flipped", -loo.effects, loo.effects, 200, 0.0)
    assert same.mean == pytest.approx(1.0) and flipped.mean == pytest.approx(-1.0)
    low, high = same.interval()
    assert low <= same.mean <= high
    assert flipped.interval(same) == pytest.approx((-2.0, -2.0))


def test_script_scores_every_attributor_on_the_cached_runs(
    loo: fidelity.LeaveOneOut, cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fidelity.json"
    fidelity.main(["--quick", "--cache", str(cache), "--json", str(out), "--no-write"])
    assert len(list(cache.glob("lds-*.safetensors"))) == 1
    found = json.loads(out.read_text())
    assert found["effects"] == loo.effects.tolist()  # read from the cache, not retrained
    assert found["reproduced_max_abs"] == 0.0  # the attribution process's run is the same
    assert {"graddot", "gradcos", "tracin", "kfac", "ekfac", "logra", "less"} == set(
        found["methods"]
    )
    assert set(found["lds"]) == set(found["methods"])
    for name in found["methods"]:
        for result in (found["methods"][name], found["lds"][name]):
            assert len(result["per_query"]) == CONFIG.val_blocks, name
            assert all(math.isfinite(x) for x in result["per_query"]), name
    assert len(found["layers"]) == 2 * CONFIG.n_layer * 2  # attention and MLP: 2 layers each
    assert fidelity.SECTION in capsys.readouterr().out


def test_a_peer_that_cannot_run_is_a_row_with_its_reason(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # opacus is not installed in the main venv: its attributor must report that, not crash.
    peer = fidelity_peers.PeerAttributor("opacus", "graddot")
    monkeypatch.setitem(fidelity.ATTRIBUTORS, "opacus:graddot", peer)
    out = tmp_path / "fidelity.json"
    argv = ["--quick", "--cache", str(cache), "--json", str(out), "--no-write"]
    fidelity.main([*argv, "--methods", "graddot", "opacus:graddot"])
    found = json.loads(out.read_text())
    assert set(found["methods"]) == {"graddot"}
    assert "opacus" in found["could_not_run"]["opacus:graddot"]


def test_our_best_is_compared_with_the_best_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        fidelity.ATTRIBUTORS, "opacus:graddot", fidelity_peers.PeerAttributor("opacus", "graddot")
    )
    rho = torch.linspace(0.1, 0.3, 16, dtype=torch.float64)
    ours = fidelity.Fidelity("graddot", rho + 0.1, 200)
    peer = fidelity.Fidelity("opacus:graddot", rho, 200)
    lds = {"graddot": fidelity.Fidelity("graddot", rho - 0.1, 200), "opacus:graddot": peer}
    text = fidelity.peers_text([ours, peer], lds, {"traker:trak": "traker 0.3.2: an error"})
    assert (
        "peer, leave-one-out**: `graddot` 0.300 vs `opacus:graddot` 0.200, difference +0.100"
        in text
    )
    assert "ours is more faithful" in text
    assert "peer, LDS**: `graddot` 0.100 vs `opacus:graddot` 0.200, difference -0.100" in text
    assert "ours is less faithful" in text
    assert "- `traker:trak`: traker 0.3.2: an error" in text


def test_subsets_are_half_the_blocks_and_train_on_those_only(
    blocks: fidelity.Blocks, subsets: fidelity.SubsetRuns
) -> None:
    """Each LDS run trains on its own half: an all-true mask is the reference run itself,
    and a run on a subset is the run on those blocks alone (the order restricted)."""
    masks = subsets.masks
    assert masks.shape == (CONFIG.subsets, CONFIG.train_blocks)
    assert bool((masks.sum(dim=1) == CONFIG.train_blocks // 2).all())
    assert torch.unique(masks, dim=0).shape[0] == CONFIG.subsets
    everything = torch.ones(CONFIG.train_blocks, dtype=torch.bool)
    full = fidelity.run_losses(CONFIG, blocks)
    assert torch.equal(fidelity.run_losses(CONFIG, blocks, subset=everything), full)
    kept = masks[0].nonzero().squeeze(1)
    in_order = blocks.order[masks[0][blocks.order]]  # the training order, kept blocks only
    alone = replace(blocks, train=blocks.train[kept], order=torch.searchsorted(kept, in_order))
    config = replace(CONFIG, train_blocks=kept.numel())
    assert torch.equal(fidelity.run_losses(config, alone), subsets.losses[0])
    assert not torch.equal(subsets.losses[0], full)


def test_lds_is_one_for_an_exactly_linear_datamodel(
    loo: fidelity.LeaveOneOut, blocks: fidelity.Blocks, subsets: fidelity.SubsetRuns
) -> None:
    """Losses that are exactly minus the summed scores of each run's blocks give LDS 1 for
    those scores and -1 for their negation; only the removed columns count for LOO."""
    gen = torch.Generator().manual_seed(0)
    tau = torch.randn(CONFIG.val_blocks, CONFIG.train_blocks, generator=gen, dtype=torch.float64)
    linear = replace(subsets, losses=-(subsets.masks.double() @ tau.T))
    truth = fidelity.GroundTruth(loo, blocks.removed, linear, 200)
    assert truth.lds("exact", tau).mean == pytest.approx(1.0)
    assert truth.lds("negated", -tau).mean == pytest.approx(-1.0)
    effects = torch.zeros_like(tau)
    effects[:, blocks.removed] = loo.effects
    assert truth.leave_one_out("effects", effects).mean == pytest.approx(1.0)
    with pytest.raises(ValueError, match="validation blocks x training blocks"):
        truth.lds("removed only", tau[:, blocks.removed])


def test_subset_runs_are_read_back_from_the_cache_under_their_own_key(
    blocks: fidelity.Blocks,
    subsets: fidelity.SubsetRuns,
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second call trains nothing (the cached losses come back), and the LDS settings
    stay out of the leave-one-out key, so adding LDS runs leaves cached LOO runs valid."""

    def no_training(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("retrained although the runs are cached")

    monkeypatch.setattr(fidelity, "run_losses", no_training)
    again = fidelity.subset_runs(CONFIG, blocks, cache)
    assert torch.equal(again.losses, subsets.losses) and torch.equal(again.masks, subsets.masks)
    other = replace(CONFIG, subsets=CONFIG.subsets + 1, subset_fraction=0.25)
    assert fidelity.cache_key(other, blocks) == fidelity.cache_key(CONFIG, blocks)
    with pytest.raises(AssertionError, match="retrained"):
        fidelity.subset_runs(other, blocks, cache)
