"""K-FAC and EK-FAC of every captured layer type, written out again without the library.

The layers of a model and the weights they share come from its modules; per-example
gradients from one backward per unpadded example (:func:`tests.oracle.loop_oracle`: a
tied weight's is the gradient of the one parameter it is); Kronecker factors from the
layer inputs and output gradients of an ordinary autograd pass over the padded batches.
Then, per layer (a tied weight: per parameter), the curvature matrix a method inverts,
formed densely in the row-major layout of docs/design.md section 1 (``vec(X G Y) =
(X kron Y) vec(G)``), and the scores as dense solves against it:

| layer | ``G`` | K-FAC matrix (each factor damped on its own) |
|---|---|---|
| linear / Conv1D | ``(N_o, N_i')`` | ``S' kron A'`` |
| embedding | ``(V, d)`` | ``diag(counts / rows)' kron S'`` |
| tied embedding + head | ``(V, d)`` | ``diag(counts / rows)' kron S_e' + diag(S_h)' kron A_h'`` |
| untied vocabulary-wide head | ``(V, d)`` | ``diag(S)' kron A'`` (the diagonal of its ``S``) |
| norm scales | ``(D,)`` | ``F' = (sum_n dw_n dw_n^T / rows)'`` |

EK-FAC: ``Q diag(Lambda + l) Q^T``, ``Lambda = mean_n (Q^T vec G_n)^2`` over the oracle
gradients, ``Q`` the Kronecker product of the factors' eigenbases (the identity for a
diagonal factor), for a tied weight ``I kron eigvecs(tr(A_e) S_e + tr(S_h) A_h)``.

Linear layers are covered densely by ``tests/test_curvature.py``; here their matrices
are applied through their factors (two solves), so that the dense matrices stay as small
as the new layer types need.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tests.oracle import loop_oracle
from tests.stores import summed_loss

DAMPING = 0.1


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def units_of(model: nn.Module, layers: list[str]) -> list[tuple[str, ...]]:
    """The layers grouped by the parameters they share (a tied weight's uses together,
    in model order); every other layer alone."""
    owners: dict[int, list[str]] = {}
    for name in layers:
        for p in model.get_submodule(name).parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    units: list[tuple[str, ...]] = []
    for name in layers:
        unit = tuple(
            sorted(
                {n for names in owners.values() if name in names for n in names}, key=layers.index
            )
        )
        if unit not in units:
            units.append(unit)
    return units


# -- per-example gradients -------------------------------------------------------------------


def _flat(module: nn.Module, grads: Mapping[str, Tensor]) -> Tensor:
    """``(N, D)`` of one module's per-example parameter gradients in its layout."""
    weight, bias = grads.get("weight"), grads.get("bias")
    if is_norm(module):
        return torch.cat([g.flatten(1) for g in (weight, bias) if g is not None], dim=1)
    assert weight is not None
    if type(module).__name__ == "Conv1D":
        weight = weight.transpose(1, 2)
    if bias is not None:
        weight = torch.cat([weight, bias.unsqueeze(2)], dim=2)
    return weight.flatten(1)


def unit_grads(
    model: nn.Module, batches: list[dict[str, Tensor]], units: list[tuple[str, ...]]
) -> dict[tuple[str, ...], Tensor]:
    """Unit -> ``(N, D)`` per-example gradients: a tied weight's full gradient, once."""
    param_names = {id(p): n for n, p in model.named_parameters()}
    wanted = {
        unit: {
            local: param_names[id(p)]
            for local, p in model.get_submodule(unit[0]).named_parameters(recurse=False)
        }
        for unit in units
    }
    names = sorted({n for params in wanted.values() for n in params.values()})
    per_batch = [loop_oracle(model, b, names) for b in batches]
    out = {}
    for unit, params in wanted.items():
        grads = {local: torch.cat([g[n] for g in per_batch]) for local, n in params.items()}
        out[unit] = _flat(model.get_submodule(unit[0]), grads)
    return out


# -- factors ---------------------------------------------------------------------------------


@dataclass
class Factors:
    """A layer's closed-form statistics (fp64 means over real token rows): ``a`` and ``s``
    dense ``(n, n)`` or diagonal ``(n,)``; a norm scale's only ``s``."""

    a: Tensor | None
    s: Tensor
    rows: int


