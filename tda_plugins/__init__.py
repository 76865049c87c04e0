"""tda-plugins: training-data attribution from the training run's own backward pass.

    from tda_plugins import GradientCaptureCallback, attribute, capture_examples
    from tda_plugins import metagradient  # exact, replays the run (docs/design.md section 13)

The engine (``tda_plugins.capture``) imports torch only; framework integrations live in
``tda_plugins.integrations``. The transformers/TRL callbacks and ``use_id_column`` are
also importable from here (loaded on first use, so ``import tda_plugins`` needs no
transformers); OLMo-core's are in ``tda_plugins.integrations.olmo_core``.
"""

from typing import Any

from tda_plugins.api import causal_lm_example_losses, per_example_gradients
from tda_plugins.capture import (
    CaptureConsumer,
    CaptureEngine,
    LayerSelection,
    LayerSelectionError,
    MicroBatchRecord,
    RecordCollector,
)
from tda_plugins.dataset_capture import capture_examples
from tda_plugins.grads import ProjectionConfig, Route, cross_gram, per_token_scores, sq_norms
from tda_plugins.methods import (
    AdamWSettings,
    MicroBatch,
    Scores,
    TrainingStep,
    TrainingTrajectory,
    attribute,
)
from tda_plugins.methods.metagradient import metagradient
from tda_plugins.queries import QueryCollector, score_record

__version__ = "0.1.0"

#: Names loaded from ``tda_plugins.integrations.transformers`` on first access.
_TRANSFORMERS_NAMES = (
    "DataSelectionCallback",
    "GradientCaptureCallback",
    "InfluenceLoggingCallback",
    "use_id_column",
)


def __getattr__(name: str) -> Any:
    if name in _TRANSFORMERS_NAMES:
        from tda_plugins.integrations import transformers

        return getattr(transformers, name)
    raise AttributeError(f"module 'tda_plugins' has no attribute {name!r}")


__all__ = [
    "AdamWSettings",
    "CaptureConsumer",
    "CaptureEngine",
    "DataSelectionCallback",
    "GradientCaptureCallback",
    "InfluenceLoggingCallback",
    "LayerSelection",
    "LayerSelectionError",
    "MicroBatch",
    "MicroBatchRecord",
    "ProjectionConfig",
    "QueryCollector",
    "RecordCollector",
    "Route",
    "Scores",
    "TrainingStep",
    "TrainingTrajectory",
    "__version__",
    "attribute",
    "capture_examples",
    "causal_lm_example_losses",
    "cross_gram",
    "metagradient",
    "per_example_gradients",
    "per_token_scores",
    "score_record",
    "sq_norms",
    "use_id_column",
]
