"""``curvature="auto"`` (the default): K-FAC statistics only where they are cheap.

The threshold is lowered around a tiny model's own statistics, so one model shows both
sides; ``curvature=True`` and ``False`` override it either way.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import tda_plugins
from tda_plugins.precondition.snapshots import latest_set
from tda_plugins.session import capture as session
from tda_plugins.session.capture import capture_plan
from tda_plugins.session.settings import CaptureSettings
from tests.models import tiny_causal_lm
from tests.trainers import token_rows

ROWS = [{"input_ids": r} for r in token_rows(4)]


def _capture(tmp_path: Path, **options: object) -> bool:
    """Capture ROWS; whether the store got K-FAC statistics."""
    out = tmp_path / "store"
    tda_plugins.capture_examples(tiny_causal_lm("llama"), ROWS, out, progress=False, **options)
    return latest_set(out) is not None


@pytest.fixture
def need() -> int:
    """The tiny model's statistics bytes."""
    plan = capture_plan(CaptureSettings.from_options(store_dir=""), tiny_causal_lm("llama"))
    return plan.statistics_bytes()


@pytest.mark.parametrize(
    ("threshold_offset", "curvature", "expected"),
    [(0, "auto", True), (-1, "auto", False), (-1, True, True), (0, False, False)],
)
def test_auto_keeps_statistics_up_to_the_threshold(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    need: int,
    threshold_offset: int,
    curvature: object,
    expected: bool,
) -> None:
    monkeypatch.setattr(session, "AUTO_CURVATURE_BYTES", need + threshold_offset)
    with caplog.at_level(logging.INFO, logger="tda_plugins.session.capture"):
        assert _capture(tmp_path, curvature=curvature) is expected
    said = {"auto": "turns them on" if expected else "turns them off", True: "keeps them"}
    logged = [r for r in caplog.records if "K-FAC statistics take" in r.getMessage()]
    if curvature is False:
        assert not logged
        return
    (record,) = logged
    assert said[curvature] in record.getMessage()  # type: ignore[index]
    # over the threshold it is a warning, whether the statistics are dropped or kept
    over = threshold_offset < 0
    assert record.levelno == (logging.WARNING if over else logging.INFO)
