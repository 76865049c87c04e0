"""Unrolled AdamW influence: AdamW-influence with each later step's curvature, from the
per-example gradients the store already holds for that step (no replay, no model).

AdamW-influence (:mod:`tda_plugins.methods.adamw_influence`) holds every later gradient
at its recorded value. Here removing ``z`` also moves the weights every later step
computes its gradient at, and that step's gradient moves with them by its Hessian
``H_s``, approximated by the empirical Fisher of the step's own examples (their stored
gradients ``g_i`` of their summed losses, ``s_i`` their loss scales):

    H_s v ~= curvature * sum_{i in s} g_i (g_i . v) / s_i

Reverse pass (``docs/design.md`` section 7.9.1), ``lambda_T = g_q`` at the final weights:

    Q_t      = scale_t lambda_{t+1} + carry_{t+1} Q_{t+1}
    score_i  = c_t / s_i < intake_t Q_t , g_i >                  (i trained at step t)
    lambda_t = decay_t lambda_{t+1} - curvature * sum_{i in t} g_i score_i

(``curvature = 0``: AdamW-influence exactly.) The Fisher term reuses the step's scores,
so the pass costs AdamW-influence's plus one ``(M, B) x (B, D)`` product per step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tda_plugins.grads.base import PerExampleGrad
from tda_plugins.grads.blocks import spans
from tda_plugins.methods.adamw_influence import AdamWInfluence, _LayerSweep
from tda_plugins.methods.base import QUERY_CACHE_BYTES, register_method
from tda_plugins.store.reader import StoreReader
from tda_plugins.trajectory.reader import TrajectoryReader


@register_method("adamw_unrolled")
class AdamWUnrolled(AdamWInfluence):
    """AdamW-influence carried through the later steps with their curvature (the
    empirical Fisher of each step's stored per-example gradients, every captured layer
    together).

    Args:
        damping: unused; accepted for the common method signature.
        curvature: the factor on each step's empirical Fisher (0: ``adamw_influence``).
            An example's stored gradient sums its ``T`` token gradients, so ``g g^T``
            counts the per-token Fisher once where the tokens' gradients are independent
            (factor 1) and ``T`` times where they all agree (factor ``1 / T``); the
            default 0.1 lies between, and is the value the fidelity benchmark favours on
            both of its replicas (chosen there, not derived: ``docs/design.md`` 7.9.1).
    """

    curvature: float = 0.1

    def __init__(self, damping: float = 0.1, curvature: float | None = None, **groups: Any):
        super().__init__(damping, **groups)
        if curvature is not None:
            if not curvature >= 0:
                raise ValueError(f"curvature must be >= 0 (a Fisher factor), got {curvature}")
            self.curvature = curvature

    def _absorb(
        self, sweeps: dict[str, _LayerSweep], grads: dict[str, PerExampleGrad], scores: Tensor
    ) -> None:
        """``lambda -= curvature * sum_i g_i score_i`` for a chunk of the step's examples:
        ``(B, D)`` gradients per layer, ``(B, M)`` scores."""
        for name, part in grads.items():
            adjoint = sweeps[name].adjoint
            weights = scores.T.to(adjoint.dtype)
            adjoint.addmm_(weights, part.materialize().to(adjoint.dtype), alpha=-self.curvature)

    def _blocks(
        self, trajectory: TrajectoryReader, queries: StoreReader, store: StoreReader
    ) -> list[tuple[list[str], slice]]:
        """Every layer in one block (the Fisher couples them), the queries in ranges
        whose adjoints, sides and scored sides fit :data:`QUERY_CACHE_BYTES`."""
        itemsize = torch.empty((), dtype=store.values_dtype()).element_size()
        layers = list(trajectory.layers)
        width = sum(trajectory.entry_parameters(name).numel() for name in layers)
        per_query = 3 * width * itemsize
        step = max(1, QUERY_CACHE_BYTES // per_query)
        return [(layers, rows) for rows in spans(queries.num_examples, step)]
