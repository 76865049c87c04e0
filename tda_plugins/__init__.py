"""tda-plugins: training-data attribution from the training run's own backward pass.

    from tda_plugins import GradientCaptureCallback, attribute, capture_examples
    from tda_plugins import score_examples  # GradDot/GradCos against known queries, no store
    from tda_plugins import metagradient  # exact, replays the run (docs/design.md section 13)

The engine (``tda_plugins.capture``) imports torch only; framework integrations live in
``tda_plugins.integrations``. The transformers/TRL callbacks and ``use_id_column`` are
also importable from here; OLMo-core's are in ``tda_plugins.integrations.olmo_core``.
Every name below is loaded on its first use, so ``import tda_plugins`` imports neither
torch nor transformers.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tda_plugins.capture import (
        CaptureConsumer,
        CaptureEngine,
        LayerSelection,
        LayerSelectionError,
        MicroBatchRecord,
        RecordCollector,
    )
    from tda_plugins.grads import ProjectionConfig, Route, cross_gram, per_token_scores, sq_norms
    from tda_plugins.integrations.transformers import (
        DataSelectionCallback,
        GradientCaptureCallback,
        InfluenceLoggingCallback,
        use_id_column,
    )
    from tda_plugins.live.queries import QueryCollector, score_record
    from tda_plugins.methods import (
        AdamWSettings,
        MicroBatch,
        Scores,
        TrainingStep,
        TrainingTrajectory,
        attribute,
    )
    from tda_plugins.methods.metagradient import metagradient
    from tda_plugins.session.batch import causal_lm_example_losses, per_example_gradients
    from tda_plugins.session.dataset import capture_examples
    from tda_plugins.session.scoring import score_examples

__version__ = "0.1.0"

#: Module of each name this package exports, imported on the name's first use (so that
#: ``import tda_plugins`` and the ``tda`` command's parser import neither torch nor
#: transformers).
_EXPORTS = {
    **dict.fromkeys(
        (
            "CaptureConsumer",
            "CaptureEngine",
            "LayerSelection",
            "LayerSelectionError",
            "MicroBatchRecord",
            "RecordCollector",
        ),
        "tda_plugins.capture",
    ),
    **dict.fromkeys(
        ("ProjectionConfig", "Route", "cross_gram", "per_token_scores", "sq_norms"),
        "tda_plugins.grads",
    ),
    **dict.fromkeys(
        (
            "DataSelectionCallback",
            "GradientCaptureCallback",
            "InfluenceLoggingCallback",
            "use_id_column",
        ),
        "tda_plugins.integrations.transformers",
    ),
    **dict.fromkeys(("QueryCollector", "score_record"), "tda_plugins.live.queries"),
    **dict.fromkeys(
        (
            "AdamWSettings",
            "MicroBatch",
            "Scores",
            "TrainingStep",
            "TrainingTrajectory",
            "attribute",
        ),
        "tda_plugins.methods",
    ),
    "metagradient": "tda_plugins.methods.metagradient",
    **dict.fromkeys(
        ("causal_lm_example_losses", "per_example_gradients"), "tda_plugins.session.batch"
    ),
    "capture_examples": "tda_plugins.session.dataset",
    "score_examples": "tda_plugins.session.scoring",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tda_plugins' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later uses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


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
    "score_examples",
    "score_record",
    "sq_norms",
    "use_id_column",
]
