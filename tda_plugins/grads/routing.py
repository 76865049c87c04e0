"""Cost routing: pick the cheaper of the factorized and materialized computations.

Every route gives the same number up to rounding (docs/design.md section 3); the router only
chooses by a FLOP model, per layer and per operation. The cost formulas live with each
gradient representation (one module each, on the interface of ``grads/base.py``); this
module holds the decision rule so a test can pin it.
"""

from __future__ import annotations

from enum import Enum


class Route(Enum):
    """How an operation on per-example gradients is computed."""

    FACTORIZED = "factorized"
    MATERIALIZED = "materialized"


def choose_route(costs: dict[Route, float], forced: Route | None = None) -> Route:
    """Return ``forced`` when given, else the route with the lowest FLOP estimate.

    Ties go to the factorized route (it never builds the ``N_o x N_i`` matrix).
    """
    if forced is not None:
        if forced not in costs:
            raise ValueError(
                f"route {forced.value!r} is not available for this operation "
                f"(available: {sorted(r.value for r in costs)}); pass route=None to let the "
                "cost model choose"
            )
        return forced
    return min(costs, key=lambda r: (costs[r], r is not Route.FACTORIZED))
