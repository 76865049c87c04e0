"""LESS: cosine between Adam-preconditioned training gradients and plain query gradients."""

from __future__ import annotations

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.methods.base import AttributionMethod, ScoreRun, register_method
from tda_plugins.precondition.adam import AdamUpdate
from tda_plugins.store.reader import StoreReader


@register_method("less")
class LESS(AttributionMethod):
    """Training side: the Adam update each example would cause (saved optimizer state)."""

    normalize = True
    scores_tied_weights = False

    def refuse(self, store: StoreReader, run: ScoreRun) -> None:
        if run.ranks.device.type != "cpu":
            raise ValueError(
                f"LESS scores on the CPU only (its Adam state is read there), not on "
                f"{run.ranks.device}; use --device cpu"
            )

    def prepare(
        self,
        store: StoreReader,
        queries: StoreReader,
        run: ScoreRun | None = None,
        *,
        per_group: bool = False,
    ) -> None:
        super().prepare(store, queries, run, per_group=per_group)
        self.adam = AdamUpdate(store.root)

    def train_side(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        return self.adam(layer, grads)
