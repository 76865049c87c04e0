"""The exact reference every row is compared with: per-example gradients in fp64 by one
backward per example (the oracle of docs/design.md section 11), independent of the capture
engine, streamed so that memory does not grow with the number of training rows.

Per captured layer the gradient is the ``(N_o, N_i + 1)`` matrix ``[dW, db]`` (the bias
column only where the layer has one; GPT-2 ``Conv1D`` weights transposed), each
example's own summed token loss; an example's gradient is these matrices flattened and
concatenated, ``(D,)``. Scores, ``(N, M)``:

* GradDot: ``<g_q, g_z>``.
* K-FAC: ``A = E[[a;1][a;1]^T]``, ``S = E[g g^T]`` over the training token rows (forward
  and backward hooks on the fp64 model); ``G_q -> (S + l_S I)^-1 G_q (A + l_A I)^-1``
  with ``l_X = damping * mean eig(X)``.
* EK-FAC: eigenbases of ``A`` and ``S``, ``Lambda = E_n[(U_S^T G_n U_A)^2]`` over the
  training examples, ``l = damping * mean(Lambda)``.

Only the query side is held: ``(M, D)`` gradients and their K-FAC and EK-FAC
preconditioned copies (each ~70 MB per query on the ~10M models). Training gradients are
computed one example at a time and dotted at once, in two passes (the second after
``Lambda`` is known). Cost: one batched pass over the training rows for the factors, then
``2 N + M`` single-example fp64 forward + backward passes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from peers.workload import Problem, example_losses, row_batches

DAMPING = 0.1


@dataclass
class _Sums:
    """Running ``sum [a;1][a;1]^T`` and ``sum g g^T`` of one layer."""

    a: Tensor | float = 0.0
    s: Tensor | float = 0.0


@dataclass(frozen=True)
class _Block:
    """Where one layer's ``(N_o, N_i')`` matrix sits in the flattened ``(D,)`` gradient."""

    name: str
    start: int
    shape: tuple[int, int]

    def view(self, flat: Tensor) -> Tensor:
        """``(..., N_o, N_i')`` view of this layer in ``(..., D)`` gradients."""
        rows, cols = self.shape
        return flat[..., self.start : self.start + rows * cols].unflatten(-1, (rows, cols))


@dataclass(frozen=True)
class _Eigen:
    """One layer's K-FAC factors in their eigenbases: ``S = U_S diag(d_S) U_S^T`` and
    ``A = U_A diag(d_A) U_A^T``."""

    u_s: Tensor
    d_s: Tensor
    u_a: Tensor
    d_a: Tensor

    def rotate(self, g: Tensor) -> Tensor:
        """``U_S^T G U_A`` of ``(..., N_o, N_i')`` gradients."""
        return self.u_s.T @ g @ self.u_a

    def unrotate(self, g: Tensor) -> Tensor:
        """``U_S G U_A^T``, the inverse of :meth:`rotate`."""
        return self.u_s @ g @ self.u_a.T

    def kfac_scale(self) -> Tensor:
        """``(N_o, N_i')`` eigenvalues of ``(S + l_S I) (x) (A + l_A I)`` in the eigenbasis."""
        d_s, d_a = self.d_s.clamp_min(0), self.d_a.clamp_min(0)
        return torch.outer(d_s + DAMPING * d_s.mean(), d_a + DAMPING * d_a.mean())


class Reference:
    """Per-example gradients and Kronecker factors of one problem, in fp64."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.model = copy.deepcopy(problem.model).double()  # a bf16 model's weights, cast up
        self.model.requires_grad_(False)
        self.modules = {n: self.model.get_submodule(n) for n in problem.layers}
        self.blocks: list[_Block] = []
        start = 0
        for name, module in self.modules.items():
            module.requires_grad_(True)
            out_dim, in_dim = module.weight.shape
            if type(module).__name__ == "Conv1D":  # transformers stores (N_i, N_o)
                out_dim, in_dim = in_dim, out_dim
            shape = (out_dim, in_dim + (module.bias is not None))
            self.blocks.append(_Block(name, start, shape))
            start += shape[0] * shape[1]
        self.dim = start

    def gradient(self, ids: Tensor) -> Tensor:
        """``(D,)`` exact gradient of one ``(T,)`` row's summed loss: one backward."""
        out = torch.empty(self.dim, dtype=torch.float64, device=self.problem.device)
        params = [p for m in self.modules.values() for p in m.parameters(recurse=False)]
        grads = iter(torch.autograd.grad(example_losses(self.model, ids[None]).sum(), params))
        for block in self.blocks:
            module = self.modules[block.name]
            weight = next(grads)
            matrix = block.view(out)
            if type(module).__name__ == "Conv1D":
                weight = weight.T
            matrix[:, : weight.shape[1]] = weight
            if module.bias is not None:
                matrix[:, -1] = next(grads)
        return out

    def gradients(self, rows: Tensor) -> Iterator[Tensor]:
        """``(D,)`` gradient of each row in turn (nothing kept between rows)."""
        for ids in rows:
            yield self.gradient(ids)

    def factors(self) -> dict[str, _Eigen]:
        """Layer -> eigendecomposed ``(A, S)`` over the training token rows."""
        sums = {n: _Sums() for n in self.modules}
        handles = [m.register_forward_hook(self._hook(n, sums)) for n, m in self.modules.items()]
        try:
            for ids in row_batches(self.problem.train, self.problem.batch):
                example_losses(self.model, ids).sum().backward()
                self.model.zero_grad(set_to_none=True)
        finally:
            for h in handles:
                h.remove()
        rows = self.problem.train.numel()
        out = {}
        for name, x in sums.items():
            d_s, u_s = torch.linalg.eigh(x.s / rows)  # type: ignore[operator]
            d_a, u_a = torch.linalg.eigh(x.a / rows)  # type: ignore[operator]
            out[name] = _Eigen(u_s, d_s, u_a, d_a)
        return out

    def _hook(self, name: str, sums: dict[str, _Sums]) -> Callable[..., None]:
        """Forward hook adding ``[a;1][a;1]^T`` now and ``g g^T`` when the output's grad
        arrives."""
        module = self.modules[name]

        def hook(mod: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            a = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
            if getattr(module, "bias", None) is not None:
                a = torch.cat([a, torch.ones_like(a[:, :1])], dim=1)
            entry = sums[name]
            entry.a = entry.a + a.T @ a

            def on_grad(g: Tensor) -> None:
                g = g.reshape(-1, g.shape[-1])
                entry.s = entry.s + g.T @ g

            output.register_hook(on_grad)

        return hook


def _precondition(
    blocks: list[_Block], eigen: dict[str, _Eigen], q: Tensor, scale: Callable[[str], Tensor]
) -> Tensor:
    """``(M, D)`` copy of query gradients with each layer rotated into its eigenbasis,
    divided by ``scale(layer)`` (``(N_o, N_i')``) and rotated back."""
    out = torch.empty_like(q)
    for block in blocks:
        basis = eigen[block.name]
        block.view(out)[:] = basis.unrotate(basis.rotate(block.view(q)) / scale(block.name))
    return out


def reference_scores(problem: Problem, queries: int) -> dict[str, Tensor]:
    """``{"graddot", "kfac", "ekfac"}`` -> ``(N, queries)`` fp64 exact scores of the
    training rows against the first ``queries`` query rows (computed on the problem's
    device, returned on the CPU)."""
    ref = Reference(problem)
    q = torch.stack(list(ref.gradients(problem.queries[:queries])))
    eigen = ref.factors()
    q_kfac = _precondition(ref.blocks, eigen, q, lambda n: eigen[n].kfac_scale())
    count = problem.train.shape[0]
    dot = torch.empty(count, queries, dtype=torch.float64, device=problem.device)
    kfac = torch.empty_like(dot)
    lam = {
        b.name: torch.zeros(b.shape, dtype=torch.float64, device=problem.device) for b in ref.blocks
    }
    for i, z in enumerate(ref.gradients(problem.train)):
        dot[i] = q @ z
        kfac[i] = q_kfac @ z
        for block in ref.blocks:
            lam[block.name] += eigen[block.name].rotate(block.view(z)).square()
    del q_kfac

    def ekfac_scale(name: str) -> Tensor:
        mean = lam[name] / count
        return mean + DAMPING * mean.mean()

    q_ekfac = _precondition(ref.blocks, eigen, q, ekfac_scale)
    ekfac = torch.stack([q_ekfac @ z for z in ref.gradients(problem.train)])
    return {"graddot": dot.cpu(), "kfac": kfac.cpu(), "ekfac": ekfac.cpu()}
