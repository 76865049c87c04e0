"""Which curvature the unrolled AdamW reverse pass needs: a probe on the fidelity replicas.

The reverse pass of ``adamw_unrolled`` (``docs/design.md`` 7.9.1), written here directly
in parameter space on a replay of the run (each step's weights and Adam second moment
kept), with the curvature of each step's batch loss chosen by ``--curvature``:

* ``none``: no curvature (``adamw_influence``);
* ``fisher``: ``rho sum_i g_i (g_i . v) / s_i`` from per-example gradients (``--rho``;
  with ``--params conv`` this is ``adamw_unrolled`` itself, an independent check of it);
* ``exact``: the Hessian of the step's batch loss, by double-backward Hessian-vector
  products on the replayed weights (needs the model at every step: not a store method).
* ``ggn``: its Gauss-Newton part ``J^T (diag(p) - p p^T) J`` (the network linearized,
  the softmax's curvature kept; the curvature K-FAC approximates with sampled labels),
  by a forward-mode product through the logits and a backward (same needs as ``exact``).
* ``token-fisher``: the empirical Fisher of the step's token losses,
  ``sum_{i,t} l_it' (l_it' . v)`` (each predicted token's own gradient, no ``rho``): the
  per-example Fisher without its cross-token terms, whose expectation under the model is 0.
* ``position-fisher``: what a store of per-token factors holds: each Conv1D's gradient
  split by the position of its input and output, ``sum_{i,t} G_it (G_it . v)`` with
  ``G_it = a_it g_it^T`` over the kept layers' weights together, the biases left out
  (``--params conv`` only): a key bias's position parts do not vanish (only their sum
  does), and Adam's ``1 / eps`` scale on its zero gradient then makes the pass diverge.
* ``block-position-fisher``: the same, each layer alone (its block of the matrix: no
  product couples two layers);
* ``kfac`` / ``ekfac``: that block as the step's Kronecker factors (SOURCE-style, one
  segment per step, fitted at the step's own weights): ``A V G / N`` with ``A`` and
  ``G`` the sums of ``a a^T`` and ``g g^T`` over the step's ``N`` positions; EK-FAC in
  the factors' eigenbases with each entry's eigenvalue refitted from the positions.

``--params conv``: the Conv1D layers the benchmark's stores capture; ``all``: every
trained parameter. Leave-one-out Spearman on the first ``--queries`` of the
metagradient's validation blocks (the exact Hessian costs one HVP per query and step).

Usage::

    PYTHONPATH=. HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python \\
        benchmarks/fidelity_curvature_probe.py --replica pretrained --params conv \\
        --curvature exact --queries 4
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from tempfile import TemporaryDirectory

import fidelity_trajectory
import torch
import transformers
from fidelity import make_task
from fidelity_metric import GroundTruth
from fidelity_training import train
from fidelity_truth import (
    CACHE,
    REPLICAS,
    FineTuning,
    leave_one_out,
    prepare,
    replica,
    subset_runs,
)
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp, vmap

from tda_plugins import causal_lm_example_losses

Params = dict[str, Tensor]
#: ``f(params, ids)``: the model's logits or its summed loss at ``params``.
Model = Callable[[Params, Tensor], Tensor]


def replayed(fine: FineTuning, model: nn.Module) -> tuple[list[Params], list[Params], dict]:
    """Replay the run on ``model``: the weights before each step, the second moment after
    it, and the optimizer's hyperparameters (one group's lr/betas/eps; decay per name)."""
    optimizer = fine.config.adamw.optimizer(model)
    thetas: list[Params] = []
    moments: list[Params] = []

    def before(step: int, m: nn.Module) -> None:
        thetas.append({n: p.detach().clone() for n, p in m.named_parameters()})

    def after(step: int, m: nn.Module) -> None:
        state = optimizer.state
        moments.append({n: state[p]["exp_avg_sq"].clone() for n, p in m.named_parameters()})

    train(fine.config, fine.blocks, model, hook=before, after_update=after, optimizer=optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    group = optimizer.param_groups[0]
    decay = {names[id(p)]: g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    return (
        thetas,
        moments,
        {"lr": group["lr"], "betas": group["betas"], "eps": group["eps"], "decay": decay},
    )


def gauss_newton(logits_of: Model, at: Params, tangent: Params, ids: Tensor) -> tuple[Tensor, ...]:
    """``G u`` for the batch's summed next-token loss: ``J^T H_z J u`` with ``J`` the
    ``(B, T, V)`` logits' Jacobian at ``at`` and ``H_z = diag(p) - p p^T`` per predicting
    position (the last position predicts nothing)."""
    leaves = {n: x.detach().requires_grad_() for n, x in at.items()}
    _, moved = jvp(lambda p: logits_of(p, ids), (dict(at),), (tangent,))
    logits = logits_of(leaves, ids)
    probs = logits.detach().softmax(-1)
    curved = probs * moved - probs * (probs * moved).sum(-1, keepdim=True)
    curved[:, -1] = 0
    return torch.autograd.grad(logits, list(leaves.values()), curved)


def token_losses(logits: Tensor, ids: Tensor) -> Tensor:
    """``(B, T - 1)`` next-token cross-entropy of each predicted token."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
    ).view(ids.shape[0], -1)


