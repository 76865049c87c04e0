"""A rank job that fails on rank 1 alone (``tests/test_zygote.py``): rank 0 goes on to the
launch's barrier and waits there for a rank that never comes."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist


def main(folder: Path) -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails")
