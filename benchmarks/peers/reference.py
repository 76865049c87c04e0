"""The exact reference every row is compared with: per-example gradients in fp64 by one
backward per example (the oracle of DESIGN.md section 5), independent of the capture
engine.

Per captured layer the gradient is the ``(N_o, N_i + 1)`` matrix ``[dW, db]`` (the bias
column only where the layer has one; GPT-2 ``Conv1D`` weights transposed), each
example's own summed token loss. Scores, ``(N, M)``:

* GradDot: ``sum_layers <G_q, G_z>``.
* K-FAC: ``A = E[[a;1][a;1]^T]``, ``S = E[g g^T]`` over the training token rows (forward
  and backward hooks on the fp64 model); ``G_q -> (S + l_S I)^-1 G_q (A + l_A I)^-1``
  with ``l_X = damping * mean eig(X)``.
* EK-FAC: eigenbases of ``A`` and ``S``, ``Lambda = E_n[(U_S^T G_n U_A)^2]`` over the
  training examples, ``l = damping * mean(Lambda)``.

Cost: two passes over the training rows and one over the queries, in fp64.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from peers.workload import Problem, example_losses, row_batches

DAMPING = 0.1
Layers = dict[str, Tensor]


@dataclass
class _Sums:
    """Running ``sum [a;1][a;1]^T`` and ``sum g g^T`` of one layer."""

    a: Tensor | float = 0.0
    s: Tensor | float = 0.0


def _matrix(module: nn.Module, grads: dict[str, Tensor]) -> Tensor:
    """``(B, N_o, N_i')`` per-example ``[dW, db]`` of one layer from its parameters' grads."""
    weight = grads["weight"]
    if type(module).__name__ == "Conv1D":  # transformers stores (N_i, N_o)
        weight = weight.transpose(1, 2)
    if "bias" in grads:
        weight = torch.cat([weight, grads["bias"].unsqueeze(2)], dim=2)
    return weight


class Reference:
    """Per-example gradients and Kronecker factors of one problem, in fp64."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.model = copy.deepcopy(problem.model).double()
        self.modules = {n: self.model.get_submodule(n) for n in problem.layers}
        self.params = {
            f"{n}.{p}": t.detach()
            for n, m in self.modules.items()
            for p, t in m.named_parameters(recurse=False)
        }

    def gradients(self, rows: Tensor) -> Layers:
        """Layer -> ``(B, N_o, N_i')`` exact per-example gradients of ``rows``: one
        backward per example (``vmap`` over this fp64 model needs several GB)."""
        names = list(self.params)
        tensors = [self.model.get_parameter(n) for n in names]
        per_row = []
        for ids in rows:
            loss = example_losses(self.model, ids[None]).sum()
            per_row.append(torch.autograd.grad(loss, tensors))
        flat = {n: torch.stack([g[i] for g in per_row]) for i, n in enumerate(names)}
        out = {}
        for name, module in self.modules.items():
            mine = {k.rsplit(".", 1)[1]: v for k, v in flat.items() if k.rsplit(".", 1)[0] == name}
            out[name] = _matrix(module, mine)
        return out

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Layer -> ``(A, S)`` over the training token rows."""
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
        return {n: (x.a / rows, x.s / rows) for n, x in sums.items()}

    def _hook(self, name: str, sums: dict[str, _Sums]) -> Callable[..., None]:
        """Forward hook adding ``[a;1][a;1]^T`` now and ``g g^T`` when the output's grad
        arrives."""
        module = self.modules[name]

        def hook(mod: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            a = inputs[0].reshape(-1, inputs[0].shape[-1])
            if getattr(module, "bias", None) is not None:
                a = torch.cat([a, torch.ones_like(a[:, :1])], dim=1)
            entry = sums[name]
            entry.a = entry.a + a.T @ a

            def on_grad(g: Tensor) -> None:
                g = g.reshape(-1, g.shape[-1])
                entry.s = entry.s + g.T @ g

            output.register_hook(on_grad)

        return hook


def _damped_inverse(x: Tensor, damping: float) -> Tensor:
    d, u = torch.linalg.eigh(x)
    d = d.clamp_min(0)
    return (u / (d + damping * d.mean())) @ u.T


def reference_scores(problem: Problem, queries: int) -> dict[str, Tensor]:
    """``{"graddot", "kfac", "ekfac"}`` -> ``(N, queries)`` fp64 exact scores of the
    training rows against the first ``queries`` query rows."""
    ref = Reference(problem)
    q = ref.gradients(problem.queries[:queries])
    factors = ref.factors()
    inverses = {
        n: (_damped_inverse(s, DAMPING), _damped_inverse(a, DAMPING))
        for n, (a, s) in factors.items()
    }
    eigen = {}
    for n, (a, s) in factors.items():
        eigen[n] = (torch.linalg.eigh(s)[1], torch.linalg.eigh(a)[1])
    q_kfac = {n: inverses[n][0] @ g @ inverses[n][1] for n, g in q.items()}
    lam = {n: torch.zeros(g.shape[1:], dtype=torch.float64) for n, g in q.items()}
    dot, kfac = [], []
    for ids in row_batches(problem.train, problem.batch):
        z = ref.gradients(ids)
        dot.append(sum(torch.einsum("bij,mij->bm", z[n], q[n]) for n in q))
        kfac.append(sum(torch.einsum("bij,mij->bm", z[n], q_kfac[n]) for n in q))
        for n, (u_s, u_a) in eigen.items():
            lam[n] += (u_s.T @ z[n] @ u_a).pow(2).sum(dim=0)
    count = problem.train.shape[0]
    q_rot = {}
    for n, (u_s, u_a) in eigen.items():
        lam_n = lam[n] / count
        q_rot[n] = (u_s.T @ q[n] @ u_a) / (lam_n + DAMPING * lam_n.mean())
    ekfac = []
    for ids in row_batches(problem.train, problem.batch):
        z = ref.gradients(ids)
        rot = {n: eigen[n][0].T @ z[n] @ eigen[n][1] for n in z}
        ekfac.append(sum(torch.einsum("bij,mij->bm", rot[n], q_rot[n]) for n in q))
    return {"graddot": torch.cat(dot), "kfac": torch.cat(kfac), "ekfac": torch.cat(ekfac)}
