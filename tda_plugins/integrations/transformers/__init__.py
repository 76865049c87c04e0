"""transformers/TRL integration: ``TrainerCallback``s for ``Trainer`` and ``SFTTrainer``.

    from tda_plugins.integrations.transformers import GradientCaptureCallback

    trainer = Trainer(..., callbacks=[GradientCaptureCallback(store_dir="run/grads")])

Examples are named by a content hash of their tokens unless ``use_id_column(trainer,
"id")`` names them by an integer column of the training dataset.

Needs the ``[hf]`` extra (transformers, TRL, PEFT, datasets, accelerate).
"""

from tda_plugins.integrations.transformers.capture import GradientCaptureCallback
from tda_plugins.integrations.transformers.example_ids import use_id_column
from tda_plugins.integrations.transformers.influence import InfluenceLoggingCallback
from tda_plugins.integrations.transformers.selection import DataSelectionCallback
from tda_plugins.integrations.transformers.setup import pad_examples

__all__ = [
    "DataSelectionCallback",
    "GradientCaptureCallback",
    "InfluenceLoggingCallback",
    "pad_examples",
    "use_id_column",
]
