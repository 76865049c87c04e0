"""Second-order methods: K-FAC, EK-FAC and LoGra (K-FAC on factor-projected gradients)."""

from __future__ import annotations

from tda_plugins.methods.base import AttributionMethod, ScoreRun, register_method
from tda_plugins.store.layout import StoreError
from tda_plugins.store.reader import StoreReader

#: Why the curvature methods take no parameter groups (docs/design.md section 7.10).
_WHOLE_LAYERS = (
    "its Kronecker factors hold every parameter of a layer (the bias is the last row and "
    "column of the input factor A), so leaving one out is another curvature, not fewer "
    "terms of the dot, and the preconditioner already weighs each layer by its inverse "
    "curvature"
)


@register_method("kfac")
class KFAC(AttributionMethod):
    """``<(S + l_S)^{-1} G_q (A + l_A)^{-1}, G_z>`` per layer (damping relative, default 0.1)."""

    preconditioner_name = "kfac"
    no_parameter_groups = _WHOLE_LAYERS


@register_method("ekfac")
class EKFAC(AttributionMethod):
    """EK-FAC: the K-FAC eigenbasis with eigenvalues corrected on the stored gradients."""

    preconditioner_name = "ekfac"
    no_parameter_groups = _WHOLE_LAYERS


@register_method("logra")
class LoGra(KFAC):
    """LoGra: factor projection in the hook, then K-FAC on the projected factors."""

    def refuse(self, store: StoreReader, run: ScoreRun) -> None:
        projection = store.config.projection
        if projection is None or projection.kind != "factor":
            raise StoreError(
                f"LoGra needs a store captured with factor projection, but {store.root} has "
                f"projection={projection}; recapture with --projection factor, or use kfac"
            )
