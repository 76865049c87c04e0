"""Curvature that fits: fp32 running sums, rank ownership, the memory plan and its
refusal, and the vocabulary-wide head's output factor kept diagonal by default.

Oracles: fp64 sums of the same factors built without the accumulator, ``nbytes`` of the
tensors a real capture allocates, and the plain greedy bound for the owner assignment.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

from tda_plugins import CaptureEngine, LayerSelection, RecordCollector
from tda_plugins.capture.adapters import DEFAULT_REGISTRY
from tda_plugins.capture.layers import head_layers
from tda_plugins.capture.normalization import SummedLoss
from tda_plugins.capture.records import LayerRecord, MicroBatchRecord
from tda_plugins.grads import TokenFactors
from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.methods import method_by_name
from tda_plugins.precondition import (
    CurvatureAccumulator,
    CurvatureBudgetError,
    PlanInputs,
    load_curvature,
    plan_capture,
    statistics,
)
from tda_plugins.precondition.plan import assign_owners
from tda_plugins.precondition.snapshots import KroneckerFactors, write_statistics
from tda_plugins.session.capture import CaptureSession
from tda_plugins.session.settings import CaptureSettings
from tda_plugins.store import GradientStore, StoreError, StoreReader
from tda_plugins.store.codec import compact
from tda_plugins.store.layout import CURVATURE_FILE
from tests.models import VOCAB, lm_batch, tiny_causal_lm
from tests.stores import capture_store, summed_loss

# -- fp32 running sums ---------------------------------------------------------------------

N_A, N_S, TOKENS, MICRO_BATCHES, COMMIT_EVERY = 256, 64, 256, 1000, 50


def synthetic_records(seed: int, count: int = MICRO_BATCHES) -> list[MicroBatchRecord]:
    """``count`` micro-batches of one linear layer's fp32 factors shaped like real ones:
    inputs with a non-zero mean and a decaying spectrum, small output gradients, and a
    scale that varies from micro-batch to micro-batch."""
    gen = torch.Generator().manual_seed(seed)
    mix_a = torch.randn(N_A, N_A, generator=gen) * torch.arange(1, N_A + 1) ** -0.75
    mix_g = torch.randn(N_S, N_S, generator=gen) * torch.arange(1, N_S + 1) ** -0.5
    mean = 0.5 * torch.randn(N_A, generator=gen)
    module = nn.Linear(N_A, N_S, bias=False)
    adapter = DEFAULT_REGISTRY.lookup(module)
    assert adapter is not None
    records = []
    for i in range(count):
        scale = 1 + 0.5 * torch.rand((), generator=gen).item()
        a = (torch.randn(1, TOKENS, N_A, generator=gen) @ mix_a.T + mean) * scale
        g = 1e-3 * torch.randn(1, TOKENS, N_S, generator=gen) @ mix_g.T
        grads = TokenFactors(a, g)
        records.append(
            MicroBatchRecord(
                index=i,
                step=i,
                example_ids=torch.tensor([i]),
                token_mask=None,
                layers={"fc": LayerRecord("fc", module, adapter, grads)},
            )
        )
    return records


def kfac_scores(stats: KroneckerFactors, train: Tensor, queries: Tensor) -> Tensor:
    """``<(S + l_S)^-1 G_q (A + l_A)^-1, G_z>`` in fp64 by dense solves (damping 0.1)."""
    a, s = stats.a_cov, stats.g_cov
    a = a + 0.1 * a.trace() / N_A * torch.eye(N_A, dtype=torch.float64)
    s = s + 0.1 * s.trace() / N_S * torch.eye(N_S, dtype=torch.float64)
    pre = torch.linalg.solve(s, torch.linalg.solve(a, queries.transpose(1, 2)).transpose(1, 2))
    return train.flatten(1) @ pre.flatten(1).T


def test_fp32_running_sums_keep_kfac_scores_within_1e_5_of_fp64_sums(tmp_path: Path) -> None:
    """1,000 micro-batches of 256 tokens (256 k token rows) into fp32 running sums,
    committed every 50 steps (each commit adds them to the previous commit's fp64 totals
    and restarts them): the K-FAC-preconditioned scores (damping 0.1) are within 1e-5 of
    those from fp64 sums of the same factors (fp64 products, built without the
    accumulator; measured 1.1e-6, the fp32 rounding of each micro-batch's products). The
    same sums kept in fp32 over the whole run are at least 4x further off (measured
    2.2e-5): fp32 rounding grows with the number of additions into one sum, which the
    commits bound (benchmarks/curvature_precision.py: 20,000 micro-batches)."""
    records = synthetic_records(0)
    reference = KroneckerFactors(
        torch.zeros(N_A, N_A, dtype=torch.float64),
        torch.zeros(N_S, N_S, dtype=torch.float64),
        torch.zeros((), dtype=torch.float64),
    )
    committed = CurvatureAccumulator(tmp_path / "committed")
    plain = CurvatureAccumulator(tmp_path / "plain")
    for step, record in enumerate(records):
        grads = record.layers["fc"].grads
        assert isinstance(grads, TokenFactors)
        a, g = grads.a[0].double(), grads.g[0].double()
        reference = reference + KroneckerFactors(a.T @ a, g.T @ g, torch.tensor(TOKENS * 1.0))
        for accumulator in (committed, plain):
            accumulator.on_micro_batch(record)
            accumulator.on_optimizer_step(step, [])
        if (step + 1) % COMMIT_EVERY == 0:
            committed.commit(step + 1)
    assert committed._sums == {} and plain._sums["fc"].a_sum.dtype == torch.float32
    gen = torch.Generator().manual_seed(1)
    train = torch.randn(32, N_S, N_A, generator=gen, dtype=torch.float64)
    queries = torch.randn(8, N_S, N_A, generator=gen, dtype=torch.float64)
    expected = kfac_scores(reference, train, queries)

    def error(accumulator: CurvatureAccumulator) -> float:
        got = kfac_scores(accumulator.factors["fc"], train, queries)
        return ((got - expected).norm() / expected.norm()).item()

    assert committed.factors["fc"].tokens.item() == MICRO_BATCHES * TOKENS
    assert error(committed) <= 1e-5
    assert error(committed) * 4 <= error(plain)


@pytest.mark.parametrize("hard_links", [True, False])
@pytest.mark.parametrize("after_checkpoint", [0, 1])
def test_the_end_of_a_run_checkpointed_at_its_last_step_writes_no_second_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool, after_checkpoint: int
) -> None:
    """A trainer checkpoint after the last micro-batch, then the end of the run (what
    every HF run does with its default save strategy): the final statistics hold exactly
    the bytes of a run that never checkpointed, as the checkpoint's own file under a second
    name (one inode; a copy where the filesystem has no hard links), and nothing is
    written from the sums again. A micro-batch after the checkpoint makes the end write
    its own file, the sums of a run that never checkpointed up to fp32 rounding (the
    checkpoint's fp64 totals plus fp32 running sums, against fp32 sums of every step)."""
    if not hard_links:
        monkeypatch.setattr(os, "link", mock.Mock(side_effect=OSError("no hard links")))
    records = synthetic_records(0, 2 + after_checkpoint)

    def run(root: Path, checkpoint_at: int | None) -> Path:
        accumulator = CurvatureAccumulator(root)
        for step, record in enumerate(records):
            if step == checkpoint_at:
                accumulator.commit(step, "checkpoint")
            accumulator.on_micro_batch(record)
            accumulator.on_optimizer_step(step, [])
        if checkpoint_at == len(records):
            accumulator.commit(len(records), "checkpoint")
        with mock.patch.object(
            statistics, "write_statistics", side_effect=statistics.write_statistics
        ) as writes:
            accumulator.on_end()
        assert writes.call_count == (checkpoint_at != len(records))
        return root / "rank-0"

    plain = run(tmp_path / "plain", None) / CURVATURE_FILE
    folder = run(tmp_path / "checkpointed", 2)
    final, checkpoint = folder / CURVATURE_FILE, folder / "curvature-before-step2.safetensors"
    same_inode = final.stat().st_ino == checkpoint.stat().st_ino
    assert same_inode is (hard_links and after_checkpoint == 0)
    if after_checkpoint == 0:
        assert final.read_bytes() == plain.read_bytes()
    got, expected = load_curvature(folder.parent)["fc"], load_curvature(plain.parent.parent)["fc"]
    assert got.tokens.item() == expected.tokens.item() == len(records) * TOKENS
    torch.testing.assert_close(got.a_sum, expected.a_sum, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.g_sum, expected.g_sum, rtol=1e-6, atol=0)


def test_statistics_files_are_streamed_safetensors_read_back_exactly(tmp_path: Path) -> None:
    """The streamed fp64 writer's files load with safetensors as the tensors given, a rank
    that owns no layer included (metadata only)."""
    gen = torch.Generator().manual_seed(0)
    stats = {
        "x": KroneckerFactors(
            torch.randn(3, 3, generator=gen), torch.randn(5, 5, generator=gen), torch.tensor(7.0)
        ),
        "y.z": KroneckerFactors(
            torch.randn(1, 1, generator=gen), torch.randn(2, 2, generator=gen), torch.tensor(2.0)
        ),
    }
    write_statistics(
        tmp_path / "two.safetensors", {"x": (3, 5), "y.z": (1, 2)}, stats.__getitem__, {"k": "v"}
    )
    loaded = load_file(tmp_path / "two.safetensors")
    assert set(loaded) == {f"{n}::{f}" for n in stats for f in ("A", "S", "tokens")}
    for name, s in stats.items():
        assert torch.equal(loaded[f"{name}::A"], s.a_sum.double())
        assert torch.equal(loaded[f"{name}::S"], s.g_sum.double())
        assert loaded[f"{name}::tokens"].tolist() == [s.tokens.item()]
    write_statistics(tmp_path / "none.safetensors", {}, stats.__getitem__, {})
    assert load_file(tmp_path / "none.safetensors") == {}


# -- ownership -----------------------------------------------------------------------------


def llama_7b_sizes() -> dict[str, int]:
    """Statistics entries (``n_a^2 + n_s^2``) of Llama-2-7B's linear layers, by name."""
    shapes = {"q": (4096, 4096), "k": (4096, 4096), "v": (4096, 4096), "o": (4096, 4096)}
    shapes |= {"gate": (4096, 11008), "up": (4096, 11008), "down": (11008, 4096)}
    return {f"layers.{i}.{n}": a * a + s * s for i in range(32) for n, (a, s) in shapes.items()}


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_owners_are_deterministic_and_balanced(world_size: int) -> None:
    """Every layer gets one owner; the assignment depends only on names and sizes (the same
    on every call, as every rank computes it for itself); the most loaded rank holds at most
    the mean load plus the largest layer (the greedy bound), here within 3% of the mean."""
    sizes = llama_7b_sizes()
    owners = assign_owners(sizes, world_size)
    assert owners == assign_owners(dict(sizes), world_size)
    assert owners.keys() == sizes.keys() and set(owners.values()) == set(range(world_size))
    loads = [sum(sizes[n] for n, r in owners.items() if r == rank) for rank in range(world_size)]
    mean = sum(sizes.values()) / world_size
    assert max(loads) <= mean + max(sizes.values())
    assert max(loads) <= 1.03 * mean
    assert assign_owners(sizes, 1) == dict.fromkeys(sizes, 0)


# -- the plan against what a capture allocates ---------------------------------------------


BATCH = lm_batch(length=16, lengths=(16, 11, 7), seed=1)


def tensor_bytes(grads: PerExampleGrad) -> int:
    """nbytes of every tensor of ``grads`` (a tensor two layers share counts for each)."""
    sizes: list[int] = []
    grads.map_tensors(lambda t: sizes.append(t.nbytes) or t)
    return sum(sizes)


def captured_run(model: nn.Module, tmp: Path) -> tuple[CurvatureAccumulator, MicroBatchRecord]:
    """One micro-batch of ``BATCH`` captured with an accumulator planned for ``model``."""
    plan = plan_capture(model, PlanInputs(LayerSelection("linear")))
    accumulator = CurvatureAccumulator(tmp, shapes=plan.curvature_shapes, excluded=plan.excluded)
    collector = RecordCollector()
    with CaptureEngine(model, layers=LayerSelection("linear"), consumers=[accumulator, collector]):
        summed_loss(model, BATCH).backward()
    return accumulator, collector.records[0]


def test_plan_numbers_equal_the_bytes_a_capture_allocates(tmp_path: Path) -> None:
    """On a tiny fp32 Llama (untied head, 3 x 16 tokens): the plan's statistics are the
    nbytes of the accumulator's running sums, its records those of the micro-batch's
    per-token factors (each layer's input and output gradient; q/k/v share one input,
    which the plan counts for each of the three), and its store bytes per step those of
    each layer's stored form (the smaller of per-token factors and the materialized
    gradient), all from shapes alone, also on the meta device."""
    model = tiny_causal_lm("llama", torch.float32)
    inputs = PlanInputs(LayerSelection("linear"), tokens_per_example=16, examples_per_micro_batch=3)
    plan = plan_capture(model, inputs)
    accumulator, record = captured_run(model, tmp_path)
    sums = accumulator._sums
    assert set(sums) == set(plan.curvature_shapes)
    assert sums["lm_head"].g_sum.shape == (VOCAB,)  # the head's output factor: its diagonal
    assert plan.statistics_bytes() == sum(s.a_sum.nbytes + s.g_sum.nbytes for s in sums.values())
    factors = [r.grads for r in record.layers.values()]
    assert all(isinstance(f, TokenFactors) for f in factors)
    assert plan.records_bytes == sum(tensor_bytes(f) for f in factors)
    stored = [compact(r.grads, keep_tokens=False) for r in record.layers.values()]
    assert {type(s).__name__ for s in stored} == {"TokenFactors", "DenseGrad"}  # both forms
    assert plan.shard_bytes_per_step == sum(tensor_bytes(s) for s in stored)
    with torch.device("meta"):
        meta = tiny_causal_lm("llama", torch.float32)
    meta_plan = plan_capture(meta, inputs)
    assert meta_plan.layers == plan.layers and meta_plan.training_bytes == plan.training_bytes
    params = sum(p.numel() for p in model.parameters())
    assert plan.training_bytes == 4 * params * 4  # fp32 params, grads, two Adam moments


def side_bytes(width: int, form: str) -> int:
    """fp32 bytes of one factor kept dense (``width^2``) or diagonal (``width``)."""
    return 4 * (width * width if form == "dense" else width)


def test_owner_schedule_plans_one_ranks_share_and_the_reduction(tmp_path: Path) -> None:
    """On 4 ranks with every layer's statistics over the budget the schedule is 'owner':
    a rank holds its owned layers (the largest owned share, within one layer of a quarter)
    and one block of a product being reduced (here a whole one: blocks are up to 64 MiB);
    under the budget, 'local' (every layer, reduced at commits). FSDP-sharded training
    divides the training step's bytes by the world size."""
    model = tiny_causal_lm("llama", torch.float32)
    everything = plan_capture(model, PlanInputs(LayerSelection("linear"))).all_bytes
    tight = PlanInputs(
        LayerSelection("linear"), world_size=4, budget_gb=everything * 0.5 / 2**30, sharded=True
    )
    plan = plan_capture(model, tight)
    assert plan.schedule == "owner" and plan.all_bytes == everything
    shares = [plan.owned_bytes(r) for r in range(4)]
    assert sum(shares) == everything
    specs = plan.curvature_shapes.values()
    sides = [side for f in specs for side in ((f.a, f.a_form), (f.s, f.s_form))]
    widest = max(n for n, form in sides if form == "dense")
    largest_layer = max(side_bytes(f.a, f.a_form) + side_bytes(f.s, f.s_form) for f in specs)
    assert max(shares) <= everything / 4 + largest_layer
    # one block: a whole dense product (the head's diagonal is reduced whole, as a vector)
    assert plan.statistics_bytes() == max(shares) + 4 * widest**2
    loose = plan_capture(model, PlanInputs(LayerSelection("linear"), world_size=4))
    assert loose.schedule == "local" and loose.statistics_bytes() == everything
    whole = plan_capture(model, PlanInputs(LayerSelection("linear"), world_size=4))
    assert plan.training_bytes == whole.training_bytes // 4


def test_over_budget_capture_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A capture session whose statistics exceed curvature_budget_gb raises at its start,
    before the store directory exists, with the bytes needed (those a capture allocates)
    and each way out with its own figure: factor projection, the last block alone (half
    the layers), curvature off, a budget just above the need."""
    model = tiny_causal_lm("llama", torch.float32)
    accumulator, _ = captured_run(model, tmp_path / "probe")
    need = sum(s.a_sum.nbytes + s.g_sum.nbytes for s in accumulator._sums.values())
    last_block = sum(
        s.a_sum.nbytes + s.g_sum.nbytes for n, s in accumulator._sums.items() if ".1." in n
    )
    store, budget = tmp_path / "store", 100 * 1024 / 2**30
    settings = CaptureSettings.from_options(
        store_dir=str(store), layers="linear", curvature_budget_gb=budget
    )
    with pytest.raises(CurvatureBudgetError) as error:
        CaptureSession(settings, model=model, normalization=SummedLoss())
    message = str(error.value)
    assert f"need {need / 1024:.1f} KiB per rank" in message
    assert f"over curvature_budget_gb={budget:g}" in message
    assert f"last_n_blocks=1 ({last_block / 1024:.1f} KiB)" in message
    assert "projection='factor' (k_a=k_g=16: " in message and "curvature=False" in message
    hint = float(message.rsplit("curvature_budget_gb=", 1)[1])
    assert need <= hint * 2**30 <= 1.1 * need
    assert not store.exists()
    unlimited = CaptureSettings.from_options(
        store_dir=str(store), layers="linear", curvature_budget_gb=None
    )
    CaptureSession(unlimited, model=model, normalization=SummedLoss()).engine.detach()


# -- the head --------------------------------------------------------------------------------


def session_store(tmp: Path, curvature_head: bool = False) -> StoreReader:
    """One step of a tiny untied Llama's linear layers through a capture session."""
    model = tiny_causal_lm("llama", torch.float32)
    settings = CaptureSettings.from_options(
        store_dir=str(tmp), layers="linear", curvature_head=curvature_head
    )
    session = CaptureSession(settings, model=model, normalization=SummedLoss())
    summed_loss(model, BATCH).backward()
    session.step()
    session.end()
    return StoreReader(tmp)


def test_head_keeps_the_diagonal_of_its_output_factor_by_default(tmp_path: Path) -> None:
    """On an untied model the vocabulary-wide lm_head is captured and keeps the diagonal
    of its output factor (no ``vocab x vocab`` matrix), equal to the diagonal of the
    dense factor ``curvature_head=True`` keeps; its input factor and every other layer's
    statistics are the same either way."""
    default = session_store(tmp_path / "default")
    included = session_store(tmp_path / "head", curvature_head=True)
    assert "lm_head" in default.layer_names
    assert default.layer_names == included.layer_names
    diagonal, dense = load_curvature(default.root), load_curvature(included.root)
    assert set(diagonal) == set(dense)
    assert diagonal["lm_head"].g_sum.shape == (VOCAB,)
    assert dense["lm_head"].g_sum.shape == (VOCAB, VOCAB)
    assert torch.allclose(diagonal["lm_head"].g_sum, dense["lm_head"].g_sum.diagonal(), rtol=1e-6)
    for name, stats in diagonal.items():
        assert torch.equal(stats.a_sum, dense[name].a_sum), name
        if name != "lm_head":
            assert torch.equal(stats.g_sum, dense[name].g_sum), name


def test_an_engine_capture_without_a_plan_keeps_the_head_diagonal_too(tmp_path: Path) -> None:
    """A ``CurvatureAccumulator`` given no plan (the engine-level API) learns the
    vocabulary from the engine and keeps the same statistics as the session's default;
    ``curvature_head=True`` there keeps the dense factor."""
    model = tiny_causal_lm("llama", torch.float32)
    default = session_store(tmp_path / "session")
    for name, head in (("diagonal", False), ("dense", True)):
        folder = tmp_path / name
        accumulator = CurvatureAccumulator(folder, curvature_head=head)
        with CaptureEngine(
            model, layers=LayerSelection("linear"), consumers=[GradientStore(folder), accumulator]
        ) as engine:
            summed_loss(model, BATCH).backward()
            engine.optimizer_step()
            engine.end()
        model.zero_grad(set_to_none=True)
    planned, diagonal = load_curvature(default.root), load_curvature(tmp_path / "diagonal")
    assert set(planned) == set(diagonal)
    for name, stats in planned.items():
        assert torch.allclose(stats.a_sum, diagonal[name].a_sum, rtol=1e-6), name
        assert torch.allclose(stats.g_sum, diagonal[name].g_sum, rtol=1e-6), name
    assert load_curvature(tmp_path / "dense")["lm_head"].g_sum.shape == (VOCAB, VOCAB)


class _OlmoStyleLM(nn.Module):
    """An LM without transformers' API: an embedding, an MLP as wide as the vocabulary,
    and a head in a module named ``lm_head`` (OLMo-core's ``lm_head.w_out``)."""

    def __init__(self, head_name: str = "lm_head") -> None:
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, 8)
        self.mlp = nn.Linear(8, VOCAB)
        self.add_module(head_name, nn.ModuleDict({"w_out": nn.Linear(8, VOCAB)}))


class _Declining(_OlmoStyleLM):
    def get_output_embeddings(self) -> nn.Module:
        raise NotImplementedError


def test_the_head_is_found_by_identity_never_by_width() -> None:
    """transformers' ``get_output_embeddings()`` names the head (untied or tied); without
    it (or where it raises), the linear inside a module named ``lm_head`` as wide as the
    vocabulary; an MLP as wide as the vocabulary elsewhere is never taken for the head."""
    assert head_layers(tiny_causal_lm("llama")) == {"lm_head"}
    assert head_layers(tiny_causal_lm("gpt2")) == {"lm_head"}
    assert head_layers(_OlmoStyleLM()) == {"lm_head.w_out"}
    assert head_layers(_Declining()) == {"lm_head.w_out"}
    assert head_layers(_OlmoStyleLM(head_name="out")) == frozenset()


def test_a_lora_on_the_head_keeps_the_diagonal_and_a_vocabulary_wide_mlp_does_not(
    tmp_path: Path,
) -> None:
    """The head is found by identity (``get_output_embeddings()``), not by width: with
    PEFT LoRA on ``lm_head`` and on an MLP projection exactly as wide as the vocabulary,
    the head's ``lora_B`` keeps the diagonal of its output factor (equal to the dense
    factor's diagonal that ``curvature_head=True`` keeps) and the MLP's ``lora_B`` a dense
    one either way."""
    from peft import LoraConfig, get_peft_model

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=VOCAB,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    factors = {}
    for head in (False, True):
        torch.manual_seed(0)
        model = get_peft_model(
            LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["up_proj", "lm_head"])
        )
        settings = CaptureSettings.from_options(
            store_dir=str(tmp_path / str(head)), layers="lora", curvature_head=head
        )
        session = CaptureSession(settings, model=model, normalization=SummedLoss())
        summed_loss(model, BATCH).backward()
        session.step()
        session.end()
        factors[head] = load_curvature(tmp_path / str(head))
    head_b = "base_model.model.lm_head.lora_B.default"
    mlp_b = "base_model.model.model.layers.0.mlp.up_proj.lora_B.default"
    assert factors[False][head_b].g_sum.shape == (VOCAB,)
    assert factors[True][head_b].g_sum.shape == (VOCAB, VOCAB)
    diagonal = factors[True][head_b].g_sum.diagonal()
    assert torch.allclose(factors[False][head_b].g_sum, diagonal, rtol=1e-6)
    for head in (False, True):
        assert factors[head][mlp_b].g_sum.shape == (VOCAB, VOCAB)


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_kfac_scores_a_default_store_of_an_untied_model(tmp_path: Path, method: str) -> None:
    """K-FAC/EK-FAC score the default store of an untied model, head included (its
    diagonal output factor), without a recapture; the scores' agreement with the dense
    reference is ``tests/test_curvature_all_layers.py``'s."""
    store = session_store(tmp_path)
    queries = capture_store(
        tiny_causal_lm("llama", torch.float32),
        [BATCH],
        tmp_path / "q",
        LayerSelection("linear"),
        curvature=False,
    )
    scores = method_by_name(method).score(store, queries).values
    assert scores.shape == (store.num_examples, queries.num_examples)
    assert torch.isfinite(scores).all()


