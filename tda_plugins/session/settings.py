"""What a capture records, in three parts that compose: which layers and how their
gradients are projected (:class:`LayerSettings`, what every capture needs, with or without
a store), where and what the store keeps (:class:`StoreSettings`), and the training run's
extras around them (:class:`CaptureSettings`: K-FAC statistics, optimizer state, the
trajectory).

The callbacks, :func:`~tda_plugins.session.dataset.capture_examples` and ``tda capture``
also take these as flat keyword options (``layers="linear", projection="factor",
store_dir=...``): :class:`LayerOptions` and :class:`ProjectionOptions` declare the layer
and projection ones once (the OLMo-core callbacks, dataclasses, take their fields), and
:func:`layer_settings` and :meth:`CaptureSettings.from_options` turn them into the
composed settings.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from tda_plugins.capture.config import CaptureConfig
from tda_plugins.capture.layers import LayerSelection, SelectionKind
from tda_plugins.grads.projection import MapKind, ProjectionConfig


@dataclass(frozen=True)
class LayerSettings:
    """Which layers a capture hooks and how their gradients are projected in the hook.

    Attributes:
        selection: the captured layers (default ``"auto"``: LoRA adapters on PEFT
            models, else linear layers).
        projection: the random projection applied in the hook; ``None``: exact gradients.
        uncaptured_fix: the way out to name for trainable parameters the capture leaves
            out, where the trainer's setup rather than the selection leaves them out (a
            fused loss head, and a weight tied to it); ``None``: widen the selection.
    """

    selection: LayerSelection = field(default_factory=LayerSelection)
    projection: ProjectionConfig | None = field(default=None, kw_only=True)
    uncaptured_fix: str | None = field(default=None, kw_only=True, compare=False)

    @classmethod
    def like(cls, config: CaptureConfig) -> LayerSettings:
        """The settings that capture exactly the layers of ``config`` (a store's), by
        name, with its projection: queries for that store."""
        names = "|".join(re.escape(name) for name in config.layers)
        selection = LayerSelection(kind="all", include=f"^(?:{names})$")
        return cls(selection, projection=config.projection)


@dataclass(kw_only=True)
class LayerOptions:
    """The layer options as flat keywords, the form the callbacks and ``tda capture`` take.

    Attributes:
        layers: ``"auto"`` (LoRA adapters on PEFT models, else linear layers), ``"linear"``,
            ``"lora"`` or ``"all"`` (linear, embedding and norm scales); or a whole
            :class:`LayerSelection` (then without the three filters below, which it holds).
        include: regex; keep only layers whose module name matches.
        exclude: regex; drop layers whose module name matches.
        last_n_blocks: keep only layers in the last N transformer blocks.
    """

    layers: SelectionKind | LayerSelection = "auto"
    include: str | None = None
    exclude: str | None = None
    last_n_blocks: int | None = None

    def layer_selection(self) -> LayerSelection:
        blocks = self.last_n_blocks
        if not isinstance(self.layers, LayerSelection):
            return LayerSelection(
                self.layers, include=self.include, exclude=self.exclude, last_n_blocks=blocks
            )
        filters = {"include": self.include, "exclude": self.exclude, "last_n_blocks": blocks}
        given = [name for name, value in filters.items() if value is not None]
        if given:
            raise TypeError(
                f"layers= is a LayerSelection and {given} are given too; put them in the "
                f"LayerSelection (LayerSelection({self.layers.kind!r}, include=...)) or "
                "give layers as its kind string"
            )
        return self.layers


@dataclass(kw_only=True)
class ProjectionOptions:
    """The projection options as flat keywords (:class:`ProjectionConfig`'s, for the
    callbacks and ``tda capture``). An option left ``None`` takes
    :class:`ProjectionConfig`'s default; one that the projection kind does not use is
    refused rather than ignored.

    Attributes:
        projection: ``"none"`` (exact gradients), ``"factor"`` (LoGra, ``k_g x k_a`` per
            layer) or ``"dense"`` (``k`` per layer).
        k_a: factor projection rows for layer inputs (default 16).
        k_g: factor projection rows for output gradients (default 16).
        k: dense projection dimension (default 256).
        projection_map: ``"gaussian"`` (default), ``"rademacher"`` or ``"sparse_jl"``.
        seed: projection seed (maps are deterministic from seed and layer name; default 0).
    """

    projection: Literal["none", "factor", "dense"] = "none"
    k_a: int | None = None
    k_g: int | None = None
    k: int | None = None
    projection_map: MapKind | None = None
    seed: int | None = None

    def projection_config(self) -> ProjectionConfig | None:
        """The :class:`ProjectionConfig` of these options (``None``: exact gradients).

        Raises:
            ValueError: an option the projection kind does not use is given (with
                ``projection="none"``, any of them: the gradients would stay exact).
        """
        given = {name: getattr(self, name) for name in _SIZES if getattr(self, name) is not None}
        unused = sorted(set(given) - _USES[self.projection])
        if unused:
            takes = _USES[self.projection]
            kind = (
                "keeps exact gradients, which takes none of them: set projection='factor' "
                "(k_a, k_g) or 'dense' (k) to project"
                if not takes
                else f"takes {_option_names(sorted(takes))}"
            )
            raise ValueError(
                f"{_option_names(unused)} given, but projection={self.projection!r} {kind}; "
                "leave the others out"
            )
        if self.projection == "none":
            return None
        fields = {_CONFIG_FIELDS.get(name, name): value for name, value in given.items()}
        return ProjectionConfig(kind=self.projection, **fields)


#: The projection options beside ``projection``, and those each kind uses.
_SIZES = ("k_a", "k_g", "k", "projection_map", "seed")
_USES: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "factor": frozenset({"k_a", "k_g", "projection_map", "seed"}),
    "dense": frozenset({"k", "projection_map", "seed"}),
}
#: :class:`ProjectionConfig`'s field of an option where it is not the option's own name.
_CONFIG_FIELDS = {"projection_map": "map"}
#: ``tda``'s flag of an option where it is not the option's own name.
_FLAGS = {"projection_map": "--map"}


def _option_names(names: list[str]) -> str:
    """``k_a (--k-a), k (--k)``: the keyword and ``tda``'s flag of each option."""
    return ", ".join(f"{n} ({_FLAGS.get(n, '--' + n.replace('_', '-'))})" for n in names)


#: The flat option names of :class:`LayerOptions` and :class:`ProjectionOptions`.
LAYER_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(LayerOptions))
PROJECTION_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(ProjectionOptions))
#: Their defaults (``tda capture``'s too), by name.
LAYER_OPTION_DEFAULTS: dict[str, Any] = {
    f.name: f.default
    for f in dataclasses.fields(LayerOptions) + dataclasses.fields(ProjectionOptions)
}