def token_fisher(logits_of: Model, at: Params, tangent: Params, ids: Tensor) -> tuple[Tensor, ...]:
    """``sum_{i,t} grad l_it (grad l_it . u)`` over the batch's predicted tokens."""
    leaves = {n: x.detach().requires_grad_() for n, x in at.items()}
    _, dots = jvp(lambda p: token_losses(logits_of(p, ids), ids), (dict(at),), (tangent,))
    losses = token_losses(logits_of(leaves, ids), ids)
    return torch.autograd.grad(losses, list(leaves.values()), dots)


def layer_parts(
    model: nn.Module, loss, at: Params, ids: Tensor
) -> dict[str, tuple[Tensor, Tensor]]:
    """Each kept Conv1D's ``(N, in)`` inputs and ``(N, out)`` output gradients of the
    batch's summed loss at ``at``, over its ``N = B T`` positions."""
    layers = sorted({n.rsplit(".", 1)[0] for n in at})
    inputs: dict[str, Tensor] = {}
    outputs: dict[str, Tensor] = {}

    def keep(name: str):
        def hook(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            inputs[name], outputs[name] = args[0].detach(), out

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n in layers]
    try:
        total = loss({n: x.detach().requires_grad_() for n, x in at.items()}, ids)
    finally:
        for h in handles:
            h.remove()
    grads = torch.autograd.grad(total, [outputs[n] for n in layers])
    return {
        n: (inputs[n].flatten(0, 1).double(), g.flatten(0, 1).double())
        for n, g in zip(layers, grads, strict=True)
    }


def position_fisher(parts: dict[str, tuple[Tensor, Tensor]], tangent: Params) -> Params:
    """``sum_n G_n (G_n . u)`` with ``G_n = a_n g_n^T`` every kept Conv1D's weight
    gradient part of position ``n`` (one dot over all the layers together)."""
    dots = sum(((a @ tangent[f"{n}.weight"].double()) * g).sum(-1) for n, (a, g) in parts.items())
    return {f"{n}.weight": (a.T @ (dots[:, None] * g)).float() for n, (a, g) in parts.items()}


def block_position_fisher(parts: dict[str, tuple[Tensor, Tensor]], tangent: Params) -> Params:
    """:func:`position_fisher` with each layer's dot alone (block-diagonal)."""
    return {
        n: x for name, p in parts.items() for n, x in position_fisher({name: p}, tangent).items()
    }


class Kronecker:
    """One step's Kronecker factors per layer, ``A = sum a a^T`` and ``G = sum g g^T``
    over its ``N`` positions; for EK-FAC also their eigenbases and the refitted
    eigenvalues ``sum_n (Q_A^T a_n)^2 (Q_G^T g_n)^2^T`` (``(in, out)``), made on first use."""

    def __init__(self, parts: dict[str, tuple[Tensor, Tensor]]):
        self.parts = parts
        self.factors = {n: (a.T @ a, g.T @ g) for n, (a, g) in parts.items()}
        self.eigen: dict[str, tuple[Tensor, Tensor, Tensor]] = {}

    def kfac(self, tangent: Params) -> Params:
        """``A V G / N`` per layer."""
        return {
            f"{n}.weight": (
                a @ tangent[f"{n}.weight"].double() @ g / self.parts[n][0].shape[0]
            ).float()
            for n, (a, g) in self.factors.items()
        }

    def ekfac(self, tangent: Params) -> Params:
        """``Q_A ((Q_A^T V Q_G) * refit) Q_G^T`` per layer."""
        if not self.eigen:
            for n, (a_factor, g_factor) in self.factors.items():
                qa = torch.linalg.eigh(a_factor).eigenvectors
                qg = torch.linalg.eigh(g_factor).eigenvectors
                a, g = self.parts[n]
                self.eigen[n] = (qa, qg, ((a @ qa) ** 2).T @ ((g @ qg) ** 2))
        out = {}
        for n, (qa, qg, refit) in self.eigen.items():
            v = tangent[f"{n}.weight"].double()
            out[f"{n}.weight"] = (qa @ ((qa.T @ v @ qg) * refit) @ qg.T).float()
        return out


