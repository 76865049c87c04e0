"""Build gradient stores from tiny models in tests: each example's own summed loss."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tda_plugins import (
    CaptureConsumer,
    CaptureEngine,
    LayerSelection,
    ProjectionConfig,
    causal_lm_example_losses,
)
from tda_plugins.methods import Scores
from tda_plugins.precondition import CurvatureAccumulator
from tda_plugins.store import GradientStore, StoreReader

LossFn = Callable[[nn.Module, Mapping[str, Tensor]], Tensor]
OracleFn = Callable[[nn.Module, Mapping[str, Tensor], list[str]], dict[str, Tensor]]


def summed_loss(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """Sum over the batch of each example's summed next-token loss."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return causal_lm_example_losses(model(**inputs).logits, batch["labels"]).sum()


def label_tokens(batch: Mapping[str, Tensor]) -> int:
    """Number of predicted tokens (shifted labels that are not -100): a mean loss's divisor."""
    return int((batch["labels"][:, 1:] != -100).sum())


class ManualScale:
    """A loss normalization whose factor the test sets before each forward call."""

    def __init__(self) -> None:
        self.value = 1.0

    def observe(self, kwargs: dict[str, Any], output: Any) -> Callable[[], float]:
        value = self.value
        return lambda: value


def capture_store(
    model: nn.Module,
    batches: Iterable[Mapping[str, Tensor]],
    path: str | Path,
    layers: LayerSelection | None = None,
    projection: ProjectionConfig | None = None,
    keep_tokens: bool = False,
    curvature: bool = True,
    loss_fn: LossFn = summed_loss,
    mean_loss: bool = False,
    rank: int = 0,
    append: bool = False,
    curvature_head: bool = False,
) -> StoreReader:
    """One committed step per batch, K-FAC statistics included (``curvature_head``: the LM
    head's output factor dense, not its diagonal); ``.grad`` is cleared.

    ``loss_fn(model, batch)`` is the batch's summed loss. With ``mean_loss`` each batch's
    loss is divided by its :func:`label_tokens` (a trainer's mean loss) and the engine is
    told that count as the loss scale. ``rank`` writes the capture as that rank's part;
    ``append`` adds it to the steps a store already holds.
    """
    store = GradientStore(path, rank=rank, keep_tokens=keep_tokens, append=append)
    consumers: list[CaptureConsumer] = [store]
    if curvature:
        consumers.append(CurvatureAccumulator(path, rank=rank, curvature_head=curvature_head))
    # appending to a store continues its steps
    run_captured(model, batches, consumers, layers, projection, loss_fn, mean_loss, store.next_step)
    return StoreReader(path)


def run_captured(
    model: nn.Module,
    batches: Iterable[Mapping[str, Tensor]],
    consumers: list[CaptureConsumer],
    layers: LayerSelection | None = None,
    projection: ProjectionConfig | None = None,
    loss_fn: LossFn = summed_loss,
    mean_loss: bool = False,
    first_step: int = 0,
) -> None:
    """One committed step per batch into ``consumers``; ``.grad`` is cleared after.

    ``loss_fn(model, batch)`` is the batch's summed loss. With ``mean_loss`` each batch's
    loss is divided by its :func:`label_tokens` (a trainer's mean loss) and the engine is
    told that count as the loss scale.
    """
    normalization = ManualScale()
    with CaptureEngine(
        model,
        layers=layers,
        projection=projection,
        consumers=consumers,
        normalization=normalization,
    ) as engine:
        engine.resume_at_step(first_step)
        for batch in batches:
            scale = label_tokens(batch) if mean_loss else 1
            normalization.value = scale
            (loss_fn(model, batch) / scale).backward()
            engine.optimizer_step()
        engine.end()
    model.zero_grad(set_to_none=True)


def flat_oracle_grads(
    model: nn.Module,
    batches: Iterable[Mapping[str, Tensor]],
    names: list[str],
    oracle: OracleFn | None = None,
) -> torch.Tensor:
    """``(N, D)`` per-example gradients of the parameters ``names``, concatenated in that
    order, from ``oracle`` (default: the loop oracle; ``func_oracle`` needs right padding)."""
    from tests.oracle import loop_oracle

    oracle = oracle or loop_oracle
    rows = []
    for batch in batches:
        grads = oracle(model, batch, names)
        rows.append(torch.cat([grads[n].flatten(1) for n in names], dim=1))
    return torch.cat(rows)


def linear_parameter_names(model: nn.Module) -> list[str]:
    """Trainable parameters owned only by linear layers (``nn.Linear``, transformers
    ``Conv1D``), in model order: what ``LayerSelection(kind="linear")`` promises, worked out
    without the engine. A weight tied to another module (GPT-2's ``lm_head`` and ``wte``)
    is not among them."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)

    def linear(module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"

    return [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and all(linear(m) for m in owners[id(p)])
    ]


def store_parameter_names(model: nn.Module, store: StoreReader) -> list[str]:
    """Parameters of the modules a store captured, named as in ``model.named_parameters()``."""
    return [
        f"{layer}.{local}"
        for layer in store.layer_names
        for local, _ in model.get_submodule(layer).named_parameters(recurse=False)
    ]


def scores_by_id(scores: Scores, train_ids: Tensor, query_ids: Tensor) -> Tensor:
    """``scores.values`` with rows in ``train_ids`` and columns in ``query_ids`` order; fails
    unless the scores hold exactly those ids."""
    rows = {int(i): r for r, i in enumerate(scores.train_ids.tolist())}
    cols = {int(i): c for c, i in enumerate(scores.query_ids.tolist())}
    assert sorted(rows) == sorted(train_ids.tolist()), "scores hold other training ids"
    assert sorted(cols) == sorted(query_ids.tolist()), "scores hold other query ids"
    index_rows = torch.tensor([rows[i] for i in train_ids.tolist()])
    index_cols = torch.tensor([cols[i] for i in query_ids.tolist()])
    return scores.values[index_rows][:, index_cols]


def rel_error(got: Tensor, ref: Tensor) -> float:
    """``||got - ref|| / ||ref||`` (Frobenius), in fp64."""
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def made_stores(monkeypatch: Any, module: Any) -> list[GradientStore]:
    """Every :class:`GradientStore` that ``module`` makes from now on, in order: its name
    there is replaced (through ``monkeypatch``) by a subclass that records each one."""
    made: list[GradientStore] = []

    class Recording(GradientStore):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(module, "GradientStore", Recording)
    return made
