"""A seeded AdamW run that records its trajectory: the subject of the trajectory's kill test.

``python -m tests.trajectory_worker STORE CHECKPOINTS [--pause STEP]`` trains the linear
layers of a tiny fp64 Llama with AdamW and gradient clipping, two micro-batches per step,
through a :class:`~tda_plugins.session.CaptureSession` with ``record_trajectory``, from the
latest checkpoint in CHECKPOINTS (weights and optimizer state, safetensors) or from its
seeded initialization. After each step it keeps what a resume needs in the store
(``save_checkpoint``), then writes the checkpoint. With ``--pause`` it prints ``paused``
once step STEP's update is recorded (its trajectory write possibly still running) and
waits on stdin: the test kills it there.

Loss convention: each example's own summed next-token loss, summed over the step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import nn

from tda_plugins.capture.normalization import SummedLoss
from tda_plugins.session import CaptureSession, CaptureSettings
from tda_plugins.store.io import atomic_write_bytes
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import summed_loss

STEPS = 4
MICRO_BATCHES = 2
MAX_GRAD_NORM = 1.0


def linear_only_llama() -> nn.Module:
    """The tiny fp64 Llama training its linear layers alone (all of them captured)."""
    model = tiny_causal_lm("llama", torch.float64)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("proj.weight") or name.startswith("lm_head"))
    return model.train()


def checkpoint_path(directory: Path, step: int) -> Path:
    """Weights and optimizer state after ``step`` optimizer steps."""
    return directory / f"step-{step:04d}.safetensors"


def latest_checkpoint(directory: Path) -> int:
    return max((int(p.stem.split("-")[1]) for p in directory.glob("step-*.safetensors")), default=0)


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        tensors.update({f"optim.{index}.{k}": v.contiguous() for k, v in state.items()})
    atomic_write_bytes(path, save(tensors))


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    tensors = load_file(path)
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".")
            state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({**optimizer.state_dict(), "state": state})


def train(store: Path, checkpoints: Path, pause: int | None = None) -> None:
    """Train up to :data:`STEPS` steps from the latest checkpoint, recording into ``store``."""
    checkpoints.mkdir(parents=True, exist_ok=True)
    model = linear_only_llama()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.01, weight_decay=0.1)
    start = latest_checkpoint(checkpoints)
    if start:
        load_checkpoint(checkpoint_path(checkpoints, start), model, optimizer)
    settings = CaptureSettings(
        str(store), curvature=False, store_texts=False, record_trajectory=True
    )
    session = CaptureSession(
        settings,
        model,
        SummedLoss(),
        start_step=start,
        optimizer=optimizer,
        max_grad_norm=MAX_GRAD_NORM,
    )
    for step in range(start, STEPS):
        for micro in range(MICRO_BATCHES):
            batch = lm_batch(batch=2, length=8, lengths=(8, 5), seed=100 * step + micro)
            summed_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        session.step()
        optimizer.step()
        session.after_optimizer_step()
        if step == pause:
            print("paused", flush=True)
            sys.stdin.readline()
        session.finish_step()
        optimizer.zero_grad(set_to_none=True)
        session.save_checkpoint(step + 1)
        save_checkpoint(checkpoint_path(checkpoints, step + 1), model, optimizer)
    session.end(optimizer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("checkpoints", type=Path)
    parser.add_argument("--pause", type=int, metavar="STEP")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the same kernels, bit for bit, as the test process
    train(args.store, args.checkpoints, args.pause)


if __name__ == "__main__":
    main()
