"""DTensors (FSDP2/HSDP parameters and optimizer states) recognized without importing
``torch.distributed.tensor``.

That import takes seconds (its operator tables and sympy), most of what ``import
tda_plugins`` would otherwise cost. A DTensor exists only once its module has been
imported (``fully_shard`` and ``distribute_tensor`` import it), so while
``torch.distributed.tensor`` is not in ``sys.modules`` nothing is a DTensor.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_MODULE = "torch.distributed.tensor"


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor; imports nothing."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(value, module.DTensor)


def gathered(t: Tensor) -> Tensor:
    """The whole of ``t`` on this rank: a sharded DTensor all-gathered (a collective every
    rank of its mesh must join), a plain tensor itself."""
    return t.full_tensor() if is_dtensor(t) else t
