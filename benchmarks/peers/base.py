"""The adapter interface every library implements, and the registry that finds them.

An adapter turns a :class:`~workload.Problem` into a ``(Q, N)`` score matrix for one of
:data:`~workload.METHODS`: it captures on the training rows and scores the queries, in
whatever way its library does that (live, through a store, through a CLI's Python entry).
The harness times :meth:`PeerAdapter.scores` whole; :meth:`PeerAdapter.prepare` is the
untimed set-up (wrapping the model, imports), :meth:`PeerAdapter.cleanup` the untimed
removal of the call's files. Other benchmarks (leave-one-out fidelity)
can call the same adapters for scores.

Adapters live one per module and register themselves with :func:`register_peer`;
:func:`adapter` imports a library's module only when it is asked for, so the harness runs
where the peers are not installed (CI: our library only). What each library runs for each
method, and why it cannot run the others, is one table: ``methods.toml``.
"""

from __future__ import annotations

import importlib
import shutil
import tomllib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import ClassVar, TypeVar

from torch import Tensor

from peers.workload import Problem


@dataclass(frozen=True)
class Library:
    """Where a library's adapter lives (a module of ``benchmarks/peers``), the PyPI
    distribution its version comes from, and whether it is one of our own ways (compared
    with the peers, not with each other)."""

    module: str
    distribution: str
    ours: bool = False


LIBRARIES = {
    "ours": Library("ours", "tda-plugins", ours=True),
    "ours-live": Library("ours", "tda-plugins", ours=True),
    "ours-memory": Library("ours", "tda-plugins", ours=True),
    "dattri-llm": Library("dattri_llm_adapter", "dattri-llm"),
    "kronfluence": Library("kronfluence_adapter", "kronfluence"),
    "opacus": Library("opacus_adapter", "opacus"),
    "bergson": Library("bergson_adapter", "bergson"),
    "logix": Library("logix_adapter", "logix-ai"),
    "traker": Library("traker_adapter", "traker"),
    "dattri": Library("dattri_adapter", "dattri"),
}
#: Per library name: ``notes`` (method -> what the library runs) and ``unsupported``
#: (method -> why it cannot run it).
METHOD_TABLE = tomllib.loads(Path(__file__).with_name("methods.toml").read_text())
_ADAPTERS: dict[str, type[PeerAdapter]] = {}
A = TypeVar("A", bound="type[PeerAdapter]")


class Unsupported(Exception):
    """The library cannot run this configuration; the message says why (kept in the cell)."""


class PeerAdapter(ABC):
    """One library's way of scoring training rows against queries.

    Class attributes:
        name: the library's name in tables (a key of :data:`LIBRARIES` and of
            :data:`METHOD_TABLE`).
    """

    name: ClassVar[str]
    #: Whether each timed call leaves files in :meth:`scratch` (stores, caches) that the
    #: next round must not find; :meth:`cleanup` then removes the folder.
    clears_scratch: ClassVar[bool] = False

    @property
    def notes(self) -> dict[str, str]:
        """Per method, what the library actually runs (projection kind, damping, the layer
        types it hooks), shown in the tables."""
        return METHOD_TABLE.get(self.name, {}).get("notes", {})

    @property
    def unsupported(self) -> dict[str, str]:
        """Per method, why the library cannot run it."""
        return METHOD_TABLE.get(self.name, {}).get("unsupported", {})

    def prepare(self, problem: Problem, method: str) -> Problem:
        """Untimed set-up before the runs of ``method``; returns the problem to score
        (an adapter may replace the model by an equivalent one it can hook)."""
        return problem

    def scratch(self, problem: Problem) -> Path:
        """The folder of this library's files under the problem's scratch folder."""
        return problem.work / self.name

    def cleanup(self, problem: Problem) -> None:
        """Untimed, after each timed call: remove what the call left on disk (a user keeps
        it; only the benchmark's next round needs it gone): :meth:`scratch` where
        :attr:`clears_scratch`, else nothing."""
        if self.clears_scratch:
            shutil.rmtree(self.scratch(problem), ignore_errors=True)

    @abstractmethod
    def scores(self, problem: Problem, method: str) -> Tensor:
        """``(Q, N)`` scores of every training row (columns, in row order) against every
        query (rows), any float dtype; raises :class:`Unsupported` for what it cannot do."""

    def check(self, method: str) -> None:
        """Raise :class:`Unsupported` when ``method`` is one the library cannot run."""
        if method in self.unsupported:
            raise Unsupported(f"{self.version_text()}: {self.unsupported[method]}")

    def version_text(self) -> str:
        """``distribution version`` of this adapter's library."""
        return library_version(self.name)


def library_version(name: str) -> str:
    """``distribution version`` of library ``name`` (or ``... not installed``), without
    importing it."""
    distribution = LIBRARIES[name].distribution if name in LIBRARIES else name
    try:
        return f"{distribution} {version(distribution)}"
    except PackageNotFoundError:
        return f"{distribution} not installed"


def register_peer(cls: A) -> A:
    """Class decorator: make an adapter available under its ``name``."""
    _ADAPTERS[cls.name] = cls
    return cls


def adapter(name: str) -> PeerAdapter:
    """A fresh adapter of library ``name`` (imports its module on first use)."""
    if name not in LIBRARIES:
        raise KeyError(f"unknown library {name!r}; known: {', '.join(LIBRARIES)}")
    importlib.import_module(f"peers.{LIBRARIES[name].module}")
    return _ADAPTERS[name]()
