"""Which layers the engine captures: a declarative, validated selection.

Filters apply in order: family (``kind``) and module ``types``, then ``include`` /
``exclude`` regexes on module names, then ``last_n_blocks``. Only modules with a
registered adapter and trainable parameters are candidates. Every filter that leaves
nothing raises an error that names the filter and what was available.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Concatenate, Literal, ParamSpec, TypeGuard, TypeVar

from torch import nn

from tda_plugins.capture.adapters import DEFAULT_REGISTRY, AdapterRegistry, LayerAdapter
from tda_plugins.capture.names import canonical_name, modules_by_name, named_modules

SelectionKind = Literal["auto", "linear", "lora", "all"]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

_LORA_NAME = re.compile(r"(^|\.)lora_[AB](\.|$)")
_LORA_ADAPTER = re.compile(r"(?:^|\.)lora_[AB]\.([^.]+)$")


class LayerSelectionError(ValueError):
    """The layer selection matched nothing or asked for something unsupported."""


def is_lora_adapter(name: str, module: nn.Module) -> bool:
    """PEFT LoRA adapter sub-layers: ``...lora_A.<adapter>`` / ``...lora_B.<adapter>`` linears."""
    return isinstance(module, nn.Linear) and _LORA_NAME.search(name) is not None


def lora_adapter_names(layers: Iterable[str]) -> set[str]:
    """The PEFT adapters the LoRA layers among ``layers`` belong to (``...lora_A.<adapter>``;
    PEFT names an adapter ``default`` unless told otherwise)."""
    return {m.group(1) for name in layers if (m := _LORA_ADAPTER.search(name))}


def head_layers(model: nn.Module) -> frozenset[str]:
    """The names of the modules that compute ``model``'s vocabulary-wide output: its LM
    head (the module transformers' ``get_output_embeddings()`` returns, else the last
    linear module inside a module named ``lm_head``, OLMo-core's ``lm_head.w_out``, as
    wide as the vocabulary, the widest ``nn.Embedding``) and the linear modules inside it
    as wide as it (a PEFT LoRA's ``lora_B`` on the head). Empty when there is none. Never
    by width alone: an MLP as wide as a tiny vocabulary is not the head."""
    named = modules_by_name(model)
    found = _output_embeddings(model)
    head = next((n for n, m in named.items() if m is found), None)
    if head is None:
        sizes = [m.num_embeddings for m in named.values() if isinstance(m, nn.Embedding)]
        wide = [
            n
            for n, m in named.items()
            if sizes and "lm_head" in n.split(".") and _output_width(m) == max(sizes)
        ]
        head = wide[-1] if wide else None
    if head is None:
        return frozenset()
    inside = {n: _output_width(m) for n, m in named.items() if n.startswith(head + ".")}
    width = _output_width(named[head]) or max((w for w in inside.values() if w), default=None)
    return frozenset([head, *(n for n, w in inside.items() if w is not None and w == width)])


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    """What ``model.get_output_embeddings()`` returns, or ``None`` where the model has no
    such method or its method declines (some models raise ``NotImplementedError``)."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        found = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    return found if isinstance(found, nn.Module) else None


def _output_width(module: nn.Module) -> int | None:
    """The output width of a linear module, ``None`` for any other."""
    if isinstance(module, nn.Linear) or type(module).__name__ == "Linear":  # PEFT's wrapper
        return getattr(module, "out_features", None)
    return getattr(module, "nf", None) if type(module).__name__ == "Conv1D" else None


def _lora_layers(
    model: nn.Module, chosen: Mapping[str, tuple[nn.Module, LayerAdapter]]
) -> Iterator[tuple[str, str, nn.Module | None, str]]:
    """The PEFT LoRA sub-layers among ``chosen``: each one's name, the name of the LoRA
    layer that owns it (``...q_proj`` of ``...q_proj.lora_A.default``), that layer, and
    the adapter's name."""
    named = modules_by_name(model)
    for name, (module, _) in chosen.items():
        if is_lora_adapter(name, module):
            owner, _, rest = name.rpartition(".lora_")
            yield name, owner, named.get(owner), rest.partition(".")[2]


def _refuse_dora(model: nn.Module, chosen: Mapping[str, tuple[nn.Module, LayerAdapter]]) -> None:
    """Refuse a PEFT DoRA adapter (``LoraConfig(use_dora=True)``) among the chosen layers.

    DoRA calls its ``lora_A``/``lora_B`` a second time per forward, on an identity matrix
    (to measure the adapted weight's column norms), which a per-example hook cannot tell
    from a batch; and its trainable magnitude vector scales the whole layer's output, a
    parameter no adapter captures per example."""
    for _, owner, layer, adapter in _lora_layers(model, chosen):
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise LayerSelectionError(
                f"{owner} is a DoRA adapter (LoraConfig(use_dora=True)): PEFT calls its "
                "lora_A/lora_B on an identity matrix besides the batch, and its magnitude "
                "vector has no per-example capture; train the adapter with use_dora=False"
            )


def _refuse_parameter_lora(
    model: nn.Module, chosen: Mapping[str, tuple[nn.Module, LayerAdapter]]
) -> None:
    """Refuse a PEFT LoRA on a parameter (``LoraConfig(target_parameters=[...])``, PEFT's
    ``ParamWrapper``): PEFT adds ``lora_B.weight @ lora_A.weight`` to the wrapped weight
    without calling ``lora_A``/``lora_B``, so no hook sees a per-example input there."""
    for _, owner, layer, _ in _lora_layers(model, chosen):
        if type(layer).__name__ != "ParamWrapper":
            continue
        wrapped: Any = layer
        while type(wrapped).__name__ == "ParamWrapper":  # nested: one per targeted parameter
            wrapped = wrapped.base_layer
        fix = (
            f"target the module instead (target_modules=[{owner.rpartition('.')[2]!r}]), "
            "which trains the same low-rank update of a linear layer"
            if isinstance(wrapped, nn.Linear)
            else f"{type(wrapped).__name__} is not a linear layer (an MoE router or experts "
            "hold their weights as parameters, which PEFT wraps so even under "
            "target_modules='all-linear'): leave it out of the LoRA, naming the linear "
            "layers to adapt in target_modules (e.g. the attention projections)"
        )
        raise LayerSelectionError(
            f"{owner} is a LoRA on a parameter (LoraConfig(target_parameters=...), or PEFT's "
            "own choice): PEFT adds lora_B @ lora_A to its weight without calling "
            f"lora_A/lora_B on the batch, so their per-example gradients cannot be captured; "
            f"{fix}"
        )


def _refuse_inactive_adapters(
    model: nn.Module, chosen: Mapping[str, tuple[nn.Module, LayerAdapter]]
) -> None:
    """Refuse a trainable LoRA adapter that is not active: PEFT never calls it, so it gets
    no gradient and does not train, and its layer's capture would wait for one."""
    for name, _, layer, adapter in _lora_layers(model, chosen):
        active = getattr(layer, "active_adapters", None)
        if isinstance(active, list | tuple) and adapter not in active:
            raise LayerSelectionError(
                f"the PEFT adapter {adapter!r} is not active (active: {list(active)}), but its "
                f"parameters require grad ({name}): PEFT does not call it, so it gets no "
                f"gradient and does not train; freeze it (its parameters' "
                f"requires_grad_(False)), or activate it (set_adapter({adapter!r}))"
            )


@contextmanager
def adapters_trainable(model: nn.Module) -> Iterator[None]:
    """Inside the block, the active LoRA adapters of a PEFT model loaded for inference
    (every adapter frozen: ``PeftModel.from_pretrained`` without ``is_trainable=True``)
    require grad, and so do their ``modules_to_save`` copies, which trained beside them,
    so that a capture outside training can take their gradients; they are frozen again
    afterwards. A model with a trainable adapter parameter is left as it is, and so is one
    without adapters."""
    active = getattr(model, "active_adapters", None)
    names = set(active) if isinstance(active, list | tuple) else None
    params = [
        p
        for name, module in named_modules(model)
        if is_lora_adapter(name, module) and (names is None or lora_adapter_names([name]) <= names)
        for p in module.parameters()
    ]
    if params:
        params += saved_copies(model, names)
    if not params or any(p.requires_grad for p in params):
        yield
        return
    logger.info("tda-plugins: the model's LoRA adapters are frozen; trainable for the capture")
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(False)


def saved_copies(model: nn.Module, adapters: set[str] | None) -> list[nn.Parameter]:
    """The parameters of the PEFT ``modules_to_save`` copies of ``adapters`` (``None``:
    every adapter's)."""
    return [
        p
        for name, p in model.named_parameters()
        if ".modules_to_save." in name
        and (adapters is None or name.split(".modules_to_save.")[1].split(".")[0] in adapters)
    ]


def with_adapters_trainable(
    capture: Callable[Concatenate[Any, P], R],
) -> Callable[Concatenate[Any, P], R]:
    """``capture(model, ...)`` run inside :func:`adapters_trainable` of its model (a
    capture outside training: a PEFT model loaded for inference works as it is)."""

    @functools.wraps(capture)
    def run(model: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        with adapters_trainable(model):
            return capture(model, *args, **kwargs)

    return run


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries PEFT LoRA adapters."""
    return any(is_lora_adapter(n, m) for n, m in named_modules(model))


@dataclass(frozen=True)
class LayerSelection:
    """Which layers to capture.

    Attributes:
        kind: ``"linear"`` (``nn.Linear`` and transformers ``Conv1D``), ``"lora"`` (PEFT
            LoRA ``lora_A``/``lora_B`` only), ``"all"`` (every supported type: linear,
            embedding, norm scales) or ``"auto"`` (LoRA adapters when the model has them,
            else linear).
        types: restrict to these module classes (classes or class names).
        include: keep only modules whose name matches this regex (``re.search``).
        exclude: drop modules whose name matches this regex.
        last_n_blocks: keep only modules inside the last N transformer blocks (the
            longest ``nn.ModuleList`` of the model).
        trainable_only: skip modules whose parameters are all frozen.

    A linear layer whose weight is tied to a module outside the selection (GPT-2's
    ``lm_head`` tied to ``wte``) is left out by ``kind="linear"``, since capturing it alone
    gives only part of that parameter's gradient; ``kind="all"`` captures both and the
    parameter's gradients add.
    """

    kind: SelectionKind = "auto"
    types: tuple[type | str, ...] = ()
    include: str | None = None
    exclude: str | None = None
    last_n_blocks: int | None = None
    trainable_only: bool = True
    _registry: AdapterRegistry = field(default=DEFAULT_REGISTRY, repr=False, compare=False)

    def resolve(self, model: nn.Module) -> dict[str, tuple[nn.Module, LayerAdapter]]:
        """Module name -> (module, adapter) for every selected layer, in model order."""
        if self.kind not in ("auto", "linear", "lora", "all"):
            raise LayerSelectionError(
                f"LayerSelection.kind must be 'auto', 'linear', 'lora' or 'all', got {self.kind!r}"
            )
        supported = self._supported_modules(model)
        chosen = self._by_kind(model, supported)
        chosen = self._by_types(chosen, supported)
        chosen = self._by_regex(chosen)
        chosen = self._by_blocks(model, chosen)
        chosen = self._drop_partially_tied(model, chosen)
        _refuse_dora(model, chosen)
        _refuse_parameter_lora(model, chosen)
        _refuse_inactive_adapters(model, chosen)
        if not chosen:
            trainable = (n for n, p in model.named_parameters() if p.requires_grad)
            kinds = other_peft_tuners(trainable)
            fix = (
                _other_tuners_fix(kinds)
                if kinds
                else "widen include/types/last_n_blocks or pick another kind"
            )
            raise LayerSelectionError(
                f"{self!r} matched no layer of {type(model).__name__}; supported layers there: "
                f"{_preview(supported)}. Fix: {fix}"
            )
        return chosen

    def _supported_modules(self, model: nn.Module) -> dict[str, tuple[nn.Module, LayerAdapter]]:
        found = {}
        for name, module in named_modules(model):
            adapter = self._registry.lookup(module)
            if adapter is None:
                continue
            if self.trainable_only and not adapter.captured_parameters(module):
                continue
            found[name] = (module, adapter)
        return found

    def _by_kind(
        self, model: nn.Module, mods: dict[str, tuple[nn.Module, LayerAdapter]]
    ) -> dict[str, tuple[nn.Module, LayerAdapter]]:
        kind = self.kind
        if kind == "auto":
            kind = "lora" if has_lora(model) else "linear"
        if kind == "all":
            return mods
        if kind == "lora":
            out = {n: v for n, v in mods.items() if is_lora_adapter(n, v[0])}
            if not out:
                raise LayerSelectionError(
                    f"kind='lora' but {type(model).__name__} has no trainable PEFT LoRA "
                    "adapter (lora_A/lora_B); wrap it with peft.get_peft_model first, or use "
                    "kind='linear'"
                )
            return out
        return {n: v for n, v in mods.items() if v[1].family == "linear"}

    def _by_types(
        self,
        mods: dict[str, tuple[nn.Module, LayerAdapter]],
        supported: dict[str, tuple[nn.Module, LayerAdapter]],
    ) -> dict[str, tuple[nn.Module, LayerAdapter]]:
        if not self.types:
            return mods
        wanted = {t if isinstance(t, str) else t.__name__ for t in self.types}
        known = {type(m).__name__ for m, _ in supported.values()}
        registered = set(self._registry.supported())
        unsupported = sorted(
            t
            for t in wanted
            if t not in known
            and t not in registered
            and not any(r.startswith("*") and t.endswith(r[1:]) for r in registered)
        )
        if unsupported:
            raise LayerSelectionError(
                f"no adapter for module type(s) {unsupported}; supported types: "
                f"{self._registry.supported()}. Fix: drop them from types, or register an "
                "adapter with tda_plugins.capture.register_adapter"
            )
        return {
            n: v for n, v in mods.items() if any(c.__name__ in wanted for c in type(v[0]).__mro__)
        }

    def _by_regex(
        self, mods: dict[str, tuple[nn.Module, LayerAdapter]]
    ) -> dict[str, tuple[nn.Module, LayerAdapter]]:
        out = mods
        if self.include is not None:
            pattern = re.compile(self.include)
            out = {n: v for n, v in out.items() if pattern.search(n)}
        if self.exclude is not None:
            pattern = re.compile(self.exclude)
            out = {n: v for n, v in out.items() if not pattern.search(n)}
        return out

    def _by_blocks(
        self, model: nn.Module, mods: dict[str, tuple[nn.Module, LayerAdapter]]
    ) -> dict[str, tuple[nn.Module, LayerAdapter]]:
        if self.last_n_blocks is None:
            return mods
        if self.last_n_blocks < 1:
            raise LayerSelectionError(f"last_n_blocks must be >= 1, got {self.last_n_blocks}")
        lists = [(n, m) for n, m in named_modules(model) if _is_block_list(m)]
        if not lists:
            raise LayerSelectionError(
                f"last_n_blocks={self.last_n_blocks} needs a list of transformer blocks, but "
                f"{type(model).__name__} has no nn.ModuleList or numbered nn.ModuleDict; select "
                "layers by include instead"
            )
        prefix, blocks = max(lists, key=lambda item: len(item[1]))
        first = max(0, len(blocks) - self.last_n_blocks)
        heads = tuple(f"{prefix}.{i}." for i in range(first, len(blocks)))
        return {n: v for n, v in mods.items() if n.startswith(heads)}

    def _drop_partially_tied(
        self, model: nn.Module, mods: dict[str, tuple[nn.Module, LayerAdapter]]
    ) -> dict[str, tuple[nn.Module, LayerAdapter]]:
        owners: dict[int, list[str]] = {}
        for name, module in named_modules(model):
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), []).append(name)
        out = {}
        for name, (module, adapter) in mods.items():
            outside = sorted(
                {o for p in adapter.captured_parameters(module).values() for o in owners[id(p)]}
                - set(mods)
            )
            if not outside:
                out[name] = (module, adapter)
            elif self.include is not None or self.types:
                raise LayerSelectionError(
                    f"{name} shares a parameter with {outside}, which the selection leaves "
                    "out, so its captured gradient would be partial; select both (kind='all' "
                    "or a wider include) or exclude both"
                )
        return out


def uncovered_trainable(
    model: nn.Module, layers: dict[str, tuple[nn.Module, LayerAdapter]]
) -> list[str]:
    """Names of ``model``'s trainable parameters that none of ``layers`` captures (their
    per-example gradients are unknown: data selection cannot correct their ``.grad``)."""
    covered = {
        id(p)
        for module, adapter in layers.values()
        for p in adapter.captured_parameters(module).values()
    }
    return [
        canonical_name(n)
        for n, p in model.named_parameters()
        if p.requires_grad and id(p) not in covered
    ]


#: Parameter names of the PEFT adapter types other than LoRA, which no layer adapter
#: captures: a fragment of the name, and the type.
OTHER_PEFT_TUNERS = {
    ".ia3_l": "IA3",
    ".hada_w": "LoHa",
    ".lokr_w": "LoKr",
    ".lora_E": "AdaLoRA",
    ".vera_lambda_": "VeRA",
}


def other_peft_tuners(names: Iterable[str]) -> list[str]:
    """The PEFT adapter types other than LoRA that parameter ``names`` belong to."""
    names = list(names)
    return sorted(
        {kind for fragment, kind in OTHER_PEFT_TUNERS.items() if any(fragment in n for n in names)}
    )


def _other_tuners_fix(kinds: list[str]) -> str:
    return (
        f"PEFT {' and '.join(kinds)} adapters have no per-example capture (tda-plugins "
        "captures LoRA adapters, LoraConfig, and the layers of full fine-tuning): train "
        "with LoraConfig, or freeze them"
    )


def unadapted_owners(model: nn.Module, missing: Iterable[str]) -> dict[str, list[str]]:
    """Class name -> the parameters ``missing`` names that modules of that class own, for
    the classes no layer adapter captures (a type without one, or a subclass whose
    ``forward`` is its own)."""
    wanted = set(missing)
    owners: dict[str, list[str]] = {}
    for prefix, module in named_modules(model):
        if DEFAULT_REGISTRY.lookup(module) is not None:
            continue
        for local, _ in module.named_parameters(recurse=False):
            name = canonical_name(f"{prefix}.{local}" if prefix else local)
            if name in wanted:
                owners.setdefault(type(module).__name__, []).append(name)
    return owners


def uncovered_fix(model: nn.Module, missing: Iterable[str], fallback: str) -> str:
    """How to cover the trainable parameters ``missing`` names: ``fallback``, unless some
    are PEFT parameters no per-example hook sees: LoRA on an embedding
    (``lora_embedding_A``/``_B``, used raw), trainable tokens (``trainable_token_indices``,
    which TRL's ``SFTTrainer`` sets itself when a cloned chat template adds tokens), or an
    adapter type other than LoRA (:data:`OTHER_PEFT_TUNERS`); or some belong to modules
    that no layer selection can capture (:func:`unadapted_owners`)."""
    missing = list(missing)
    kinds = other_peft_tuners(missing)
    if kinds:
        return _other_tuners_fix(kinds)
    if any(".lora_embedding_" in name for name in missing):
        return (
            "PEFT LoRA on an embedding (lora_embedding_A/B) has no per-example capture: leave "
            "the embedding out of target_modules (or put it in modules_to_save)"
        )
    if any(".trainable_tokens_delta" in name for name in missing):
        return (
            "PEFT trainable tokens (trainable_token_indices) have no per-example capture: "
            "train the embedding whole instead (modules_to_save=['embed_tokens'], captured "
            "with layers='all'), or leave its tokens frozen"
        )
    unadapted = unadapted_owners(model, missing)
    if not unadapted:
        return fallback
    fix = (
        f"no layer type captures {_preview(unadapted, 4)} (no adapter, or a forward of its "
        "own over a supported base class): freeze their parameters, or register an adapter "
        "for the class (tda_plugins.capture.adapters.register_adapter)"
    )
    owned = sum(len(names) for names in unadapted.values())
    return fix if owned == len(set(missing)) else f"{fix}; for the others, {fallback}"


def warn_uncaptured(
    model: nn.Module,
    layers: Mapping[str, tuple[nn.Module, LayerAdapter]],
    what: str,
    fix: str | None = None,
) -> None:
    """Log, once per call, the trainable parameters of ``model`` that ``layers`` leave out:
    ``what`` (the scores, the store) then holds no gradient of theirs. ``fix``: the way
    out to name (default: widen the selection, or freeze them)."""
    missing = uncovered_trainable(model, dict(layers))
    if missing:
        logger.warning(
            "tda-plugins: %d trainable parameters are not captured (%s), so %s leave their "
            "gradients out; %s",
            len(missing),
            _preview(missing, 3),
            what,
            fix or uncovered_fix(model, missing, "capture them with layers='all', or freeze them"),
        )


def _is_block_list(module: nn.Module) -> TypeGuard[nn.ModuleList | nn.ModuleDict]:
    """transformers keep blocks in an ``nn.ModuleList``; OLMo-core in an ``nn.ModuleDict``
    keyed ``"0"``, ``"1"``, ..."""
    if isinstance(module, nn.ModuleList):
        return True
    return (
        isinstance(module, nn.ModuleDict)
        and all(key == str(i) for i, key in enumerate(module.keys()))
        and len(module) > 0
    )


def _preview(names: Iterable[str], limit: int = 6) -> str:
    names = list(names)
    if not names:
        return "none (no module has a registered adapter and trainable parameters)"
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


def shared_parameter_ids(layers: Mapping[str, tuple[nn.Module, LayerAdapter]]) -> set[int]:
    """``id``s of the captured parameters that several of ``layers`` share (tied weights)."""
    owners: dict[int, int] = {}
    for module, adapter in layers.values():
        for p in adapter.captured_parameters(module).values():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {key for key, count in owners.items() if count > 1}


def tied_units(layers: Mapping[str, tuple[nn.Module, LayerAdapter]]) -> dict[str, tuple[str, ...]]:
    """Layer -> the selected layers that share one of its captured parameters (itself
    included, in model order), for every layer that shares one (tied weights)."""
    owners: dict[int, list[str]] = {}
    for name, (module, adapter) in layers.items():
        for p in adapter.captured_parameters(module).values():
            owners.setdefault(id(p), []).append(name)
    units: dict[str, set[str]] = {}
    for names in owners.values():
        if len(names) > 1:
            for name in names:
                units.setdefault(name, set()).update(names)
    order = list(layers)
    return {n: tuple(sorted(u, key=order.index)) for n, u in units.items()}
