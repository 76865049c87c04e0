"""The capture settings in their parts: the flat keyword options the callbacks and
``tda capture`` take mean the composed settings built by hand, names outside them are
refused before anything runs, and ``tda capture``'s defaults are the callbacks'."""

from __future__ import annotations

import dataclasses

import pytest

from tda_plugins.capture import LayerSelection
from tda_plugins.cli import build_parser
from tda_plugins.grads import ProjectionConfig
from tda_plugins.integrations.olmo_core import DataSelectionCallback, InfluenceLoggingCallback
from tda_plugins.session.settings import (
    LAYER_OPTION_NAMES,
    PROJECTION_OPTION_NAMES,
    CaptureSettings,
    LayerSettings,
    StoreSettings,
    layer_settings,
)


def test_flat_options_mean_the_composed_settings() -> None:
    flat = CaptureSettings.from_options(
        store_dir="run/grads",
        keep_tokens=True,
        store_texts=False,
        layers="all",
        exclude="lm_head",
        projection="factor",
        k_a=4,
        k_g=8,
        projection_map="rademacher",
        seed=3,
        curvature=False,
        record_trajectory=True,
    )
    by_hand = CaptureSettings(
        StoreSettings("run/grads", keep_tokens=True, store_texts=False),
        layers=LayerSettings(
            LayerSelection("all", exclude="lm_head"),
            projection=ProjectionConfig("factor", k_a=4, k_g=8, map="rademacher", seed=3),
        ),
        curvature=False,
        record_trajectory=True,
    )
    assert flat == by_hand
    assert CaptureSettings.from_options(store_dir="s") == CaptureSettings(StoreSettings("s"))
    assert layer_settings(projection="dense", k=32) == LayerSettings(
        projection=ProjectionConfig("dense", k=32)
    )


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"k": 4}, r"k \(--k\) given, but projection='none' keeps exact gradients"),
        ({"k_a": 4, "k_g": 4}, r"k_a \(--k-a\), k_g \(--k-g\) given, but projection='none'"),
        ({"projection_map": "sparse_jl"}, r"projection_map \(--map\) given"),
        ({"seed": 7}, r"seed \(--seed\) given"),
        ({"projection": "factor", "k": 4}, r"k \(--k\) given, but projection='factor' takes"),
        ({"projection": "dense", "k_a": 4}, r"k_a \(--k-a\) given, but projection='dense'"),
    ],
)
def test_a_projection_option_its_kind_does_not_use_is_refused(
    options: dict[str, object], named: str
) -> None:
    """Such an option would be dropped without a word (a store with exact gradients, or
    another projection size, than the one asked for): refused, naming keyword and flag."""
    with pytest.raises(ValueError, match=named):
        layer_settings(**options)


def test_projection_options_left_out_take_the_configs_defaults() -> None:
    assert layer_settings(projection="factor") == LayerSettings(projection=ProjectionConfig())
    assert layer_settings(projection="dense", seed=2) == LayerSettings(
        projection=ProjectionConfig("dense", seed=2)
    )
    assert layer_settings().projection is None


def test_layers_takes_a_whole_layer_selection_but_not_beside_its_filters() -> None:
    """``layers=LayerSelection(...)`` (the object the errors and docs name) means that
    selection; a filter given beside it would be dropped silently, so it is refused."""
    chosen = LayerSelection("linear", include="q_proj", last_n_blocks=2)
    assert layer_settings(layers=chosen) == LayerSettings(chosen)
    assert CaptureSettings.from_options(store_dir="s", layers=chosen).layers.selection == chosen
    with pytest.raises(TypeError, match=r"\['exclude'\] are given too; put them in the"):
        layer_settings(layers=chosen, exclude="lm_head")


def test_unknown_or_missing_options_are_refused_with_the_known_ones() -> None:
    with pytest.raises(TypeError, match=r"unknown capture options \['layerz'\].*'layers'"):
        CaptureSettings.from_options(store_dir="s", layerz="all")
    with pytest.raises(TypeError, match="need store_dir"):
        CaptureSettings.from_options(layers="all")
    # a store-less capture (live influence, a selection pool) takes no store option
    with pytest.raises(TypeError, match=r"unknown layer options \['keep_tokens'\].*'layers'"):
        layer_settings(keep_tokens=True)


def test_tda_capture_takes_the_callbacks_options_with_their_defaults() -> None:
    args = build_parser().parse_args(["capture", "--model", "m", "--data", "d", "--out", "o"])
    names = LAYER_OPTION_NAMES | PROJECTION_OPTION_NAMES
    assert names <= set(vars(args))
    assert layer_settings(**{n: getattr(args, n) for n in names}) == layer_settings()
    changed = build_parser().parse_args(
        ["capture", "--model", "m", "--data", "d", "--out", "o", "--map", "sparse_jl"]
    )
    assert changed.projection_map == "sparse_jl"


def test_olmo_core_callbacks_take_the_same_option_names() -> None:
    influence = {f.name for f in dataclasses.fields(InfluenceLoggingCallback)}
    assert influence >= LAYER_OPTION_NAMES | PROJECTION_OPTION_NAMES
    selection = {f.name: f for f in dataclasses.fields(DataSelectionCallback)}
    assert set(LAYER_OPTION_NAMES) <= set(selection)
    assert not PROJECTION_OPTION_NAMES & set(selection)  # selection captures exact gradients
    assert selection["layers"].default == "all"  # a full OLMo-core model, every parameter
    assert all(selection[n].kw_only for n in LAYER_OPTION_NAMES)
