"""What an online data selection run does: one dataclass, validated once."""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Literal

from tda_plugins.capture.layers import LayerSelection
from tda_plugins.data_selection.rules import RULES, DropRule, RankedRule, rule_by_name
from tda_plugins.grads.projection import ProjectionConfig

ScoreMode = Literal["dot", "cosine", "adam", "loss"]
#: The scores that compare an example's gradient with the target's (they need a target).
GRADIENT_SCORES = ("dot", "cosine", "adam")
#: ``refresh_every=None``: the target's examples per optimizer step, on average, as a share
#: of the step's own (its forward and backward cost about as much per example).
TARGET_SHARE = 1 / 8
Granularity = Literal["global", "per_layer"]


#: The rule options of :class:`SelectionSettings`, by the rule constructor's parameter.
_RULE_PARAMETERS = {
    "fraction": "fraction",
    "seed": "seed",
    "threshold": "value",
    "margin": "margin",
}


@dataclass(frozen=True)
class SelectionSettings:
    """Online data selection settings, shared by every trainer integration.

    Every field has a default; :meth:`__post_init__` refuses a bad value with the fix, so a
    callback built from them fails at construction, before any training.
    """

    rule: str = "step_cosine"
    """A registered rule: ``"bottom_fraction"``, ``"top_fraction"``, ``"random"``,
    ``"threshold"``, ``"negative_in_bottom"`` or ``"step_cosine"`` (it reads the Gram
    matrix of the global batch's gradients: data-parallel ranks gather every example's
    gradient for it)."""
    fraction: float = 0.25
    """Share of a step's examples the fraction rules consider, in ``[0, 1)``."""
    threshold: float = 0.0
    """Score below which ``"threshold"`` drops."""
    seed: int = 0
    """Seed of the ``"random"`` rule's draws."""
    margin: float = 0.01
    """``"step_cosine"``: drop an example only if that raises the step's cosine with the
    target by more than this share of it."""
    drop_counts: tuple[int, ...] | None = None
    """Replay: at optimizer step ``k`` drop exactly ``drop_counts[k]`` examples, in the
    order of a ranked rule (``bottom_fraction``, ``top_fraction``, ``random``), e.g. the
    ``dropped`` column of another run's ``selection.jsonl``, so that a baseline keeps as many
    examples per step as that run; ``None``: the rule's own count."""
    score: ScoreMode = "adam"
    """``"dot"`` ``<g_i, T>``, ``"cosine"``, ``"adam"`` ``<g_i, T / (sqrt(v_hat) + eps)>``
    (``v_hat`` of the step Adam is about to take: this step's gradient folded in), or
    ``"loss"``: minus the example's mean token loss in the training forward (no target:
    ``bottom_fraction`` drops the highest losses, ``top_fraction`` the lowest)."""
    granularity: Granularity = "global"
    """``"global"``: one kept set; ``"per_layer"``: each layer keeps its own best examples."""
    refresh_every: int | None = None
    """Recompute the target gradient every n optimizer steps (and at a run's first step);
    ``None``: every ``ceil(m / (TARGET_SHARE * B))`` steps for ``m`` examples per refresh
    and ``B`` per optimizer step, so that the target's forward and backward average at
    most :data:`TARGET_SHARE` of the training examples' (at ``m = 16``, ``B = 8``: every 16
    steps)."""
    target_examples: int | None = None
    """Target examples per refresh: ``None`` the whole pool, ``m`` the next ``m`` in turn."""
    score_projection: int | None = None
    """``k``: approximate scores in a ``k x k`` factor-projected space per layer (removal
    stays exact; not with ``score="adam"``); ``None``: exact scores."""
    log_path: str | None = None
    """JSONL receiving one line per optimizer step (``None``: the trainer's output folder)."""
    layers: LayerSelection = field(default_factory=LayerSelection)
    """The captured layers (exact gradients: scores are projected by ``score_projection``
    alone; default ``"auto"``); every trainable parameter must belong to one (checked
    before step 0)."""

    def __post_init__(self) -> None:
        self.drop_rule()  # unknown rule, fraction outside [0, 1): refused with the known ones
        self._refuse_unread()
        if self.score not in (*GRADIENT_SCORES, "loss"):
            raise ValueError(f"score must be 'dot', 'cosine', 'adam' or 'loss', got {self.score!r}")
        if self.granularity not in ("global", "per_layer"):
            raise ValueError(
                f"granularity must be 'global' or 'per_layer', got {self.granularity!r}"
            )
        if self.drop_rule().needs_gram and (self.score == "loss" or self.granularity != "global"):
            raise ValueError(
                f"rule {self.rule!r} weighs the step's gradients together: it needs score "
                "'dot', 'cosine' or 'adam' and granularity='global'"
            )
        if self.score == "loss" and self.granularity == "per_layer":
            raise ValueError(
                "score='loss' is one number per example, not per layer; use granularity='global'"
            )
        if self.drop_counts is not None:
            object.__setattr__(self, "drop_counts", tuple(self.drop_counts))
            if any(int(c) != c or c < 0 for c in self.drop_counts):
                raise ValueError(f"drop_counts must be counts >= 0, got {self.drop_counts}")
            if not isinstance(self.drop_rule(), RankedRule):
                raise ValueError(
                    f"drop_counts needs a ranked rule (bottom_fraction, top_fraction, random) "
                    f"to say which examples to drop; {self.rule!r} decides its own count"
                )
        if self.refresh_every is not None and self.refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {self.refresh_every}")
        if self.target_examples is not None and self.target_examples < 1:
            raise ValueError(f"target_examples must be >= 1 or None, got {self.target_examples}")
        if self.score_projection is not None:
            if self.score_projection < 1:
                raise ValueError(f"score_projection must be >= 1, got {self.score_projection}")
            if self.score not in ("dot", "cosine"):
                raise ValueError(
                    "score_projection needs score 'dot' or 'cosine' (Adam preconditions each "
                    "parameter, which a projection mixes; a loss has no gradient to project); "
                    f"drop score_projection or the {self.score} score"
                )
        if self.layers.kind not in ("auto", "linear", "lora", "all"):
            raise ValueError(
                f"layers must be 'auto', 'linear', 'lora' or 'all', got {self.layers.kind!r}"
            )

    @property
    def needs_target(self) -> bool:
        """Whether the score compares gradients with a target (every score but ``loss``)."""
        return self.score in GRADIENT_SCORES

    def refresh_interval(self, target_examples: int, step_examples: int) -> int:
        """Steps between target refreshes: :attr:`refresh_every`, or for ``None`` the
        interval that keeps ``target_examples`` per refresh within :data:`TARGET_SHARE` of
        ``step_examples`` per optimizer step (the global batch)."""
        if self.refresh_every is not None:
            return self.refresh_every
        return max(1, math.ceil(target_examples / (TARGET_SHARE * max(step_examples, 1))))

    def _refuse_unread(self) -> None:
        """Refuse an option set away from its default that the rule or the score never
        reads (it would be dropped without a word)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        taken = self._rule_parameters()
        unread = [
            name
            for name, parameter in _RULE_PARAMETERS.items()
            if getattr(self, name) != defaults[name] and parameter not in taken
        ]
        if self.score == "loss":
            unread += [n for n in ("refresh_every", "target_examples") if getattr(self, n)]
        if unread:
            reads = sorted(n for n, p in _RULE_PARAMETERS.items() if p in taken)
            raise ValueError(
                f"{unread} set, but rule {self.rule!r} with score {self.score!r} never reads "
                f"them (the rule reads {reads or 'none of the rule options'}; score='loss' "
                "no target); leave them out"
            )

    def drop_rule(self) -> DropRule:
        """The rule instance, given the settings its constructor takes (``fraction``,
        ``seed``, ``margin``, and ``threshold`` as the threshold rule's ``value``)."""
        if self.rule not in RULES:
            return rule_by_name(self.rule)  # refused, naming the known rules
        given = {parameter: getattr(self, name) for name, parameter in _RULE_PARAMETERS.items()}
        taken = self._rule_parameters()
        return rule_by_name(self.rule, **{k: v for k, v in given.items() if k in taken})

    def _rule_parameters(self) -> set[str]:
        """The parameters the rule's constructor takes (none for an unknown rule)."""
        return set(inspect.signature(RULES[self.rule]).parameters) if self.rule in RULES else set()

    def projection(self) -> ProjectionConfig | None:
        """The factor projection scores are taken in (``None``: exact scores)."""
        if self.score_projection is None:
            return None
        k = self.score_projection
        return ProjectionConfig("factor", k_a=k, k_g=k)
