"""Giving the C allocator's freed memory back to the operating system.

On Linux, glibc serves the many mid-sized tensors of a training or capture pass (a few
MB each) from its heap, and keeps what they free resident: after a capture of 256 rows
of a 10M-parameter model, about 430 MB. A scoring pass then allocates its own buffers
(chunks of hundreds of MB, mapped afresh) on top of that. ``malloc_trim`` returns the
free heap first; where the C library has no such call this is a no-op.
"""

from __future__ import annotations

import ctypes


def release_free_heap() -> bool:
    """Return the heap memory the process has freed to the operating system (glibc's
    ``malloc_trim(0)``); False where the C library has no such call."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the symbols already loaded: libc's
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows)
        return False
    trim(0)
    return True
