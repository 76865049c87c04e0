"""OLMo-core integration: trainer ``Callback``s and OLMo-core's loss normalization.

    from tda_plugins.integrations.olmo_core import GradientCaptureCallback
    from tda_plugins.session.settings import CaptureSettings, StoreSettings

    trainer_config = trainer_config.with_callback(
        "tda", GradientCaptureCallback(CaptureSettings(StoreSettings("run/grads")))
    )

Online data selection (drop, at every step, the instances whose gradient works against a
target pool, exactly, from ``.grad``):

    trainer_config = trainer_config.with_callback(
        "selection", DataSelectionCallback(target=target_token_ids, fraction=0.25)
    )

Live influence of each step's instances on fixed queries (metrics every ``n`` steps and a
report at the end):

    trainer_config = trainer_config.with_callback(
        "influence", InfluenceLoggingCallback(queries=query_token_ids, every_n_steps=10)
    )

Needs the ``[olmo]`` extra (``ai2-olmo-core``).
"""

from tda_plugins.integrations.olmo_core.callbacks import (
    GradientCaptureCallback,
    UnsupportedTrainingSetup,
    check_train_module,
)
from tda_plugins.integrations.olmo_core.influence import InfluenceLoggingCallback
from tda_plugins.integrations.olmo_core.normalization import OLMoCoreLossNormalization
from tda_plugins.integrations.olmo_core.selection import DataSelectionCallback

__all__ = [
    "DataSelectionCallback",
    "GradientCaptureCallback",
    "InfluenceLoggingCallback",
    "OLMoCoreLossNormalization",
    "UnsupportedTrainingSetup",
    "check_train_module",
]
