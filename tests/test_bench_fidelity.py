"""Smoke tests of benchmarks/fidelity.py on its --quick replicas (our library only)."""

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import fidelity
import fidelity_methods
import fidelity_metric
import fidelity_peers
import fidelity_report
import fidelity_training
import fidelity_truth
from fidelity_truth import FineTuning, LeaveOneOut, SubsetRuns

REPLICAS = list(fidelity_truth.REPLICAS)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("loo-cache")


@pytest.fixture(scope="module", params=REPLICAS)
def fine(request: pytest.FixtureRequest, cache: Path) -> FineTuning:
    return fidelity_truth.prepare(fidelity_truth.replica(request.param, quick=True), cache)


@pytest.fixture(scope="module")
def loo(fine: FineTuning, cache: Path) -> LeaveOneOut:
    return fidelity_truth.leave_one_out(fine, cache)


@pytest.fixture(scope="module")
def subsets(fine: FineTuning, cache: Path) -> SubsetRuns:
    return fidelity_truth.subset_runs(fine, cache)


def test_blocks_are_distinct_and_removed_are_training_indices(fine: FineTuning) -> None:
    config, blocks = fine.config, fine.blocks
    both = torch.cat([blocks.train, blocks.validation])
    assert both.shape == (config.train_blocks + config.val_blocks, config.block)
    assert torch.unique(both, dim=0).shape[0] == both.shape[0]
    assert blocks.removed.unique().numel() == config.removed
    assert int(blocks.removed.max()) < config.train_blocks
    assert torch.equal(blocks.order.sort().values, torch.arange(config.train_blocks))


def test_nothing_removed_is_exactly_zero_effect(fine: FineTuning, loo: LeaveOneOut) -> None:
    assert loo.determinism == 0.0
    again = fine.losses()
    assert torch.equal(again - loo.full, torch.zeros_like(loo.full))
    # Each removal does change the run: no removed block has an all-zero effect row.
    assert loo.effects.shape == (fine.config.val_blocks, fine.config.removed)
    assert bool((loo.effects.abs().amax(dim=0) > 0).all())


def test_worker_processes_give_the_same_losses(cache: Path) -> None:
    """The retrains spread over two spawned processes are the same runs, bit for bit."""
    fine = fidelity_truth.prepare(fidelity_truth.replica("random", quick=True), cache)
    loo = fidelity_truth.leave_one_out(fine, cache)
    runs = [{}, {"skip": int(fine.blocks.removed[0])}]
    spread, _ = fidelity_truth.many_losses(fine, runs, 2, "two workers")
    assert torch.equal(spread[0], loo.full) and torch.equal(spread[1], loo.without[0])


def test_cache_returns_the_same_runs(fine: FineTuning, loo: LeaveOneOut, cache: Path) -> None:
    key = fidelity_truth.cache_key(fine)
    assert (cache / f"loo-{key}.safetensors").exists()
    cached = fidelity_truth.leave_one_out(fine, cache)
    assert torch.equal(cached.without, loo.without) and torch.equal(cached.full, loo.full)
    other = replace(fine, config=replace(fine.config, learning_rate=2e-3))
    assert fidelity_truth.cache_key(other) != key
    moved = {k: v + 1e-3 for k, v in fine.start.state.items()}
    assert fidelity_truth.cache_key(replace(fine, start=replace(fine.start, state=moved))) != key