#: The curvatures computed from the step's per-position layer parts: ``parts`` to
#: ``u -> C u`` (weights only).
POSITIONAL: dict[str, Callable[[dict[str, tuple[Tensor, Tensor]]], Callable[[Params], Params]]] = {
    "position-fisher": lambda parts: partial(position_fisher, parts),
    "block-position-fisher": lambda parts: partial(block_position_fisher, parts),
    "kfac": lambda parts: Kronecker(parts).kfac,
    "ekfac": lambda parts: Kronecker(parts).ekfac,
}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replica", choices=list(REPLICAS), default="pretrained")
    p.add_argument("--params", choices=["conv", "all"], default="conv")
    p.add_argument(
        "--curvature",
        choices=["none", "fisher", "exact", "ggn", "token-fisher", *POSITIONAL],
        default="exact",
    )
    p.add_argument("--rho", type=float, default=0.1, help="Fisher factor")
    p.add_argument("--queries", type=int, default=4)
    p.add_argument("--cache", type=Path, default=CACHE, help="the cached training runs")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    chosen = replica(args.replica)
    fine = prepare(chosen, args.cache)
    loo, subsets = leave_one_out(fine, args.cache, 1), subset_runs(fine, args.cache, 1)
    truth = GroundTruth(loo, fine.blocks.removed, subsets, chosen.config.bootstrap)
    with TemporaryDirectory() as work:
        task = make_task(fine, Path(work))
    model = fine.model()
    thetas, moments, hyper = replayed(fine, model)
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.set_attn_implementation("eager")  # double backward through attention
    kept = [n for n in final if args.params == "all" or (".attn." in n or ".mlp." in n)]
    lr, (b1, b2), eps = hyper["lr"], hyper["betas"], hyper["eps"]
    frozen: Params = dict(final)

    def logits_of(params: Params, ids: Tensor) -> Tensor:
        return functional_call(model, {**frozen, **params}, (ids,)).logits

    def loss(params: Params, ids: Tensor) -> Tensor:
        return causal_lm_example_losses(logits_of(params, ids), ids).sum()

    chosen_blocks = fidelity_trajectory.meta_queries(task)[: args.queries]
    val = task.validation[chosen_blocks]
    tokens = val.shape[1] - 1
    adjoints = [grad(loss)({n: final[n] for n in kept}, val[q : q + 1]) for q in range(len(val))]
    for a in adjoints:
        for n in kept:
            a[n] = a[n] / tokens
    sides = [{n: torch.zeros_like(final[n]) for n in kept} for _ in adjoints]
    scores = torch.zeros(len(val), task.train.shape[0], dtype=torch.float64)
    for t in reversed(range(len(task.run.batches))):
        k = t + 1
        frozen = dict(thetas[t])
        at = {n: thetas[t][n] for n in kept}
        scale = {
            n: lr / (1 - b1**k) / (moments[t][n].sqrt() / (1 - b2**k) ** 0.5 + eps) for n in kept
        }
        rows = task.run.batches[t]
        ids = task.train[rows]
        norm = ids.shape[0] * tokens
        if args.curvature in POSITIONAL:
            positional = POSITIONAL[args.curvature](layer_parts(model, loss, at, ids))
        per_example = vmap(grad(lambda p, x: loss(p, x[None])), in_dims=(None, 0))(at, ids)
        for q, (adjoint, side) in enumerate(zip(adjoints, sides, strict=True)):
            for n in kept:
                side[n] = b1 * side[n] + scale[n] * adjoint[n]
            dots = sum(
                per_example[n].flatten(1).double() @ ((1 - b1) * side[n]).flatten().double()
                for n in kept
            )
            step_scores = dots / norm
            scores[q, rows] += step_scores
            for n in kept:
                adjoint[n] = adjoint[n] * (1 - lr * hyper["decay"][n])
            if args.curvature == "fisher":
                for n in kept:
                    moved = step_scores.float() @ per_example[n].flatten(1)
                    adjoint[n] = adjoint[n] - args.rho * moved.view_as(adjoint[n])
            elif args.curvature == "exact":
                leaves = {n: at[n].detach().requires_grad_() for n in kept}
                first = torch.autograd.grad(
                    loss(leaves, ids) / norm, list(leaves.values()), create_graph=True
                )
                direction = sum(
                    ((1 - b1) * (f * side[n])).sum() for f, n in zip(first, kept, strict=True)
                )
                hvp = torch.autograd.grad(-direction, list(leaves.values()))
                for n, h in zip(kept, hvp, strict=True):
                    adjoint[n] = adjoint[n] + h
            elif args.curvature == "token-fisher":
                tangent = {n: (1 - b1) * side[n] for n in kept}
                for n, g in zip(kept, token_fisher(logits_of, at, tangent, ids), strict=True):
                    adjoint[n] = adjoint[n] - g / norm
            elif args.curvature in POSITIONAL:
                tangent = {n: (1 - b1) * side[n] for n in kept}
                for n, g in positional(tangent).items():
                    adjoint[n] = adjoint[n] - g / norm
            elif args.curvature == "ggn":
                tangent = {n: (1 - b1) * side[n] for n in kept}
                for n, g in zip(kept, gauss_newton(logits_of, at, tangent, ids), strict=True):
                    adjoint[n] = adjoint[n] - g / norm
        size = sum(float(a.norm() ** 2) for a in adjoints[0].values()) ** 0.5
        print(f"step {t} done, first query's adjoint norm {size:.3g}", flush=True)
    full = torch.full(
        (task.validation.shape[0], task.train.shape[0]), float("nan"), dtype=torch.float64
    )
    full[chosen_blocks] = scores
    found = truth.leave_one_out(f"{args.params},{args.curvature}", full)
    per = [round(x, 3) for x in found.per_query[chosen_blocks].tolist()]
    print(f"{args.replica} {args.params} {args.curvature}: mean {found.mean:.3f} per block {per}")


if __name__ == "__main__":
    main(sys.argv[1:])
