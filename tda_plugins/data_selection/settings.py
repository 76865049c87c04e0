"""What an online data selection run does: one dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tda_plugins.capture.layers import LayerSelection, SelectionKind
from tda_plugins.data_selection.rules import DropRule, rule_by_name
from tda_plugins.grads.projection import ProjectionConfig

ScoreMode = Literal["dot", "cosine", "adam"]
Granularity = Literal["global", "per_layer"]


@dataclass(frozen=True)
class SelectionSettings:
    """Online data selection settings, shared by every trainer integration.

    Every field has a default; :meth:`__post_init__` refuses a bad value with the fix, so a
    callback built from them fails at construction, before any training.
    """

    rule: str = "bottom_fraction"
    """``"bottom_fraction"``, ``"threshold"`` or ``"negative_in_bottom"`` (registered rules)."""
    fraction: float = 0.25
    """Share of a step's examples the fraction rules consider, in ``[0, 1)``."""
    threshold: float = 0.0
    """Score below which ``"threshold"`` drops."""
    score: ScoreMode = "dot"
    """``"dot"`` ``<g_i, T>``, ``"cosine"``, or ``"adam"`` ``<g_i, T / (sqrt(v_hat) + eps)>``."""
    granularity: Granularity = "global"
    """``"global"``: one kept set; ``"per_layer"``: each layer keeps its own best examples."""
    refresh_every: int = 1
    """Recompute the target gradient every n optimizer steps (and at a run's first step)."""
    target_examples: int | None = None
    """Target examples per refresh: ``None`` the whole pool, ``m`` the next ``m`` in turn."""
    score_projection: int | None = None
    """``k``: approximate scores in a ``k x k`` factor-projected space per layer (removal
    stays exact; not with ``score="adam"``); ``None``: exact scores."""
    log_path: str | None = None
    """JSONL receiving one line per optimizer step (``None``: the trainer's output folder)."""
    layers: SelectionKind = "auto"
    """Captured layers: ``"auto"``, ``"linear"``, ``"lora"`` or ``"all"``; every trainable
    parameter must belong to one (checked before step 0)."""
    include: str | None = None
    """Regex: keep only the layers whose module name matches."""
    exclude: str | None = None
    """Regex: drop the layers whose module name matches."""
    last_n_blocks: int | None = None
    """Keep only the layers in the last N transformer blocks."""

    def __post_init__(self) -> None:
        self.drop_rule()  # unknown rule, fraction outside [0, 1): refused with the known ones
        if self.score not in ("dot", "cosine", "adam"):
            raise ValueError(f"score must be 'dot', 'cosine' or 'adam', got {self.score!r}")
        if self.granularity not in ("global", "per_layer"):
            raise ValueError(
                f"granularity must be 'global' or 'per_layer', got {self.granularity!r}"
            )
        if self.refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {self.refresh_every}")
        if self.target_examples is not None and self.target_examples < 1:
            raise ValueError(f"target_examples must be >= 1 or None, got {self.target_examples}")
        if self.score_projection is not None:
            if self.score_projection < 1:
                raise ValueError(f"score_projection must be >= 1, got {self.score_projection}")
            if self.score == "adam":
                raise ValueError(
                    "score_projection needs score 'dot' or 'cosine' (Adam preconditions each "
                    "parameter, which a projection mixes); drop score_projection or the adam score"
                )
        if self.layers not in ("auto", "linear", "lora", "all"):
            raise ValueError(
                f"layers must be 'auto', 'linear', 'lora' or 'all', got {self.layers!r}"
            )

    def drop_rule(self) -> DropRule:
        """The rule instance (``threshold`` for the threshold rule, else ``fraction``)."""
        if self.rule == "threshold":
            return rule_by_name(self.rule, value=self.threshold)
        return rule_by_name(self.rule, fraction=self.fraction)

    def projection(self) -> ProjectionConfig | None:
        """The factor projection scores are taken in (``None``: exact scores)."""
        if self.score_projection is None:
            return None
        k = self.score_projection
        return ProjectionConfig("factor", k_a=k, k_g=k)

    def layer_selection(self) -> LayerSelection:
        return LayerSelection(
            kind=self.layers,
            include=self.include,
            exclude=self.exclude,
            last_n_blocks=self.last_n_blocks,
        )
