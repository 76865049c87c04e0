"""Per-example gradient representations, routed operations and projections."""

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.embedding import EmbeddingFactors
from tda_plugins.grads.ops import (
    QueryGradients,
    cross_gram,
    dots_with,
    per_token_scores,
    rotated,
    rotated_grads,
    rows_sums,
    sq_norms,
)
from tda_plugins.grads.projection import ProjectionConfig, Projector, RandomMap
from tda_plugins.grads.routing import Route, choose_route
from tda_plugins.grads.tokens import TokenFactors

__all__ = [
    "DenseGrad",
    "EmbeddingFactors",
    "PerExampleGrad",
    "ProjectionConfig",
    "Projector",
    "QueryGradients",
    "RandomMap",
    "Route",
    "TokenFactors",
    "choose_route",
    "cross_gram",
    "dots_with",
    "per_token_scores",
    "rotated",
    "rotated_grads",
    "rows_sums",
    "sq_norms",
]