def layer_settings(**options: Any) -> LayerSettings:
    """The :class:`LayerSettings` of flat layer and projection options (``layers="linear",
    projection="factor", k_a=8, ...``); an unknown name is refused, naming the known ones."""
    known = LAYER_OPTION_NAMES | PROJECTION_OPTION_NAMES
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown layer options {unknown}; known: {sorted(known)}")
    layers = LayerOptions(**{k: v for k, v in options.items() if k in LAYER_OPTION_NAMES})
    projection = ProjectionOptions(
        **{k: v for k, v in options.items() if k in PROJECTION_OPTION_NAMES}
    )
    return LayerSettings(layers.layer_selection(), projection=projection.projection_config())


@dataclass(frozen=True)
class StoreSettings:
    """Where the gradient store is written and what it keeps besides the gradients.

    Attributes:
        directory: the store's folder (one ``rank-<r>/`` per process).
        keep_tokens: keep per-token factors in the store (token-level scores).
        store_texts: save each example's text, decoded by the run's tokenizer, beside the
            store (``rank-<r>/examples.jsonl``), so reports show what was trained on;
            ``False`` for data that must not be copied there.
    """

    directory: str
    keep_tokens: bool = field(default=False, kw_only=True)
    store_texts: bool = field(default=True, kw_only=True)


