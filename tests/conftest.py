import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Iterator

import pytest
import torch

from tests.launch import freeze_imported
from tests.zygote import Zygote

torch.set_num_threads(1)

_ZYGOTE = pytest.StashKey[Zygote]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported: freeze what the imports made, and, if a test will
    start worker processes, fork their template now, before any test has run."""
    freeze_imported()
    if any("zygote" in getattr(item, "fixturenames", ()) for item in session.items):
        session.config.stash[_ZYGOTE] = Zygote()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _ZYGOTE in config.stash:
        config.stash[_ZYGOTE].close()


@pytest.fixture(scope="session")
def zygote(request: pytest.FixtureRequest) -> Iterator[Zygote]:
    """The template process that forks worker processes (``tests/zygote.py``)."""
    yield request.config.stash[_ZYGOTE]
