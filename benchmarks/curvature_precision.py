"""How far fp32 K-FAC statistics drift from fp64 ones over a long run.

One linear layer (256 inputs, 128 outputs) fed 256 token rows per micro-batch, one
micro-batch per optimizer step, inputs with a non-zero mean and a decaying spectrum, a
scale that varies between micro-batches. Three ways of summing the same fp32 factors:
the exact reference (fp64 products, fp64 sums, no accumulator), a ``CurvatureAccumulator``
committed every 50 steps (fp32 running sums folded into fp64 totals, the default), and
one never committed before the end (fp32 sums over the whole run). Reported: the relative
error of the ``A`` sum, and of the K-FAC-preconditioned vectors ``(A + l I)^-1 v`` at
damping 0.1 and 0.01 (relative to the mean eigenvalue).

    python benchmarks/curvature_precision.py [--micro-batches 20000]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

from tda_plugins.capture.adapters import DEFAULT_REGISTRY
from tda_plugins.capture.records import LayerRecord, MicroBatchRecord
from tda_plugins.grads import TokenFactors
from tda_plugins.precondition import CurvatureAccumulator

N_A, N_S, TOKENS, COMMIT_EVERY = 256, 128, 256, 50


def solve(a: Tensor, damping: float, v: Tensor) -> Tensor:
    a = a.double()
    return torch.linalg.solve(a + damping * a.trace() / N_A * torch.eye(N_A, dtype=a.dtype), v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=20000)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(N_A, N_A, generator=gen) * torch.arange(1, N_A + 1) ** -0.75
    mean = 0.5 * torch.randn(N_A, generator=gen)
    module = nn.Linear(N_A, N_S, bias=False)
    adapter = DEFAULT_REGISTRY.lookup(module)
    assert adapter is not None
    v = torch.randn(N_A, 8, generator=gen, dtype=torch.float64)
    reference = torch.zeros(N_A, N_A, dtype=torch.float64)
    checkpoints = {args.micro_batches // 100, args.micro_batches // 10, args.micro_batches}
    print(
        "| micro-batches | sum: committed | sum: fp32 throughout | K-FAC d=0.1: committed "
        "| fp32 throughout | K-FAC d=0.01: committed | fp32 throughout |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        committed = CurvatureAccumulator(Path(tmp) / "committed")
        plain = CurvatureAccumulator(Path(tmp) / "plain")
        for step in range(args.micro_batches):
            scale = 1 + 0.5 * torch.rand((), generator=gen).item()
            a = (torch.randn(1, TOKENS, N_A, generator=gen) @ mix.T + mean) * scale
            g = 1e-3 * torch.randn(1, TOKENS, N_S, generator=gen)
            reference += a[0].double().T @ a[0].double()
            record = MicroBatchRecord(
                index=step,
                step=step,
                example_ids=torch.tensor([step]),
                token_mask=None,
                layers={"fc": LayerRecord("fc", module, adapter, TokenFactors(a, g))},
            )
            for accumulator in (committed, plain):
                accumulator.on_micro_batch(record)
                accumulator.on_optimizer_step(step, [])
            if (step + 1) % COMMIT_EVERY == 0:
                committed.commit(step + 1)
            if step + 1 in checkpoints:
                got = {"c": committed.factors["fc"].a_sum, "p": plain.factors["fc"].a_sum}
                err = {
                    k: ((x - reference).norm() / reference.norm()).item() for k, x in got.items()
                }
                kfac = {}
                for d in (0.1, 0.01):
                    ref = solve(reference, d, v)
                    for k, x in got.items():
                        kfac[k, d] = ((solve(x, d, v) - ref).norm() / ref.norm()).item()
                print(
                    f"| {step + 1} | {err['c']:.1e} | {err['p']:.1e} | {kfac['c', 0.1]:.1e} | "
                    f"{kfac['p', 0.1]:.1e} | {kfac['c', 0.01]:.1e} | {kfac['p', 0.01]:.1e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
