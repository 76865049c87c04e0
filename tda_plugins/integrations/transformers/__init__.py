"""transformers/TRL integration: ``TrainerCallback``s for ``Trainer`` and ``SFTTrainer``.

    from tda_plugins.integrations.transformers import GradientCaptureCallback

    trainer = Trainer(..., callbacks=[GradientCaptureCallback(store_dir="run/grads")])

Needs the ``[hf]`` extra (transformers, TRL, PEFT, datasets, accelerate).
"""

from tda_plugins.integrations.transformers.capture import GradientCaptureCallback
from tda_plugins.integrations.transformers.influence import InfluenceLoggingCallback
from tda_plugins.integrations.transformers.selection import DataSelectionCallback
from tda_plugins.integrations.transformers.setup import pad_examples

__all__ = [
    "DataSelectionCallback",
    "GradientCaptureCallback",
    "InfluenceLoggingCallback",
    "pad_examples",
]
