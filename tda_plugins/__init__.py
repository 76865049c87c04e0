"""tda-plugins: training-data attribution from the training run's own backward pass.

The engine (``tda_plugins.capture``) imports torch only; framework integrations live in
``tda_plugins.integrations``.
"""

from tda_plugins.api import causal_lm_example_losses, per_example_gradients
from tda_plugins.capture import (
    CaptureConsumer,
    CaptureEngine,
    LayerSelection,
    LayerSelectionError,
    MicroBatchRecord,
    RecordCollector,
)
from tda_plugins.grads import ProjectionConfig, Route, cross_gram, per_token_scores, sq_norms
from tda_plugins.methods import Scores, attribute
from tda_plugins.queries import QueryCollector, score_record

__version__ = "0.1.0"

__all__ = [
    "CaptureConsumer",
    "CaptureEngine",
    "LayerSelection",
    "LayerSelectionError",
    "MicroBatchRecord",
    "ProjectionConfig",
    "QueryCollector",
    "RecordCollector",
    "Route",
    "Scores",
    "__version__",
    "attribute",
    "causal_lm_example_losses",
    "cross_gram",
    "per_example_gradients",
    "per_token_scores",
    "score_record",
    "sq_norms",
]
