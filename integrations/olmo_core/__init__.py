"""OLMo-core integration: a trainer ``Callback`` and OLMo-core's loss normalization.

    from tda_plugins.integrations.olmo_core import GradientCaptureCallback
    from tda_plugins.session import CaptureSettings

    trainer_config = trainer_config.with_callback(
        "tda", GradientCaptureCallback(CaptureSettings(store_dir="run/grads"))
    )

Needs the ``[olmo]`` extra (``ai2-olmo-core``).
"""

from tda_plugins.integrations.olmo_core.callbacks import (
    GradientCaptureCallback,
    UnsupportedTrainingSetup,
    check_train_module,
)
from tda_plugins.integrations.olmo_core.normalization import OLMoCoreLossNormalization

__all__ = [
    "GradientCaptureCallback",
    "OLMoCoreLossNormalization",
    "UnsupportedTrainingSetup",
    "check_train_module",
]
