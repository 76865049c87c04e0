"""Whether a gradient built with ``create_graph`` can really be differentiated again.

An op whose backward is not itself differentiable (a ``once_differentiable`` autograd
function, a fused kernel) cuts the graph of the gradient silently: autograd then reports
the second derivatives through it as unused, and a Hessian-vector product asked with
``materialize_grads`` comes back as zeros. The metagradient checks the graph before it
starts (docs/design.md section 13.4).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor


def reaching(tensors: Sequence[Tensor | None], target: Tensor) -> list[bool]:
    """For each tensor, whether its autograd graph reaches the leaf ``target``: one walk
    over the union of their graphs (``grad_fn.next_functions``), no computation."""
    parents: dict[Any, list[Any]] = {}
    roots = [t.grad_fn for t in tensors if t is not None and t.grad_fn is not None]
    seen = set(roots)
    stack = list(roots)
    goal = None
    while stack:
        node = stack.pop()
        if getattr(node, "variable", None) is target:
            goal = node
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    reached = set()
    frontier = [] if goal is None else [goal]
    while frontier:
        node = frontier.pop()
        if node not in reached:
            reached.add(node)
            frontier.extend(parents.get(node, []))
    return [t is not None and t.grad_fn in reached for t in tensors]


def require_second_derivatives(
    names: Sequence[str], grads: Sequence[Tensor | None], weights: Tensor
) -> None:
    """Refuse when a parameter's gradient (``None``: the loss does not use it) has no
    path back to the loss weights ``weights`` it is a weighted sum over: its
    second derivatives would be lost."""
    cut = [
        name
        for name, grad, reaches in zip(names, grads, reaching(grads, weights), strict=True)
        if grad is not None and not reaches
    ]
    if cut:
        raise RuntimeError(
            f"the gradients of {cut[:3]} ({len(cut)} parameters) cannot be differentiated "
            "again: an op of the model has a backward without a derivative of its own (a "
            "once_differentiable function or a fused kernel), which autograd would count as "
            "zero; use the model's plain PyTorch ops (attn_implementation='eager' or 'sdpa')"
        )
