"""The layer-adapter interface and the registry that maps module types to adapters.

An adapter says, for one module type, which tensor of the forward call is the layer input,
how ``(input, output gradient)`` becomes per-example gradients, and how those split into
the module's parameters. Adding a layer type is a new file with one registered class
(the Opacus pattern); the engine never branches on module types.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from torch import Tensor, nn

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.parameters import ParameterLayout


class LayerAdapter(ABC):
    """Per-example gradients for one module type.

    Loss convention: ``grad_output`` is the gradient of whatever loss was backpropagated
    w.r.t. this call's output, so the per-example gradients are contributions to that
    loss's parameter gradient (for a summed per-example loss: each example's own gradient).
    """

    #: Selection family: ``"linear"``, ``"embedding"`` or ``"norm"``.
    family: ClassVar[str]

    def layer_input(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Tensor:
        """The tensor of the forward call (its positional ``args`` and keyword ``kwargs``)
        that the gradient factors are built from: its first argument."""
        return args[0] if args else next(iter(kwargs.values()))

    @abstractmethod
    def captured_parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """Local name -> parameter, for the trainable parameters this adapter captures."""

    @abstractmethod
    def parameter_layout(self, module: nn.Module) -> ParameterLayout:
        """Where each captured parameter sits in the materialized layout (the one
        :meth:`unflatten` reads), for scoring some parameters without the others."""

    @abstractmethod
    def capture(self, module: nn.Module, x: Tensor, grad_output: Tensor) -> PerExampleGrad:
        """Per-example gradients of one call: ``x`` is the layer input, ``grad_output``
        ``(B, ..., N_o)`` the gradient w.r.t. the call's output."""

    def param_grads(self, module: nn.Module, grads: PerExampleGrad) -> dict[str, Tensor]:
        """Local parameter name -> ``(B, *param.shape)`` per-example gradient (fp32/fp64).

        Only for unprojected captures (a projected gradient has no parameter layout).
        """
        return self.unflatten(module, grads.materialize())

    @abstractmethod
    def unflatten(self, module: nn.Module, flat: Tensor) -> dict[str, Tensor]:
        """``(..., D)`` in the materialized layout -> local name -> ``(..., *param.shape)``."""

    @abstractmethod
    def flatten(self, module: nn.Module, values: dict[str, Tensor]) -> Tensor:
        """Inverse of :meth:`unflatten` for one vector: per-parameter tensors in their own
        shapes (optimizer state, ``.grad``) -> ``(D,)`` in the materialized layout."""


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class, used to match classes without importing them."""
    return f"{cls.__module__}.{cls.__qualname__}"


class AdapterRegistry:
    """Maps module classes to adapters: by type, by qualified class name, or by name suffix.

    Matching walks the module's MRO; the first class that matches (type, then qualified
    name, then suffix) wins, so a subclass can have its own adapter. A subclass that
    defines its own ``forward`` does not inherit its base's adapter: the adapter's math is
    its base's call (Gemma's scaled embedding multiplies the rows it looks up, OPT's
    positional embedding looks up positions, not its input), so such a class is captured
    only through an adapter registered for it.
    """

    def __init__(self) -> None:
        self._by_type: dict[type, LayerAdapter] = {}
        self._by_name: dict[str, LayerAdapter] = {}
        self._by_suffix: dict[str, LayerAdapter] = {}

    def register(
        self,
        *types: type[nn.Module],
        names: tuple[str, ...] = (),
        suffixes: tuple[str, ...] = (),
    ) -> Callable[[type[LayerAdapter]], type[LayerAdapter]]:
        """Class decorator: register one instance of the adapter for these module classes."""

        def decorate(adapter_cls: type[LayerAdapter]) -> type[LayerAdapter]:
            adapter = adapter_cls()
            self._by_type.update(dict.fromkeys(types, adapter))
            self._by_name.update(dict.fromkeys(names, adapter))
            self._by_suffix.update(dict.fromkeys(suffixes, adapter))
            return adapter_cls

        return decorate

    def lookup(self, module: nn.Module) -> LayerAdapter | None:
        """The adapter for ``module``, or ``None`` when its type is not supported (no class
        of its MRO registered, or a ``forward`` of its own above the registered one)."""
        for cls in type(module).__mro__:
            found = self._by_type.get(cls) or self._by_name.get(qualified_name(cls))
            if found is None:
                found = next(
                    (a for s, a in self._by_suffix.items() if cls.__name__.endswith(s)), None
                )
            if found is not None:
                return found
            if "forward" in vars(cls):  # the bases' adapters do not compute this call
                return None
        return None

    def supported(self) -> list[str]:
        """Human-readable list of supported module classes, for error messages."""
        return sorted(
            [t.__name__ for t in self._by_type]
            + [n.rsplit(".", 1)[-1] for n in self._by_name]
            + [f"*{s}" for s in self._by_suffix]
        )


#: The registry the engine uses unless given another; adapters register into it on import.
DEFAULT_REGISTRY = AdapterRegistry()
register_adapter = DEFAULT_REGISTRY.register