def test_stores_written_before_ownership_still_read_as_the_sum_of_their_ranks(
    tmp_path: Path,
) -> None:
    """A store of the earlier layout (every rank's file holds every layer's fp64 partial
    sums, no metadata) reads as the sum over its ranks, as it did."""
    gen = torch.Generator().manual_seed(0)
    parts = []
    for rank in (0, 1):
        stats = {
            "fc": KroneckerFactors(
                torch.randn(3, 3, generator=gen, dtype=torch.float64),
                torch.randn(2, 2, generator=gen, dtype=torch.float64),
                torch.tensor(5.0 + rank, dtype=torch.float64),
            )
        }
        parts.append(stats["fc"])
        (tmp_path / f"rank-{rank}").mkdir()
        (tmp_path / f"rank-{rank}" / "index.json").write_text('{"shards": []}')
        save_file(
            {
                "fc::A": stats["fc"].a_sum,
                "fc::S": stats["fc"].g_sum,
                "fc::tokens": stats["fc"].tokens.reshape(1),
            },
            tmp_path / f"rank-{rank}" / "curvature.safetensors",
        )
    loaded = load_curvature(tmp_path)["fc"]
    assert torch.equal(loaded.a_sum, parts[0].a_sum + parts[1].a_sum)
    assert torch.equal(loaded.g_sum, parts[0].g_sum + parts[1].g_sum)
    assert loaded.tokens.item() == 11.0
    (tmp_path / "rank-1" / "curvature.safetensors").unlink()
    with pytest.raises(StoreError, match="incomplete"):
        load_curvature(tmp_path)
