"""Giving freed heap memory back to the operating system."""

from __future__ import annotations

import sys

import pytest

from tests.memory import resident_after


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim, RSS from /proc")
def test_freed_heap_between_live_tensors_goes_back_to_the_system() -> None:
    """Every other one of 100 4 MB tensors freed (below glibc's mapping threshold once it
    has freed a larger block, so they come from its heap) leaves 200 MB of holes between
    live tensors, which glibc keeps resident; releasing returns them."""
    setup = """
        import torch
        from tda_plugins.utils.heap import release_free_heap
        torch.ones(1 << 22)  # freed at once: glibc then serves up to 16 MB from its heap
        big = [torch.ones(1 << 20) for _ in range(100)]  # 4 MB each
        del big[::2]
    """
    held, released = resident_after(setup, ["", "assert release_free_heap()"])
    assert held - released > 150 << 20, (held, released)
