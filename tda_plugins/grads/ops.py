"""Operations on per-example gradients, routed per layer by the cost model.

All results are in the accumulation dtype (fp32, or fp64 for fp64 captures). Each
function takes an optional ``route`` to force a computation path (tests and benchmarks
use it); by default :func:`~tda_plugins.grads.routing.choose_route` picks the cheaper.
"""

from __future__ import annotations

from torch import Tensor

from tda_plugins.grads.factors import PerExampleGrad
from tda_plugins.grads.routing import Route, choose_route


def cross_gram(train: PerExampleGrad, query: PerExampleGrad, route: Route | None = None) -> Tensor:
    """``(B1, B2)`` matrix of inner products ``<dW_i, dW_j>`` (the "ghost dot").

    Cost: factorized ``~ B1 B2 T1 T2 (N_i + N_o)``; materialized
    ``~ (B1 T1 + B2 T2) N_i N_o + B1 B2 N_i N_o`` (DESIGN.md section 3).
    """
    chosen = choose_route(train.gram_costs(query), route)
    if chosen is Route.FACTORIZED:
        return train.gram_factorized(query)
    return train.gram_materialized(query)


def sq_norms(grads: PerExampleGrad, route: Route | None = None) -> Tensor:
    """``(B,)`` squared Frobenius norms of the per-example gradients."""
    chosen = choose_route(grads.sq_norm_costs(), route)
    if chosen is Route.FACTORIZED:
        return grads.sq_norms_factorized()
    return grads.sq_norms_materialized()


def per_token_scores(
    train: PerExampleGrad, query: PerExampleGrad, route: Route | None = None
) -> Tensor:
    """``(B1, B2, T1)`` score of each train token's contribution against each query.

    Summed over the token axis this equals :func:`cross_gram`.
    """
    chosen = choose_route(train.token_score_costs(query), route)
    if chosen is Route.FACTORIZED:
        return train.token_scores_factorized(query)
    return train.token_scores_materialized(query)
