"""What K-FAC and EK-FAC share to fit: the store's statistics, checked and read one layer at
a time by the rank that factorizes it, the tied units, and a memo for factors equal across
consecutive layers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.parallel.ranks import LayerTensors, Ranks
from tda_plugins.precondition.fit_cache import FitCache
from tda_plugins.precondition.forms import NOT_FACTORED
from tda_plugins.precondition.sides import Sides
from tda_plugins.precondition.snapshots import StatisticsSet, read_set
from tda_plugins.store.layout import StoreError
from tda_plugins.store.reader import StoreReader

#: Stands for an absent tensor among a layer's shared tensors (a rank exchange carries
#: tensors only): a norm scale's row side, a diagonal factor's basis.
ABSENT = torch.empty(0, dtype=torch.float64)


def present(t: Tensor) -> Tensor | None:
    """``t``, or ``None`` for an :data:`ABSENT` one."""
    return None if t.numel() == 0 else t


def statistics_set(store: StoreReader) -> StatisticsSet:
    """The store's K-FAC statistics, refusing a captured layer that has none, with the
    capture's reason when it left the layer out (the vocabulary-wide head, a tied weight
    it cannot combine, a dense projection)."""
    found = read_set(store.root)
    present_layers = set(found.layer_names())
    missing = [n for n in store.layer_names if n not in present_layers]
    if not missing:
        return found
    left_out = {n: why for n, why in found.excluded.items() if n in missing}
    name = missing[0]
    if name in left_out and left_out[name] == NOT_FACTORED:
        raise StoreError(
            f"no K-FAC statistics for {name!r} ({NOT_FACTORED}): K-FAC, EK-FAC and LoGra need "
            "factors; capture without projection or with projection='factor', or score this "
            "store with graddot/gradcos/tracin"
        )
    if name in left_out:
        raise StoreError(
            f"no K-FAC statistics for {name!r} ({left_out[name]}); K-FAC, EK-FAC and LoGra "
            f"need every stored layer's: recapture as that says, or without that layer "
            f"(exclude={name!r}), or score this store with graddot/gradcos/tracin"
        )
    raise StoreError(
        f"no K-FAC statistics for {missing[:3]}{'...' if len(missing) > 3 else ''}: the "
        "capture kept none for them (a capture of an earlier version keeps factors for "
        "linear/LoRA layers only); recapture with curvature on, or capture without those "
        "layers (LayerSelection kind='linear' or 'lora')"
    )


def units_by_layer(found: StatisticsSet, store: StoreReader) -> dict[str, tuple[str, ...]]:
    """Layer -> the tied unit it belongs to (layers sharing one weight, preconditioned as
    one), for every stored layer in one."""
    out = {}
    for unit in found.units:
        if not set(unit) <= set(store.layer_names):
            raise StoreError(
                f"the K-FAC statistics tie {list(unit)}, but the store holds "
                f"{[n for n in unit if n in store.layer_names]} of them; capture both uses"
            )
        out.update(dict.fromkeys(unit, unit))
    return out


@dataclass
class FittedLayers:
    """Every layer's fitted tensors, each computed by the rank that owns the layer and
    shared with all (see :func:`fit_layers`).

    Attributes:
        shared: layer -> its fitted tensors; for a use of a tied weight, its raw
            ``(row, column)`` statistics instead (``ABSENT`` for no row side), to be
            combined with the other uses' once all are shared.
        units: layer -> the tied unit it belongs to, for every layer in one.
    """

    shared: dict[str, LayerTensors]
    units: dict[str, tuple[str, ...]]

    def untied(self) -> dict[str, LayerTensors]:
        """The fitted tensors of the layers in no tied unit."""
        return {n: t for n, t in self.shared.items() if n not in self.units}

    def tied_uses(self, unit: tuple[str, ...]) -> list[Sides]:
        """The raw statistics of each use of one tied unit."""
        return [Sides(present(self.shared[n][0]), self.shared[n][1]) for n in unit]


def fit_layers(
    store: StoreReader,
    ranks: Ranks,
    fit: Callable[[Sides], LayerTensors],
    kind: str,
    progress: bool = False,
    what: str = "factorizations",
) -> FittedLayers:
    """Read each captured layer's K-FAC statistics on the rank that owns it, ``fit`` those
    of the untied layers, and share every result with all ranks (a collective when they
    are several). ``kind`` names what ``fit`` computes, everything it depends on beyond
    the statistics and the store's dtype included (a damping): the layers fitted before on
    the same statistics are read from the store's fit cache instead
    (:mod:`~tda_plugins.precondition.fit_cache`), and what is fitted here is kept there.
    ``progress``: a bar named ``what`` on rank 0 over its own layers."""
    found = statistics_set(store)
    units = units_by_layer(found, store)
    cache = FitCache(store, found, ranks, kind)
    cached = cache.load()
    names = store.layer_names
    owned = [n for i, n in enumerate(names) if ranks.owns(i, len(names))]
    local: dict[str, LayerTensors] = {}
    fitted: dict[str, LayerTensors] = {}
    with _FitBar(found, owned, units, cached, progress and ranks.rank == 0, what) as bar:
        for name in owned:
            if name in cached and name not in units:
                local[name] = fitted[name] = cached[name]
                continue
            # read when reached and released once fitted: one layer's fp64 factors in
            # memory at a time, beside the factorizations kept
            sides = Sides.of(found.load([name])[name])
            if name in units:  # combined with the other uses once all are shared
                local[name] = (ABSENT if sides.row is None else sides.row, sides.col)
            else:
                local[name] = fitted[name] = fit(sides)
            bar.done(name)
    if fitted.keys() != cached.keys():
        cache.save(fitted)
    return FittedLayers(ranks.share(local, names), units)


class _FitBar:
    """The progress of one rank's factorizations, each layer counted by its work: the sum
    of ``n^3`` over its dense factors (an eigendecomposition's or an inverse's cost), so
    that the time left is told right when a few wide factors (an MLP's, a LoRA ``B``'s
    output side) take most of it. Layers read from the fit cache count for nothing."""

    def __init__(
        self,
        found: StatisticsSet,
        owned: list[str],
        units: dict[str, tuple[str, ...]],
        cached: Mapping[str, LayerTensors],
        shown: bool,
        what: str,
    ):
        owned = [n for n in owned if n not in units and n not in cached]
        sizes = found.factor_sizes() if shown and owned else {}
        self.work = {n: sum(k**3 for k in sizes.get(n, [])) for n in owned}
        self.count, self.layers = 0, len(owned)
        self.bar = tqdm(
            total=sum(self.work.values()) or 1,
            desc=what,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]",
            disable=not shown or not owned,
            leave=False,
        )

    def done(self, name: str) -> None:
        """``name``'s fit is done (a layer of a tied unit counts for nothing)."""
        if name in self.work:
            self.count += 1
            self.bar.set_postfix_str(f"{self.count}/{self.layers} layers", refresh=False)
            self.bar.update(self.work[name])

    def __enter__(self) -> _FitBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


class SharedInput:
    """Memoizes the factorization of a column factor across consecutive layers that have
    it equal (q/k/v, gate/up: fed by one input, captured in model order, so adjacent).
    Only the last factor is kept, so that the statistics of the layers already factorized
    can be freed; the other factors differ from layer to layer."""

    def __init__(self, factorize: Callable[[Tensor], Any]):
        self.factorize = factorize
        self.last: tuple[Tensor, Any] | None = None

    def __call__(self, x: Tensor) -> Any:
        if self.last is not None and self.last[0].shape == x.shape and torch.equal(self.last[0], x):
            return self.last[1]
        result = self.factorize(x)
        self.last = (x, result)
        return result


def check_shape(grads: PerExampleGrad, shape: tuple[int, int], layer: str) -> None:
    """Refuse gradients whose size is not the ``(R, C)`` the statistics describe."""
    if grads.dim != shape[0] * shape[1]:
        raise StoreError(
            f"gradients of {layer} have {grads.dim} entries but the store's "
            f"K-FAC factors describe {shape[0]} x {shape[1]}; capture both with one config"
        )
