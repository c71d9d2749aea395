"""Argument types of the `kvconnect` commands: every value is checked while the command line is parsed.

A bad value ends in argparse's one-line error naming the flag (exit code 2), never in a traceback or
a run that measured nothing.
"""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def port(text: str) -> int:
    """A TCP port, 1 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers, e.g. `256,1024,4096`."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, got nothing")
    return [positive_int(p) for p in parts if p]


def preset_names() -> list[str]:
    """The names of the model-shaped cache presets (kvconnect.presets)."""
    from kvconnect.presets import PRESETS

    return list(PRESETS)


class UsageError(Exception):
    """A command-line value that only the command itself can judge (exit code 2, one line)."""
