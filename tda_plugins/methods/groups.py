"""Which parameters a score counts, and how much each layer weighs (docs/design.md section 7.10).

:class:`ParameterGroups` is what a user asks for: parameters to leave out (glob patterns)
and whether each layer's gradient is unit-normalized before the dot. Resolved against a
capture's parameter layouts it becomes a :class:`ScoringSpace`, which the offline
methods and the live influence logger apply to both sides, layer by layer, before any
dot product:

    score(z, q) = sum over kept layers l of < n(K_l g_q), n(K_l g_z) >

with ``K_l`` the restriction of layer ``l``'s gradient to its kept parameters and ``n``
the identity, or ``v -> v / |v|`` per example under ``normalize_layers`` (a zero
gradient stays zero). The method's own transforms come first (LESS's Adam step is
entrywise, so restricting after it is the same as before it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from tda_plugins.capture.config import CaptureConfig
from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.parameters import ParameterLayout, keep_parameters, unit_normalized


@dataclass(frozen=True)
class ScoringSpace:
    """Parameter groups resolved against one capture: what each layer keeps.

    Attributes:
        dropped: layers none of whose parameters count (never read).
        kept: layer -> (its layout, the parameters kept) for layers that keep some of
            their parameters only; every other layer is kept whole.
        normalize_layers: unit-normalize each layer's kept gradient per example.
    """

    dropped: frozenset[str] = frozenset()
    kept: Mapping[str, tuple[ParameterLayout, frozenset[str]]] = field(default_factory=dict)
    normalize_layers: bool = False

    def layers(self, names: Iterable[str]) -> list[str]:
        """``names`` without the dropped layers, in order."""
        return [name for name in names if name not in self.dropped]

    def side(self, layer: str, grads: PerExampleGrad) -> PerExampleGrad:
        """One kept layer's gradients (``B`` examples) restricted to its kept parameters,
        then unit-normalized per example where asked."""
        if layer in self.kept:
            layout, names = self.kept[layer]
            grads = keep_parameters(grads, layout, names)
        return unit_normalized(grads) if self.normalize_layers else grads

    def apply(self, layers: Mapping[str, PerExampleGrad]) -> dict[str, PerExampleGrad]:
        """:meth:`side` of every layer of ``layers`` that is not dropped."""
        return {name: self.side(name, g) for name, g in layers.items() if name not in self.dropped}


@dataclass(frozen=True)
class ParameterGroups:
    """Parameters left out of the scores, and per-layer normalization.

    Attributes:
        exclude: glob patterns (``fnmatch``, case-sensitive); a parameter is left out of
            both sides when a pattern matches its name within its layer (``"bias"``,
            ``"weight"``) or its full name ``"<layer>.<name>"`` (``"*.ln_*"``: every
            parameter of the layers named ``*.ln_*``; ``"*.c_attn.bias"``).
        normalize_layers: each layer's gradient (what is kept of it) unit-normalized per
            example before the dot, so that every layer weighs alike whatever its
            gradients' scale.
    """

    exclude: tuple[str, ...] = ()
    normalize_layers: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.exclude, tuple) or not all(
            isinstance(p, str) and p for p in self.exclude
        ):
            raise ValueError(
                f"exclude_params takes non-empty name patterns such as ('bias',), got "
                f"{self.exclude!r}"
            )

    @classmethod
    def of(
        cls, exclude_params: str | Sequence[str] = (), normalize_layers: bool = False
    ) -> ParameterGroups:
        """From the methods' options: one pattern or several."""
        patterns = (exclude_params,) if isinstance(exclude_params, str) else tuple(exclude_params)
        return cls(patterns, bool(normalize_layers))

    @property
    def active(self) -> bool:
        """Whether anything differs from scoring every parameter as it is."""
        return bool(self.exclude) or self.normalize_layers

    def resolve(self, config: CaptureConfig, queries: CaptureConfig | None = None) -> ScoringSpace:
        """The space these groups give on a capture of ``config`` (and of ``queries``,
        whose layouts must be the same where it records them). Raises, naming the
        captured parameters, when a pattern matches none of them; when nothing would be
        left; when a layer would keep part of its parameters in a projected capture (a
        projection mixes them); and when the capture recorded no layouts."""
        if not self.exclude:
            return ScoringSpace(normalize_layers=self.normalize_layers)
        layouts = _layouts(config, queries)
        excluded = self._excluded(layouts)
        self._refuse_split_ties(config.tied, layouts, excluded)
        dropped, kept = set(), {}
        for layer, layout in layouts.items():
            gone = {name for name in layout.names if (layer, name) in excluded}
            if gone == set(layout.names):
                dropped.add(layer)
            elif gone:
                kept[layer] = (layout, frozenset(set(layout.names) - gone))
        if len(dropped) == len(layouts):
            raise ValueError(
                f"exclude_params={self.exclude} leaves out every captured parameter: "
                "nothing is left to score"
            )
        if kept and config.projection is not None:
            raise ValueError(
                f"exclude_params={self.exclude} leaves out part of the layers "
                f"{sorted(kept)[:3]}, but the capture is projected ({config.projection.kind}), "
                "which mixes a layer's parameters (a factor projection folds the bias into "
                "the input side): leave out whole layers (a pattern such as '<layer>.*'), "
                "or recapture without projection"
            )
        return ScoringSpace(frozenset(dropped), kept, self.normalize_layers)

    def _refuse_split_ties(
        self,
        tied: Sequence[tuple[str, ...]],
        layouts: Mapping[str, ParameterLayout],
        excluded: set[tuple[str, str]],
    ) -> None:
        """Refuse leaving out a tied weight under some of its uses' names only (an input
        embedding tied to the head: ``lm_head.weight`` is ``embed_tokens.weight``): one
        parameter is scored whole or not at all, whichever name the pattern gives."""
        for unit in tied:
            members = [layer for layer in unit if layer in layouts]
            names = [set(layouts[m].names) for m in members]
            for name in sorted(set.intersection(*names) if names else set()):
                hit = [m for m in members if (m, name) in excluded]
                missed = [m for m in members if (m, name) not in excluded]
                if hit and missed:
                    raise ValueError(
                        f"exclude_params={self.exclude} leaves out {hit[0]}.{name} but not "
                        f"{missed[0]}.{name}, the same weight (tied): a tied weight is left "
                        f"out whole or not at all; add a pattern for {missed[0]}.{name} too, "
                        "or leave both in"
                    )

    def _excluded(self, layouts: Mapping[str, ParameterLayout]) -> set[tuple[str, str]]:
        """``(layer, name)`` of every parameter a pattern matches; refuses a pattern that
        matches none."""
        params = [(layer, name) for layer, layout in layouts.items() for name in layout.names]
        excluded: set[tuple[str, str]] = set()
        for pattern in self.exclude:
            matched = {
                (layer, name)
                for layer, name in params
                if fnmatchcase(name, pattern) or fnmatchcase(f"{layer}.{name}", pattern)
            }
            if not matched:
                short = sorted({name for _, name in params})
                examples = [f"{layer}.{name}" for layer, name in params[:3]]
                raise ValueError(
                    f"exclude_params pattern {pattern!r} matches no captured parameter; the "
                    f"captured parameters are named {short} within their layers (in full: "
                    f"{examples}, ...), and a pattern is matched against either name"
                )
            excluded |= matched
        return excluded


def _layouts(config: CaptureConfig, queries: CaptureConfig | None) -> Mapping[str, ParameterLayout]:
    """The capture's parameter layouts, in layer order; the queries' must agree."""
    if config.parameters is None:
        raise ValueError(
            "this gradient store does not record where each layer's parameters sit (it was "
            "written before tda-plugins recorded it), so no parameter can be left out of its "
            "scores: recapture it, or score without exclude_params"
        )
    if queries is not None and queries.parameters is not None:
        differ = [n for n in config.layers if queries.parameters.get(n) != config.parameters[n]]
        if differ:
            raise ValueError(
                f"the queries' layers {differ[:3]} hold other parameters than the store's "
                "(a parameter trainable on one side only): capture both with the same model"
            )
    return {name: config.parameters[name] for name in config.layers}
