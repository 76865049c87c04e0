"""Value types of the ``tda`` options: a bad value is a usage error (exit code 2) that
names the option and the value, raised by argparse before any work. Only a device other
than ``cpu`` imports torch (to ask whether this machine has it)."""

from __future__ import annotations

import argparse
import math
import re


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def finite_float(text: str) -> float:
    """A finite float."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite float >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def regex(text: str) -> str:
    """A valid Python regular expression."""
    try:
        re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid regex ({error})") from None
    return text


def device(text: str) -> str:
    """A torch device this machine has."""
    if text == "cpu":  # every machine has it: the default, checked without torch
        return text
    import torch

    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device") from None
    available = {
        "cpu": lambda: True,
        "cuda": lambda: (
            torch.cuda.is_available() and (parsed.index or 0) < torch.cuda.device_count()
        ),
        "mps": lambda: torch.backends.mps.is_available(),
    }
    if not available.get(parsed.type, lambda: False)():
        raise argparse.ArgumentTypeError(f"device {text!r} is not available on this machine")
    return text