#: Flat option names of :class:`StoreSettings`' fields (``store_dir``: ``directory``).
_STORE_OPTIONS = {
    "store_dir": "directory",
    "keep_tokens": "keep_tokens",
    "store_texts": "store_texts",
}


@dataclass(frozen=True)
class CaptureSettings:
    """What a training run records: the store, the layers, and what the run adds to them.

    Attributes:
        store: where the store is written and what it keeps.
        layers: which layers are captured and how their gradients are projected.
        curvature: accumulate K-FAC statistics in the same pass (K-FAC, EK-FAC, LoGra):
            ``True``, ``False``, or ``"auto"`` (default): on where they are cheap, at most
            :data:`~tda_plugins.session.capture.AUTO_CURVATURE_BYTES` per rank (factor
            projection, small models or few layers), else off with a log line giving
            their size and how to turn them on.
        curvature_head: keep the dense ``vocab x vocab`` output factor of a vocabulary-wide
            output layer (an untied ``lm_head``); by default it keeps that factor's
            diagonal (``vocab`` values), as a tied head does.
        curvature_budget_gb: most GiB of K-FAC statistics per rank; a capture whose plan
            (:mod:`tda_plugins.precondition.plan`) needs more is refused before the first
            step, with the settings that would fit. ``None``: no limit.
        curvature_save_steps: also commit the statistics every this many optimizer steps
            (besides each trainer checkpoint and the end), so that a crashed run keeps
            them up to there; 0: only at checkpoints and the end.
        save_optimizer_state: at the end, save Adam moments of the captured layers (LESS).
        record_trajectory: after every optimizer step, record its learning rates, Adam
            hyperparameters, clipping factor, examples with their loss scales, and the
            captured layers' Adam second moments (``rank-<r>/trajectory/``), for
            trajectory-aware attribution (``adamw_influence``). Per step it stores
            ``4 D`` bytes (``D`` the captured parameters; fp64 optimizer state: ``8 D``)
            plus 16 bytes per example. Needs AdamW, one process and no projection; refused
            before the first step otherwise.

    :meth:`from_options` builds one from the flat keyword options the callbacks take.
    """

    store: StoreSettings
    layers: LayerSettings = field(default_factory=LayerSettings, kw_only=True)
    curvature: bool | Literal["auto"] = field(default="auto", kw_only=True)
    curvature_head: bool = field(default=False, kw_only=True)
    curvature_budget_gb: float | None = field(default=8.0, kw_only=True)
    curvature_save_steps: int = field(default=50, kw_only=True)
    save_optimizer_state: bool = field(default=True, kw_only=True)
    record_trajectory: bool = field(default=False, kw_only=True)

    @classmethod
    def from_options(cls, **options: Any) -> CaptureSettings:
        """The settings of flat keyword options: ``store_dir`` (required), ``keep_tokens``
        and ``store_texts`` for the store, :func:`layer_settings`' options for the layers,
        and this class's own fields; an unknown name is refused, naming the known ones."""
        own_names = {f.name for f in dataclasses.fields(cls)} - {"store", "layers"}
        layer_names = LAYER_OPTION_NAMES | PROJECTION_OPTION_NAMES
        known = layer_names | own_names | set(_STORE_OPTIONS)
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown capture options {unknown}; known: {sorted(known)}")
        if "store_dir" not in options:
            raise TypeError("capture options need store_dir: the folder the store is written to")
        store = {_STORE_OPTIONS[k]: v for k, v in options.items() if k in _STORE_OPTIONS}
        return cls(
            StoreSettings(store.pop("directory"), **store),
            layers=layer_settings(**{k: v for k, v in options.items() if k in layer_names}),
            **{k: v for k, v in options.items() if k in own_names},
        )


def settings_from(settings: CaptureSettings | None, options: dict[str, Any]) -> CaptureSettings:
    """``settings``, or :meth:`CaptureSettings.from_options` of the keyword ``options``;
    not both."""
    if settings is not None and options:
        raise TypeError("pass either a CaptureSettings or keyword options, not both")
    if settings is not None:
        return settings
    return CaptureSettings.from_options(**options)