def test_the_pretrained_start_is_a_trained_model_cached_on_its_own_topics(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pre-training lowers the loss on the topics it never sees; the fine-tuning blocks
    are cut from those topics only (the two texts split the documentation); a second
    call reads the weights back (no pre-training), and pre-training again gives the same
    weights bit for bit."""
    chosen = fidelity_truth.replica("pretrained", quick=True)
    fine = fidelity_truth.prepare(chosen, cache)
    done = fine.start.pretrained
    assert done is not None and done.losses.shape == (chosen.start.pretraining.steps,)
    assert float(done.probe_losses[-1]) < float(done.probe_losses[0]) - 1.0
    split = chosen.start.pretraining.split
    seen = fidelity_training.documentation_text(0, split)
    unseen = fidelity_training.documentation_text(split)
    assert seen + b"\n\n" + unseen == fidelity_training.documentation_text()
    assert chosen.start.fine_tuning_text() == unseen
    width = chosen.config.block
    cuts = {unseen[i : i + width] for i in range(0, len(unseen) - width + 1, width)}
    for block in torch.cat([fine.blocks.train, fine.blocks.validation]):
        assert bytes(block.to(torch.uint8).tolist()) in cuts
    again = fidelity_training.pretrain(
        chosen.config, chosen.start.pretraining, fidelity_training.build_model(chosen.config)
    )
    assert all(torch.equal(again.state[k], v) for k, v in fine.start.state.items())

    def no_pretraining(*args: object, **kwargs: object) -> None:
        raise AssertionError("pre-trained again although the weights are cached")

    monkeypatch.setattr(fidelity_truth, "pretrain", no_pretraining)
    cached = fidelity_truth.prepare(chosen, cache)
    assert all(torch.equal(cached.start.state[k], v) for k, v in fine.start.state.items())
    random = fidelity_truth.prepare(fidelity_truth.replica("random", quick=True), cache)
    assert fidelity_truth.cache_key(random) != fidelity_truth.cache_key(fine)


def test_the_training_run_is_enough_to_replay_it(fine: FineTuning, tmp_path: Path) -> None:
    """A trajectory method sees the whole run: a plain AdamW loop over ``task.run``'s
    initial weights, batches and settings alone lands on the trained weights bit for bit,
    and ``step_loss`` is that loss with each row weighted."""
    task = fidelity.make_task(fine, tmp_path)
    model = fidelity_training.build_model(fine.config)
    model.load_state_dict(task.run.initial_state)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=task.run.adamw.learning_rate,
        betas=task.run.adamw.betas,
        eps=task.run.adamw.eps,
        weight_decay=task.run.adamw.weight_decay,
    )
    assert len(task.run.batches) == fine.config.steps
    with fidelity_training.deterministic():
        for rows in task.run.batches:
            ids = task.train[rows]
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in task.state.items())

    rows = task.run.batches[0]
    ids = task.train[rows]
    with torch.no_grad():
        mean_loss = model(input_ids=ids, labels=ids).loss
        weights = torch.ones(rows.numel())
        weights[0] = 0.0
        others = model(input_ids=ids[1:], labels=ids[1:]).loss * (rows.numel() - 1)
        torch.testing.assert_close(task.step_loss(model, 0), mean_loss)
        torch.testing.assert_close(task.step_loss(model, 0, weights), others / rows.numel())


def test_each_attributor_runs_alone_in_its_own_directory(
    fine: FineTuning, loo: LeaveOneOut, subsets: SubsetRuns, tmp_path: Path
) -> None:
    seen: dict[str, Path] = {}

    def record(name: str) -> fidelity_methods.Attributor:
        def attributor(task: fidelity_methods.FidelityTask) -> torch.Tensor:
            seen[name] = task.work
            return torch.zeros(task.validation.shape[0], task.train.shape[0])

        return attributor

    task = fidelity.make_task(fine, tmp_path)
    truth = fidelity_metric.GroundTruth(loo, fine.blocks.removed, subsets, 100)
    attributors = {"a": record("a"), "peer:b": record("peer:b")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fidelity, "ATTRIBUTORS", attributors)
        results, _, _ = fidelity.attribute(task, list(attributors), truth)
    assert [r.name for r in results] == ["a", "peer:b"]
    assert seen["a"] != seen["peer:b"]
    assert all(path.is_relative_to(tmp_path) for path in seen.values())


def test_metric_is_one_for_the_effects_themselves(loo: LeaveOneOut) -> None:
    same = fidelity_metric.fidelity("self", loo.effects, loo.effects, 200, 0.0)
    flipped = fidelity_metric.fidelity("flipped", -loo.effects, loo.effects, 200, 0.0)
    assert same.mean == pytest.approx(1.0) and flipped.mean == pytest.approx(-1.0)
    low, high = same.interval()
    assert low <= same.mean <= high
    assert flipped.interval(same) == pytest.approx((-2.0, -2.0))


def test_script_scores_every_attributor_on_the_cached_runs(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fidelity.json"
    argv = ["--quick", "--cache", str(cache), "--json", str(out), "--no-write", "--workers", "1"]
    fidelity.main(argv)
    assert len(list(cache.glob("lds-*.safetensors"))) == len(REPLICAS)
    found = json.loads(out.read_text())
    assert list(found) == REPLICAS
    printed = capsys.readouterr().out
    for name in REPLICAS:
        chosen = fidelity_truth.replica(name, quick=True)
        fine = fidelity_truth.prepare(chosen, cache)
        figures = found[name]
        loo = fidelity_truth.leave_one_out(fine, cache)
        assert figures["effects"] == loo.effects.tolist()  # read from the cache
        assert figures["reproduced_max_abs"] == 0.0  # the attribution process's run is the same
        # every registered attributor ran (no peer library is installed beside the tests)
        assert set(fidelity_methods.ATTRIBUTORS) == set(figures["methods"])
        assert set(figures["lds"]) == set(figures["methods"])
        for method in figures["methods"]:
            for result in (figures["methods"][method], figures["lds"][method]):
                assert len(result["per_query"]) == chosen.config.val_blocks, method
                assert all(math.isfinite(x) for x in result["per_query"]), method
                assert result["seconds"] > 0 or result is figures["lds"][method]
        assert len(figures["layers"]) == 2 * chosen.config.n_layer * 2  # attention, MLP
        assert f"{fidelity_report.SECTION}: {chosen.title}" in printed


def test_a_peer_that_cannot_run_is_a_row_with_its_reason(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # opacus is not installed in the main venv: its attributor must report that, not crash.
    peer = fidelity_peers.PeerAttributor("opacus", "graddot")
    monkeypatch.setitem(fidelity.ATTRIBUTORS, "opacus:graddot", peer)
    out = tmp_path / "fidelity.json"
    argv = ["--quick", "--cache", str(cache), "--json", str(out), "--no-write", "--workers", "1"]
    fidelity.main([*argv, "--replicas", "random", "--methods", "graddot", "opacus:graddot"])
    found = json.loads(out.read_text())["random"]
    assert set(found["methods"]) == {"graddot"}
    assert "opacus" in found["could_not_run"]["opacus:graddot"]


def test_our_best_is_compared_with_the_best_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        fidelity.ATTRIBUTORS, "opacus:graddot", fidelity_peers.PeerAttributor("opacus", "graddot")
    )
    rho = torch.linspace(0.1, 0.3, 16, dtype=torch.float64)
    ours = fidelity_metric.Fidelity("graddot", rho + 0.1, 200)
    peer = fidelity_metric.Fidelity("opacus:graddot", rho, 200)
    lds = {"graddot": fidelity_metric.Fidelity("graddot", rho - 0.1, 200), "opacus:graddot": peer}
    text = fidelity_report.peers_text([ours, peer], lds, {"traker:trak": "traker 0.3.2: an error"})
    assert (
        "peer, leave-one-out**: `graddot` 0.300 vs `opacus:graddot` 0.200, difference +0.100"
        in text
    )
    assert "ours is more faithful" in text
    assert "peer, LDS**: `graddot` 0.100 vs `opacus:graddot` 0.200, difference -0.100" in text
    assert "ours is less faithful" in text
    assert "- `traker:trak`: traker 0.3.2: an error" in text


def test_the_metagradient_approximations_are_compared_with_it_on_its_blocks() -> None:
    # The exact metagradient scored 4 of 8 blocks; the approximation is 0.05 below it on
    # those and far off on the others, which must not enter the comparison.
    exact = torch.tensor([0.9, 0.8, 0.9, 0.8] + [math.nan] * 4, dtype=torch.float64)
    fixed = torch.tensor([0.85, 0.75, 0.85, 0.75] + [-1.0] * 4, dtype=torch.float64)
    ceiling = fidelity_metric.Fidelity("metagradient", exact, 200)
    approx = fidelity_metric.Fidelity("metagradient:fixed-denominator", fixed, 200)
    dot = fidelity_metric.Fidelity("graddot", fixed - 0.5, 200)
    text = fidelity_report.ceiling_text([ceiling, approx, dot])
    assert (
        "(on its 4 validation blocks): `metagradient:fixed-denominator` 0.800 vs "
        "`metagradient` 0.850, difference -0.050, paired bootstrap 95% interval "
        "[-0.050, -0.050]" in text
    )
    assert "`graddot` 0.300 vs `metagradient` 0.850, difference -0.550" in text


def test_subsets_are_half_the_blocks_and_train_on_those_only(
    fine: FineTuning, subsets: SubsetRuns
) -> None:
    """Each LDS run trains on its own half: an all-true mask is the reference run itself,
    and a run on a subset is the run on those blocks alone (the order restricted)."""
    config, blocks, masks = fine.config, fine.blocks, subsets.masks
    assert masks.shape == (config.subsets, config.train_blocks)
    assert bool((masks.sum(dim=1) == config.train_blocks // 2).all())
    assert torch.unique(masks, dim=0).shape[0] == config.subsets
    everything = torch.ones(config.train_blocks, dtype=torch.bool)
    full = fine.losses()
    assert torch.equal(fine.losses(subset=everything), full)
    kept = masks[0].nonzero().squeeze(1)
    in_order = blocks.order[masks[0][blocks.order]]  # the training order, kept blocks only
    alone = replace(blocks, train=blocks.train[kept], order=torch.searchsorted(kept, in_order))
    smaller = replace(fine, config=replace(config, train_blocks=kept.numel()), blocks=alone)
    assert torch.equal(smaller.losses(), subsets.losses[0])
    assert not torch.equal(subsets.losses[0], full)


def test_lds_is_one_for_an_exactly_linear_datamodel(
    fine: FineTuning, loo: LeaveOneOut, subsets: SubsetRuns
) -> None:
    """Losses that are exactly minus the summed scores of each run's blocks give LDS 1 for
    those scores and -1 for their negation; only the removed columns count for LOO."""
    config = fine.config
    gen = torch.Generator().manual_seed(0)
    tau = torch.randn(config.val_blocks, config.train_blocks, generator=gen, dtype=torch.float64)
    linear = replace(subsets, losses=-(subsets.masks.double() @ tau.T))
    truth = fidelity_metric.GroundTruth(loo, fine.blocks.removed, linear, 200)
    assert truth.lds("exact", tau).mean == pytest.approx(1.0)
    assert truth.lds("negated", -tau).mean == pytest.approx(-1.0)
    effects = torch.zeros_like(tau)
    effects[:, fine.blocks.removed] = loo.effects
    assert truth.leave_one_out("effects", effects).mean == pytest.approx(1.0)
    with pytest.raises(ValueError, match="validation blocks x training blocks"):
        truth.lds("removed only", tau[:, fine.blocks.removed])


def test_subset_runs_are_read_back_from_the_cache_under_their_own_key(
    fine: FineTuning, subsets: SubsetRuns, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second call trains nothing (the cached losses come back), and the LDS settings
    stay out of the leave-one-out key, so adding LDS runs leaves cached LOO runs valid."""

    def no_training(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("retrained although the runs are cached")

    monkeypatch.setattr(fidelity_truth, "many_losses", no_training)
    again = fidelity_truth.subset_runs(fine, cache)
    assert torch.equal(again.losses, subsets.losses) and torch.equal(again.masks, subsets.masks)
    other = replace(fine, config=replace(fine.config, subsets=fine.config.subsets + 1))
    other = replace(other, config=replace(other.config, subset_fraction=0.25, bootstrap=7))
    assert fidelity_truth.cache_key(other) == fidelity_truth.cache_key(fine)
    with pytest.raises(AssertionError, match="retrained"):
        fidelity_truth.subset_runs(other, cache)
