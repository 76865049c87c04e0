"""The curvature products of ``benchmarks/fidelity_curvature_probe.py`` against explicit
fp64 constructions on a two-layer toy language model (its figures are quoted in
docs/design.md 7.9.1)."""

import sys
from pathlib import Path

import torch
from torch import Tensor
from torch.autograd.functional import jacobian

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from fidelity_curvature_probe import gauss_newton, token_fisher, token_losses

VOCAB, WIDTH, HIDDEN = 5, 3, 4
Params = dict[str, Tensor]


def toy() -> tuple[Params, Params, Tensor, Tensor]:
    """Weights, a tangent, an embedding table and ``(2, 4)`` token ids."""
    gen = torch.Generator().manual_seed(0)

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    params = {"w1": draw(WIDTH, HIDDEN), "w2": draw(HIDDEN, VOCAB)}
    tangent = {"w1": draw(WIDTH, HIDDEN), "w2": draw(HIDDEN, VOCAB)}
    ids = torch.randint(0, VOCAB, (2, 4), generator=gen)
    return params, tangent, draw(VOCAB, WIDTH), ids


def flat(params: Params) -> Tensor:
    return torch.cat([params["w1"].flatten(), params["w2"].flatten()])


def unflat(vector: Tensor) -> Params:
    cut = WIDTH * HIDDEN
    return {"w1": vector[:cut].view(WIDTH, HIDDEN), "w2": vector[cut:].view(HIDDEN, VOCAB)}


def test_gauss_newton_is_j_transpose_softmax_hessian_j() -> None:
    params, tangent, table, ids = toy()

    def logits_of(p: Params, x: Tensor) -> Tensor:
        return torch.tanh(table[x] @ p["w1"]) @ p["w2"]

    # (B, T, V, D) Jacobian of the logits; the last position predicts nothing
    jac = jacobian(lambda v: logits_of(unflat(v), ids), flat(params))
    want = torch.zeros_like(flat(params))
    probs = logits_of(params, ids).softmax(-1)
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            p = probs[b, t]
            curvature = torch.diag(p) - torch.outer(p, p)
            want += jac[b, t].T @ curvature @ jac[b, t] @ flat(tangent)
    got = gauss_newton(logits_of, params, tangent, ids)
    torch.testing.assert_close(torch.cat([g.flatten() for g in got]), want)


def test_token_fisher_sums_each_predicted_tokens_own_gradient() -> None:
    params, tangent, table, ids = toy()

    def logits_of(p: Params, x: Tensor) -> Tensor:
        return torch.tanh(table[x] @ p["w1"]) @ p["w2"]

    per_token = jacobian(lambda v: token_losses(logits_of(unflat(v), ids), ids), flat(params))
    rows = per_token.flatten(0, 1)  # (B * (T - 1), D): one gradient per predicted token
    want = rows.T @ (rows @ flat(tangent))
    got = token_fisher(logits_of, params, tangent, ids)
    torch.testing.assert_close(torch.cat([g.flatten() for g in got]), want)
