"""LESS: cosine between Adam-preconditioned training gradients and plain query gradients."""

from __future__ import annotations

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.methods.base import AttributionMethod, register_method
from tda_plugins.parallel.ranks import Ranks
from tda_plugins.precondition.adam import AdamUpdate
from tda_plugins.store.reader import StoreReader


@register_method("less")
class LESS(AttributionMethod):
    """Training side: the Adam update each example would cause (saved optimizer state)."""

    normalize = True
    scores_tied_weights = False

    def prepare(
        self,
        store: StoreReader,
        queries: StoreReader,
        progress: bool = False,
        *,
        allow_mismatch: bool = False,
        ranks: Ranks | None = None,
    ) -> None:
        if ranks is not None and ranks.device.type != "cpu":
            raise ValueError(
                f"LESS scores on the CPU only (its Adam state is read there), not on "
                f"{ranks.device}; use --device cpu"
            )
        super().prepare(store, queries, progress, allow_mismatch=allow_mismatch, ranks=ranks)
        self.adam = AdamUpdate(store.root)

    def train_side(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        return self.adam(layer, grads)
