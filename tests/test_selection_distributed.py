"""Data selection under data parallelism equals one process on the same global batch.

Two torchrun launches (gloo, CPU, 2 ranks), each covering several claims:

1. transformers (``tests/selection_ddp_worker.py``): a real ``Trainer`` under DDP, and the
   callback's trainer events driven by hand around a ``fully_shard``-ed (FSDP2) tiny
   Llama (accelerate on CPU turns FSDP2 into DDP, so the ``Trainer`` cannot run it).
2. OLMo-core (``tests/olmo_core_selection_worker.py``): ``dp_config`` DDP, FSDP and HSDP.

For every step of every run: both ranks record the same global outcome; the dropped set
is the one a one-process selection drops on the same global batch at the same weights (a
``DataSelector`` run over the union of both ranks' micro-batches; for OLMo-core a whole
one-process ``Trainer`` run on the same data); and ``.grad`` after the selection (on
every rank, its shards gathered) equals a fresh fp64 backward over the kept examples of
the whole global batch, normalized by their label tokens (no engine involved).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from olmo_core.nn.transformer import Transformer
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from transformers import TrainerControl, TrainerState

from tda_plugins import CaptureEngine, LayerSelection
from tda_plugins.data_selection import DataSelector, rule_by_name
from tda_plugins.data_selection.target import target_gradient
from tda_plugins.integrations.transformers import DataSelectionCallback, pad_examples
from tda_plugins.integrations.transformers.selection import causal_lm_token_counts
from tda_plugins.session.batch import causal_lm_losses
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tests.launch import torchrun
from tests.models import tiny_causal_lm
from tests.olmo_core_dist_worker import MODEL, STEPS, WORLD, write_tokens
from tests.olmo_core_selection_worker import MODES, train
from tests.oracle import max_rel_error
from tests.selection_ddp_worker import FORCED, FRACTION, target_rows
from tests.selection_helpers import (
    PINNED,
    SelectionAudit,
    StepAudit,
    assert_trainer_grads_match_fresh,
    example_losses,
    label_counts,
)
from tests.stores import ManualScale
from tests.trainers import FP32_TOL, training_args

# -- transformers --------------------------------------------------------------------------


def one_process_dropped(audit: StepAudit) -> tuple[list[int], list[int]]:
    """The ids and dropped ids of one process's selection over ``audit``'s micro-batches
    (every rank's, in rank order) at its weights: the fp32 model, the target pool of the
    run, the loss over the window's label tokens."""
    model = tiny_causal_lm("llama", torch.float32)
    model.load_state_dict(audit.weights)
    tokens = float(sum(int(label_counts(b).sum()) for b in audit.micro_batches))
    normalization = ManualScale()
    normalization.value = tokens
    with CaptureEngine(
        model,
        layers=LayerSelection("all"),
        normalization=normalization,
    ) as engine:
        selector = DataSelector(
            engine.captured_layers,
            rule=rule_by_name("bottom_fraction", fraction=FRACTION),
            token_counts=causal_lm_token_counts,
        )
        engine.add_consumer(selector)
        with engine.paused():
            target = pad_examples(target_rows())
            layers = engine.captured_layers
            selector.set_target(target_gradient(model, layers, target, causal_lm_losses))
        for batch in audit.micro_batches:
            (example_losses(model, batch).sum() / tokens).backward()
        engine.optimizer_step()
    (outcome,) = selector.history
    return outcome.example_ids.tolist(), outcome.summary()["dropped_ids"]


def merged_ranks(folder: Path) -> tuple[dict[int, StepAudit], list[dict[str, Any]]]:
    """Both ranks' audits as one global batch per step (rank 0's micro-batches first), after
    checking that the ranks agree on ``.grad`` and on the selection's outcome."""
    ranks = [SelectionAudit.load(folder / f"rank{r}") for r in range(WORLD)]
    histories = [
        json.loads((folder / f"rank{r}" / "history.json").read_text()) for r in range(WORLD)
    ]
    assert histories[0] == histories[1], "the ranks disagree on the global outcome"
    merged = {}
    for step in range(STEPS):
        zero, one = ranks[0].steps[step], ranks[1].steps[step]
        differ = [n for n in zero.grads if not torch.equal(zero.grads[n], one.grads[n])]
        assert not differ, f"step {step}: ranks disagree on .grad of {differ[:3]}"
        merged[step] = StepAudit(
            zero.weights,
            zero.micro_batches + one.micro_batches,
            zero.num_items + one.num_items,
            grads=zero.grads,
        )
    return merged, [histories[0][str(step)] for step in range(STEPS)]


def assert_same_as_one_process(merged: dict[int, StepAudit], history: list[dict]) -> None:
    dropped = {}
    for step, audit in merged.items():
        ids, expected = one_process_dropped(audit)
        entry = history[step]
        assert entry["dropped_ids"] == expected, f"step {step}: dropped {entry['dropped_ids']}"
        assert len(expected) == len(ids) // 2 == entry["dropped"] == entry["kept"]
        dropped[step] = set(expected)
    check = assert_trainer_grads_match_fresh(
        merged, dropped, lambda: tiny_causal_lm("llama", torch.float64), math.inf, FP32_TOL
    )
    assert check.steps == STEPS


@pytest.mark.slow
@pytest.mark.multiprocess
def test_transformers_ddp_and_fsdp2_select_what_one_process_selects(tmp_path: Path) -> None:
    """DDP ``Trainer`` and a ``fully_shard``-ed model driven through the callback's events:
    each rank's ``.grad`` after selection equals the fresh backward over the kept examples
    of the global batch, the dropped set equals one process's on that batch, and the
    JSONL log (written by rank 0 alone) holds one line per step with the global outcome.
    Under FSDP both correction routes are exact (forced at steps 1 and 2; the cost
    model's choice at step 0), the memory the selection holds at once stays within one
    layer's size (the cost model's routes), and ``max_grad_norm`` is restored."""
    torchrun("selection_ddp_worker.py", tmp_path)
    for mode in ("ddp", "fsdp"):
        merged, history = merged_ranks(tmp_path / mode)
        assert_same_as_one_process(merged, history)
    lines = (tmp_path / "ddp" / "trainer" / "selection.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == merged_ranks(tmp_path / "ddp")[1]

    routes = json.loads((tmp_path / "fsdp" / "rank0" / "routes.json").read_text())
    for step, forced in FORCED.items():
        assert set(routes[str(step)].values()) == {forced}
    assert set(routes["0"]) == set(routes["1"]) and set(routes["0"].values()) <= set(
        FORCED.values()
    )
    memory = json.loads((tmp_path / "fsdp" / "rank0" / "memory.json").read_text())
    model = tiny_causal_lm("llama", torch.float32)
    largest = max(m.weight.numel() * 4 for m in model.modules() if hasattr(m, "weight"))
    assert 0 < memory["target_peak_bytes"] <= largest  # one layer's target at a time
    # the cost model gathers a layer only when that moves fewer bytes than reducing it
    assert 0 < memory["surgery_peak_bytes"]["0"] <= largest
    assert memory["max_grad_norm_restored"]


# -- OLMo-core -----------------------------------------------------------------------------


def twin(params: dict[str, torch.Tensor]) -> Transformer:
    model = MODEL.build(init_device="cpu").double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def fresh_kept(model: Transformer, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradient of ``sum_{kept} L_i / N_kept`` over the kept instances ``input_ids``."""
    logits = model(input_ids)[:, :-1]
    loss = F.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="sum")
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss / input_ids[:, 1:].numel(), list(model.parameters()))
    return dict(zip(names, grads, strict=True))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_olmo_core_ddp_fsdp_hsdp_select_what_one_process_selects(tmp_path: Path) -> None:
    """OLMo-core under ``dp_config`` DDP, FSDP and HSDP: every rank logs the global
    outcome, which drops exactly the instances the one-process run drops at each step,
    and every parameter's ``.grad`` after selection (shards gathered) is the fresh
    backward over the kept instances of the whole global batch."""
    write_tokens(tmp_path)
    torchrun("olmo_core_selection_worker.py", tmp_path)
    single = train(tmp_path, "single")
    assert not single["sharded"]
    for mode in MODES:
        ranks = [torch.load(tmp_path / mode / f"rank{r}.pt") for r in range(WORLD)]
        assert ranks[0]["history"] == ranks[1]["history"]
        assert ranks[0]["sharded"] == (mode != "ddp")
        for step in range(STEPS):
            entry, reference = ranks[0]["history"][step], single["history"][step]
            assert sorted(entry["dropped_ids"]) == sorted(reference["dropped_ids"]), mode
            batch = torch.cat([ranks[0]["indices"][step], ranks[1]["indices"][step]])
            assert sorted(batch.tolist()) == sorted(single["indices"][step].tolist())
            ids = torch.cat([ranks[0]["input_ids"][step], ranks[1]["input_ids"][step]])
            kept = torch.tensor([int(i) not in entry["dropped_ids"] for i in batch])
            assert int(kept.sum()) == 2
            fresh = fresh_kept(twin(ranks[0]["params"][step]), ids[kept])
            for rank in ranks:
                error = max_rel_error(rank["grads"][step], fresh)
                assert error <= FP32_TOL, f"{mode} step {step}: .grad {error:.2e} off"


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}, "MixedPrecisionPolicy"),
        ({"shard_placement_fn": lambda p: Shard(1) if p.dim() == 2 else None}, "laid out as"),
    ],
    ids=["mixed-precision", "shard-dim-1"],
)
def test_sharded_layouts_it_cannot_edit_exactly_are_refused_before_step_0(
    tmp_path: Path, options: dict[str, Any], reason: str
) -> None:
    """``fully_shard`` with mixed-precision parameters, or sharding a weight on dim 1: the
    callback refuses at ``on_train_begin`` with the reason and the way out, and leaves no
    hook of its own on the model (a one-rank process group, so the test runs in one process)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = tiny_causal_lm("llama", torch.float32)
        fully_shard(model, **options)
        selection = DataSelectionCallback(target_rows(), layers="all", **PINNED)
        hooks = {
            n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()
        }
        args = training_args(tmp_path / "out", max_grad_norm=1.0)
        with pytest.raises(UnsupportedTrainingSetup, match=reason) as info:
            selection.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
        assert "; " in str(info.value)  # the reason, then the way out
        assert args.max_grad_norm == 1.0
        after = {
            n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()
        }
        assert after == hooks, "the refused callback left hooks on the model"
    finally:
        dist.destroy_process_group()
