"""The curvature products of ``benchmarks/fidelity_curvature_probe.py`` against explicit
fp64 constructions on a two-layer toy language model (its figures are quoted in
docs/design.md 7.9.1)."""

import sys
from pathlib import Path

import torch
from torch import Tensor
from torch.autograd.functional import jacobian

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from fidelity_curvature_probe import (
    Kronecker,
    block_position_fisher,
    gauss_newton,
    layer_parts,
    position_fisher,
    token_fisher,
    token_losses,
)
from transformers.pytorch_utils import Conv1D

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


def parts_and_tangent() -> tuple[dict[str, tuple[Tensor, Tensor]], Params]:
    """Two layers' ``(N, in)`` inputs and ``(N, out)`` output gradients over 7 positions,
    and a tangent of their ``(in, out)`` weights."""
    gen = torch.Generator().manual_seed(1)

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    parts = {"x": (draw(7, 3), draw(7, 2)), "y": (draw(7, 2), draw(7, 4))}
    return parts, {f"{n}.weight": draw(a.shape[1], g.shape[1]) for n, (a, g) in parts.items()}


def position_rows(part: tuple[Tensor, Tensor]) -> Tensor:
    """``(N, in * out)``: each position's weight gradient ``a_n g_n^T``, flattened."""
    a, g = part
    return torch.stack([torch.outer(a[n], g[n]).flatten() for n in range(a.shape[0])])


def test_position_fishers_are_the_dense_fisher_of_the_position_parts() -> None:
    parts, tangent = parts_and_tangent()
    rows = torch.cat([position_rows(parts[n]) for n in parts], 1)  # (N, D) both layers
    u = torch.cat([tangent[f"{n}.weight"].flatten() for n in parts])
    want = rows.T @ (rows @ u)
    got = position_fisher(parts, tangent)
    torch.testing.assert_close(
        torch.cat([got[f"{n}.weight"].double().flatten() for n in parts]), want
    )
    block = block_position_fisher(parts, tangent)
    for n, part in parts.items():
        rows = position_rows(part)
        want = rows.T @ (rows @ tangent[f"{n}.weight"].flatten())
        torch.testing.assert_close(block[f"{n}.weight"].double().flatten(), want)


def test_kfac_and_ekfac_are_the_dense_kronecker_forms() -> None:
    parts, tangent = parts_and_tangent()
    kron = Kronecker(parts)
    for n, (a, g) in parts.items():
        u = tangent[f"{n}.weight"].flatten()
        dense = torch.kron(a.T @ a, g.T @ g) / a.shape[0]  # row-major vec(V): A (x) G
        torch.testing.assert_close(kron.kfac(tangent)[f"{n}.weight"].double().flatten(), dense @ u)
        # EK-FAC: the Kronecker eigenbasis, each eigenvalue the block Fisher's diagonal in it
        basis = torch.kron(
            torch.linalg.eigh(a.T @ a).eigenvectors, torch.linalg.eigh(g.T @ g).eigenvectors
        )
        rows = position_rows((a, g))
        eigen = torch.diag(basis.T @ rows.T @ rows @ basis)
        want = basis @ (eigen * (basis.T @ u))
        torch.testing.assert_close(kron.ekfac(tangent)[f"{n}.weight"].double().flatten(), want)


def test_layer_parts_split_each_weight_gradient_by_position() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Conv1D(4, 3), torch.nn.Tanh(), Conv1D(2, 4)).double()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    params = {n: p.detach() for n, p in model.named_parameters() if n.endswith("weight")}

    def loss(p: Params, inputs: Tensor) -> Tensor:
        return torch.func.functional_call(model, p, (inputs,)).square().sum()

    parts = layer_parts(model, loss, params, x)
    want = torch.func.grad(loss)(params, x)
    assert sorted(parts) == ["0", "2"]
    for n, (a, g) in parts.items():
        torch.testing.assert_close(a.T @ g, want[f"{n}.weight"])
