"""Whether a trainer's arguments are TRL's ``SFTConfig``, recognized without importing TRL."""

from __future__ import annotations

from typing import Any


def is_sft_config(args: Any) -> bool:
    """Whether ``args`` is TRL's ``SFTConfig`` or a subclass of it (a user's dataclass
    extending it, TRL's own ``GKDConfig``): its trainer tokenizes, truncates and fuses the
    head as ``SFTTrainer`` does."""
    return any(
        cls.__name__ == "SFTConfig" and cls.__module__.split(".")[0] == "trl"
        for cls in type(args).__mro__
    )
