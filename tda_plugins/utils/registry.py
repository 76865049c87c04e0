"""Named strategies: one small registry type shared by methods, preconditioners and rules."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to strategy classes; ``register`` is a class decorator.

    Args:
        kind: what the strategies are, for error messages ("attribution method").
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: make the class available under ``name`` (sets ``cls.name``)."""

        def decorate(cls: type[T]) -> type[T]:
            cls.name = name  # type: ignore[attr-defined]
            self._classes[name] = cls
            return cls

        return decorate

    def create(self, name: str, **options: Any) -> T:
        """An instance of the strategy ``name``; unknown names list the known ones."""
        if name not in self._classes:
            raise ValueError(f"unknown {self.kind} {name!r}; choose from {sorted(self._classes)}")
        return self._classes[name](**options)

    def __getitem__(self, name: str) -> type[T]:
        return self._classes[name]

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._classes))
