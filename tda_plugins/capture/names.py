"""Layer names that do not depend on how a trainer wraps modules for activation checkpointing.

torch's ``checkpoint_wrapper`` (OLMo-core's ``ac_config``, FSDP activation checkpointing
through accelerate) moves each wrapped module under a ``_checkpoint_wrapped_module``
attribute of its wrapper, so that ``named_modules()`` calls a query projection
``blocks.0._checkpoint_wrapped_module.attention.w_q`` in a run with activation
checkpointing and ``blocks.0.attention.w_q`` in the same model without it (the model as
saved, loaded again to capture queries). Stores, K-FAC statistics and weight digests name
layers by :func:`canonical_name`, the name without those segments, so that both captures
name every layer alike.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

#: Attribute under which a wrapper keeps the module it wraps (torch's
#: ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``).
WRAPPER_ATTRIBUTES = frozenset({"_checkpoint_wrapped_module"})


def canonical_name(name: str) -> str:
    """``name`` without its wrapper segments: ``blocks.0._checkpoint_wrapped_module.mlp``
    -> ``blocks.0.mlp``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_ATTRIBUTES)


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` under their canonical names, wrappers left out (a wrapper
    and the module it wraps have one name: the module's)."""
    for name, module in model.named_modules():
        if not any(hasattr(module, attribute) for attribute in WRAPPER_ATTRIBUTES):
            yield canonical_name(name), module


def modules_by_name(model: nn.Module) -> dict[str, nn.Module]:
    """Canonical name -> module, for every module of ``model`` but wrappers."""
    return dict(named_modules(model))
