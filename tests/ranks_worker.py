"""Several rank workers in one launch: each in turn on every rank, under one gloo process
group.

The tests start it with ``tests.launch.forked_ranks(zygote, FOLDER, JOB...)``, which
forks the ranks from the test process's zygote with the environment torchrun gives its
ranks; by hand, ``python -m torch.distributed.run --standalone --nproc-per-node=2
tests/ranks_worker.py FOLDER JOB...`` does the same. A ``JOB`` is ``WORKER`` or
``WORKER:ARG,ARG...`` and runs ``tests/WORKER.py``'s ``main(FOLDER / WORKER, *ARGS)``.

Why one launch for several workers: each launch pays the ranks' start and rendezvous,
so the launch makes the group before the first worker and destroys it after the last. A
worker's ``main`` therefore runs in an initialized group and leaves it as it found it.
"""

from __future__ import annotations

import faulthandler
import importlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.launch import freeze_imported

#: Seconds one worker may run before every rank dumps every thread's stack and exits (a
#: collective that one rank never joins would otherwise hang until the test's timeout).
HANG_SECONDS = 150


def main(folder: Path, jobs: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for job in jobs:
            name, _, args = job.partition(":")
            faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
            worker = importlib.import_module(f"tests.{name}")
            freeze_imported()
            worker.main(folder / name, *filter(None, args.split(",")))
            dist.barrier()
        faulthandler.cancel_dump_traceback_later()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: ranks_worker.py FOLDER WORKER[:ARG,...]...")
    main(Path(sys.argv[1]), sys.argv[2:])
