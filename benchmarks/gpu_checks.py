"""The CUDA checks that ``benchmarks/gpu_check.sh`` runs, one per subcommand; the CPU is
the reference every time.

* ``sync``: a training step on CUDA under bf16 autocast with the capture engine attached
  (per-example gradients kept on the device; then again with the inline K-FAC statistics),
  inside ``torch.cuda.set_sync_debug_mode("error")``: a host synchronization anywhere in
  the forward, the backward with its hooks, or the optimizer step raises. The captured
  gradients are finite and within bf16 rounding of an fp32 capture on the CPU.
* ``capture``: ``tda capture --device cuda`` (fp64) stores the gradients of the CPU
  capture (relative 1e-10).
* ``attribute``: ``tda attribute --device cuda`` (graddot, gradcos, kfac, ekfac; fp64
  stores) and the same under ``torchrun --nproc-per-node N --device cuda`` (NCCL, N =
  the GPUs, at most 2) give the CPU scores (relative 1e-6: scores are saved in fp32).

    python benchmarks/gpu_checks.py sync|capture|attribute

Each prints ``PASS <check>: <what was compared>`` and exits 0, or raises (exit 1);
without a CUDA device it exits 2 at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import REPO, causal_lm, llama
from safetensors.torch import load_file
from torch import Tensor, nn

from tda_plugins import CaptureEngine, LayerSelection, causal_lm_example_losses
from tda_plugins.capture import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.cli import main as tda
from tda_plugins.precondition import CurvatureAccumulator
from tda_plugins.store import StoreReader

METHODS = ("graddot", "gradcos", "kfac", "ekfac")
VOCAB = 128


def tiny_llama() -> nn.Module:
    """A two-block Llama from its config (seed 0, fp32, on the CPU)."""
    sizes = llama(VOCAB, hidden=64, intermediate=128, layers=2, heads=4, num_key_value_heads=2)
    return causal_lm("LlamaConfig", "LlamaForCausalLM", **sizes, max_position_embeddings=64)


def rows(count: int, length: int, seed: int) -> Tensor:
    return torch.randint(1, VOCAB, (count, length), generator=torch.Generator().manual_seed(seed))


def rel(a: Tensor, b: Tensor) -> float:
    """``max |a - b| / max |b|`` (in fp64)."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


# -- sync ----------------------------------------------------------------------------------


class Kept(CaptureConsumer):
    """Keeps each micro-batch's per-example gradients where they are (no copy, no sync)."""

    def __init__(self) -> None:
        self.records: list[MicroBatchRecord] = []

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        self.records.append(record)


def captured(model: nn.Module, ids: Tensor, consumers: list[CaptureConsumer], *, sync_check: bool):
    """One training step (forward, backward, AdamW step) with the engine attached; with
    ``sync_check`` under bf16 autocast on CUDA inside ``set_sync_debug_mode("error")``.
    Returns layer -> ``(B, D)`` per-example gradients of the kept record."""
    kept = Kept()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = CaptureEngine(
        model, layers=LayerSelection(kind="linear"), consumers=[kept, *consumers]
    )
    with engine:
        engine.set_example_ids(torch.arange(ids.shape[0], device=ids.device))
        if sync_check:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=sync_check):
                losses = causal_lm_example_losses(model(input_ids=ids).logits, ids)
            losses.sum().backward()
            optimizer.step()
        finally:
            if sync_check:
                torch.cuda.set_sync_debug_mode("default")
        engine.optimizer_step()
        engine.end()
    (record,) = kept.records
    return {name: layer.grads.materialize().float().cpu() for name, layer in record.layers.items()}


def check_sync() -> None:
    ids = rows(4, 32, seed=1)
    reference = captured(tiny_llama(), ids, [], sync_check=False)
    with tempfile.TemporaryDirectory() as work:
        for consumers in ([], [CurvatureAccumulator(work)]):
            got = captured(tiny_llama().cuda(), ids.cuda(), list(consumers), sync_check=True)
            extra = " + inline K-FAC statistics" if consumers else ""
            for name, grads in reference.items():
                require(bool(got[name].isfinite().all()), f"non-finite bf16 gradient in {name}")
                error = float((got[name] - grads).norm() / grads.norm())
                require(error <= 0.05, f"{name}: bf16-autocast gradient off by {error:.3f}")
            print(f"PASS sync{extra}: a bf16-autocast training step with capture made no host sync")