def _calls(
    model: nn.Module, batch: Mapping[str, Tensor], layers: list[str]
) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
    """The batch's summed loss, and layer -> (input, output) of its forward call, an output
    shared by the batch (GPT-2's positions) expanded to every example (the same values)."""
    seen: dict[str, tuple[Tensor, Tensor]] = {}
    batch_size = batch["input_ids"].shape[0]

    def keep(name: str) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], Tensor]:
        def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
            inputs = args[0]
            if output.shape[0] != batch_size:
                output = output.expand(batch_size, *output.shape[1:])
                inputs = inputs.expand(batch_size, *inputs.shape[1:])
            seen[name] = (inputs, output)
            return output

        return hook

    handles = [model.get_submodule(n).register_forward_hook(keep(n)) for n in layers]
    try:
        return summed_loss(model, batch), seen
    finally:
        for handle in handles:
            handle.remove()


def closed_form_factors(
    model: nn.Module,
    batches: list[dict[str, Tensor]],
    units: list[tuple[str, ...]],
    grads: Mapping[tuple[str, ...], Tensor],
    *,
    projected: bool = False,
) -> dict[str, Factors]:
    """Layer -> its closed-form statistics over the real tokens of ``batches``: a linear
    layer's ``A = mean [a;1][a;1]^T`` and ``S = mean g g^T`` (the diagonal of ``S`` for a
    head: tied, or the model's output embeddings unless ``projected``, whose output side
    is then ``k`` wide), an embedding's ``A = counts / rows`` and ``S``, a
    norm scale's ``S = sum_n dw_n dw_n^T / rows`` (from the oracle gradients ``grads``)."""
    layers = [n for unit in units for n in unit]
    output = model.get_output_embeddings()
    heads = {n for unit in units if len(unit) > 1 for n in unit} | {
        n for n in layers if not projected and model.get_submodule(n) is output
    }
    sums: dict[str, list[Tensor]] = {}
    rows = 0
    for batch in batches:
        loss, seen = _calls(model, batch, layers)
        names = [n for n in layers if not is_norm(model.get_submodule(n))]
        outputs = torch.autograd.grad(loss, [seen[n][1] for n in names])
        real = batch["attention_mask"].bool()
        rows += int(real.sum())
        for name, g in zip(names, outputs, strict=True):
            module, x = model.get_submodule(name), seen[name][0].detach()
            g = g[real]
            if isinstance(module, nn.Embedding):
                a = torch.bincount(x[real], minlength=module.num_embeddings).to(g.dtype)
                parts = [a, g.T @ g]
            else:
                x = x[real]
                if module.bias is not None:
                    x = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)
                parts = [x.T @ x, g.square().sum(0) if name in heads else g.T @ g]
            if name in sums:
                parts = [p + q for p, q in zip(sums[name], parts, strict=True)]
            sums[name] = parts
    out = {}
    for unit in units:
        for name in unit:
            if is_norm(model.get_submodule(name)):
                flat = grads[unit]
                out[name] = Factors(None, flat.T @ flat / rows, rows)
            else:
                a, s = sums[name]
                out[name] = Factors(a / rows, s / rows, rows)
    return out


# -- the matrices ------------------------------------------------------------------------------


def damped(x: Tensor, damping: float = DAMPING) -> Tensor:
    """``X + damping * mean eig(X) I`` as a dense matrix (a diagonal given as a vector)."""
    x = torch.diag(x) if x.dim() == 1 else x
    n = x.shape[0]
    return x + damping * x.trace() / n * torch.eye(n, dtype=x.dtype)


def _eigenbasis(x: Tensor) -> Tensor:
    return (
        torch.eye(x.shape[0], dtype=x.dtype)
        if x.dim() == 1
        else torch.linalg.eigh(x)[1].contiguous()
    )


def kronecker_terms(
    model: nn.Module, unit: tuple[str, ...], factors: Mapping[str, Factors]
) -> list[tuple[Tensor, Tensor]]:
    """The unit's ``(row, column)`` factor pairs in its layout, one per use."""
    terms = []
    for name in unit:
        f = factors[name]
        if isinstance(model.get_submodule(name), nn.Embedding):
            assert f.a is not None
            terms.append((f.a, f.s))
        else:
            assert f.a is not None
            terms.append((f.s, f.a))
    return terms


