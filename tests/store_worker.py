"""A seeded training run that captures into a gradient store: the subject of the crash tests.

``python -m tests.store_worker STORE CHECKPOINTS [--pause STEP MICRO]`` trains a tiny Llama
with SGD from the latest checkpoint in CHECKPOINTS (or from its seeded initialization),
several micro-batches per optimizer step, and captures each micro-batch into the store at
STORE. After each optimizer step it saves a checkpoint (safetensors, atomically). With
``--pause`` it prints ``paused`` after the backward of micro-batch MICRO of step STEP and
waits on stdin: the test kills it there, between two micro-batches of one step.

Loss convention: each example's own summed next-token loss, summed over the micro-batch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import Tensor

from tda_plugins import CaptureEngine
from tda_plugins.store import GradientStore
from tda_plugins.store.io import atomic_write_bytes
from tests.models import lm_batch, tiny_causal_lm
from tests.stores import summed_loss

STEPS = 4
MICRO_BATCHES = 3
LEARNING_RATE = 0.01


def micro_batch(step: int, micro: int) -> dict[str, Tensor]:
    """The data of micro-batch ``micro`` of optimizer step ``step`` (the same in every run)."""
    return lm_batch(batch=2, length=8, lengths=(8, 5), seed=100 * step + micro)


def checkpoint_path(directory: Path, step: int) -> Path:
    """Weights after ``step`` optimizer steps."""
    return directory / f"step-{step:04d}.safetensors"


def latest_checkpoint(directory: Path) -> int:
    """Optimizer steps done by the latest checkpoint in ``directory`` (0 when none)."""
    return max((int(p.stem.split("-")[1]) for p in directory.glob("step-*.safetensors")), default=0)


def train(store: Path, checkpoints: Path, pause: tuple[int, int] | None = None) -> None:
    """Train up to :data:`STEPS` optimizer steps, resuming from the latest checkpoint.

    A resumed run drops whatever the store holds from the checkpoint's step on (a step
    committed after the checkpoint was saved) and numbers its steps from there, so the
    store ends as an uninterrupted run's would.
    """
    checkpoints.mkdir(parents=True, exist_ok=True)
    model = tiny_causal_lm("llama")
    start = latest_checkpoint(checkpoints)
    if start:
        model.load_state_dict(load_file(checkpoint_path(checkpoints, start)))
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    gradients = GradientStore(store, append=start > 0)
    with CaptureEngine(model, consumers=[gradients]) as engine:
        gradients.truncate(start)
        engine.resume_at_step(start)
        for step in range(start, STEPS):
            for micro in range(MICRO_BATCHES):
                summed_loss(model, micro_batch(step, micro)).backward()
                if (step, micro) == pause:
                    print("paused", flush=True)
                    sys.stdin.readline()
            engine.optimizer_step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            weights = {k: v.contiguous() for k, v in model.state_dict().items()}
            atomic_write_bytes(checkpoint_path(checkpoints, step + 1), save(weights))
        engine.end()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("checkpoints", type=Path)
    parser.add_argument("--pause", type=int, nargs=2, metavar=("STEP", "MICRO"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the same kernels, bit for bit, as the test process
    pause = None if args.pause is None else (args.pause[0], args.pause[1])
    train(args.store, args.checkpoints, pause)


if __name__ == "__main__":
    main()