# -- capture and attribute -------------------------------------------------------------------


def write_rows(path: Path, data: Tensor, first_id: int) -> Path:
    lines = [json.dumps({"input_ids": r.tolist(), "id": first_id + i}) for i, r in enumerate(data)]
    path.write_text("\n".join(lines) + "\n")
    return path


def run(*argv: object) -> None:
    code = tda([str(a) for a in argv])
    require(code == 0, f"tda {argv[0]} exited {code}")


def fixtures(work: Path) -> None:
    """fp64 tiny Llama, 12 training rows of varied lengths, 3 queries, CPU stores."""
    tiny_llama().save_pretrained(work / "model")
    train = [r[: 8 + i % 9] for i, r in enumerate(rows(12, 16, seed=2))]
    lines = [json.dumps({"input_ids": r.tolist(), "id": 100 + i}) for i, r in enumerate(train)]
    (work / "train.jsonl").write_text("\n".join(lines) + "\n")
    write_rows(work / "queries.jsonl", rows(3, 12, seed=3), 900)
    for data, out in (("train", "store"), ("queries", "queries")):
        run(
            "capture", "--model", work / "model", "--data", work / f"{data}.jsonl",
            "--out", work / out, "--dtype", "float64", "--batch-size", 4,
        )  # fmt: skip


def check_capture() -> None:
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        fixtures(work)
        run(
            "capture", "--model", work / "model", "--data", work / "train.jsonl",
            "--out", work / "cuda-store", "--dtype", "float64", "--batch-size", 4,
            "--device", "cuda",
        )  # fmt: skip
        cpu, cuda = (
            StoreReader(work / "store").load_all(),
            StoreReader(work / "cuda-store").load_all(),
        )
        require(cpu.example_ids.tolist() == cuda.example_ids.tolist(), "other examples")
        worst = max(
            rel(cuda.layers[n].materialize(), g.materialize()) for n, g in cpu.layers.items()
        )
        require(worst <= 1e-10, f"CUDA capture off by {worst:.2e}")
        print(f"PASS capture: tda capture --device cuda = the CPU store (worst {worst:.1e})")


def scores(folder: Path) -> dict[str, Tensor]:
    return load_file(folder / "scores.safetensors")


def compare(reference: Path, got: Path, what: str) -> None:
    ref, out = scores(reference), scores(got)
    require(torch.equal(ref["train_ids"], out["train_ids"]), f"{what}: other training ids")
    error = rel(out["values"], ref["values"])
    require(error <= 1e-6, f"{what}: scores off by {error:.2e}")
    print(f"PASS attribute {what}: the CPU scores (worst {error:.1e})")


def check_attribute() -> None:
    ranks = min(2, torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        fixtures(work)
        stores = ["--store", work / "store", "--queries", work / "queries", "--chunk", 4]
        for method in METHODS:
            for device in ("cpu", "cuda"):
                run(
                    "attribute",
                    *stores,
                    "--method",
                    method,
                    "--out",
                    work / f"{method}-{device}",
                    "--device",
                    device,
                )
            compare(work / f"{method}-cpu", work / f"{method}-cuda", f"{method} --device cuda")
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            command = [
                *launcher, f"--nproc-per-node={ranks}", "-m", "tda_plugins.cli", "attribute",
                *map(str, stores), "--method", method, "--device", "cuda",
                "--out", str(work / f"{method}-ranks"),
            ]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
            require(done.returncode == 0, f"torchrun attribute failed:\n{done.stderr[-3000:]}")
            compare(
                work / f"{method}-cpu",
                work / f"{method}-ranks",
                f"{method} on {ranks} NCCL rank(s)",
            )


CHECKS = {"sync": check_sync, "capture": check_capture, "attribute": check_attribute}


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        raise SystemExit(f"usage: python benchmarks/gpu_checks.py {{{'|'.join(CHECKS)}}}")
    if not torch.cuda.is_available():
        print(f"gpu_checks: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        raise SystemExit(2)
    CHECKS[sys.argv[1]]()


if __name__ == "__main__":
    main()