def kfac_matrix(model: nn.Module, unit: tuple[str, ...], factors: Mapping[str, Factors]) -> Tensor:
    """The dense damped K-FAC matrix of a non-linear unit (embedding, norm, tied weight)."""
    if is_norm(model.get_submodule(unit[0])):
        return damped(factors[unit[0]].s)
    row, col = kronecker_terms(model, unit, factors)[0]
    matrix = torch.kron(damped(row), damped(col))
    for row, col in kronecker_terms(model, unit, factors)[1:]:
        matrix = matrix + torch.kron(damped(row), damped(col))
    return matrix


def ekfac_basis(model: nn.Module, unit: tuple[str, ...], factors: Mapping[str, Factors]) -> Tensor:
    """The dense EK-FAC basis ``Q`` of any unit."""
    if is_norm(model.get_submodule(unit[0])):
        return torch.linalg.eigh(factors[unit[0]].s)[1]
    terms = kronecker_terms(model, unit, factors)
    if len(terms) == 1:
        row, col = terms[0]
        return torch.kron(_eigenbasis(row), _eigenbasis(col))
    (row_1, col_1), (row_2, col_2) = terms
    marginal = row_1.sum() * col_1 + row_2.sum() * col_2
    rows = row_1.shape[0]
    basis = torch.linalg.eigh(marginal)[1].contiguous()
    return torch.kron(torch.eye(rows, dtype=marginal.dtype), basis)


def ekfac_matrix(q: Tensor, train: Tensor, damping: float = DAMPING) -> Tensor:
    """``Q diag(Lambda + l) Q^T``, ``Lambda = mean_n (Q^T g_n)^2`` over ``(N, D)`` ``train``."""
    lam = (train @ q).square().mean(dim=0)
    return (q * (lam + damping * lam.mean())) @ q.T


def preconditioned(
    method: str,
    model: nn.Module,
    unit: tuple[str, ...],
    factors: Mapping[str, Factors],
    train: Tensor,
    queries: Tensor,
    as_linear: bool = False,
) -> Tensor:
    """``(M, D)`` queries times the inverse of the unit's damped curvature: a dense solve,
    except for a linear layer (or ``as_linear``: a factor-projected embedding, in the
    linear layout), whose Kronecker matrix is applied as two solves."""
    module = model.get_submodule(unit[0])
    if len(unit) == 1 and (is_linear(module) or as_linear):
        f = factors[unit[0]]
        assert f.a is not None
        shaped = queries.view(-1, f.s.shape[0], f.a.shape[0])
        if method == "kfac":
            s, a = damped(f.s), damped(f.a)
            return torch.linalg.solve(s, torch.linalg.solve(a, shaped.mT).mT).flatten(1)
        u_s, u_a = _eigenbasis(f.s), _eigenbasis(f.a)
        lam = (u_s.T @ train.view(-1, *shaped.shape[1:]) @ u_a).square().mean(dim=0)
        inner = (u_s.T @ shaped @ u_a) / (lam + DAMPING * lam.mean())
        return (u_s @ inner @ u_a.T).flatten(1)
    if method == "kfac":
        matrix = kfac_matrix(model, unit, factors)
    else:
        matrix = ekfac_matrix(ekfac_basis(model, unit, factors), train)
    return torch.linalg.solve(matrix, queries.T).T


def reference_scores(
    method: str,
    model: nn.Module,
    units: list[tuple[str, ...]],
    factors: Mapping[str, Factors],
    train: Mapping[tuple[str, ...], Tensor],
    queries: Mapping[tuple[str, ...], Tensor],
    as_linear: frozenset[tuple[str, ...]] = frozenset(),
) -> Tensor:
    """``(N, M)`` sum over units of ``g_z . C^{-1} g_q`` (``as_linear``: units in the
    linear layout, see :func:`preconditioned`)."""
    parts = [
        train[u] @ preconditioned(method, model, u, factors, train[u], queries[u], u in as_linear).T
        for u in units
    ]
    return torch.stack(parts).sum(dim=0)
