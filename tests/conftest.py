import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from tests.launch import freeze_imported

torch.set_num_threads(1)


def pytest_collection_finish(session: object) -> None:
    """Every test module is imported: freeze what the imports made."""
    freeze_imported()
