"""Argument types of the `kvconnect` commands: every value is checked while the command line is parsed.

A bad value ends in argparse's one-line error naming the flag (exit code 2), never in a traceback or
a run that measured nothing.
"""

from __future__ import annotations

import argparse
import math
import os

# The most requests one measured run takes: at the default 4096 tokens of llama3-8b that is 5 TiB
# moved (and a raw baseline repeated half as many times); anything larger is a typo, not a benchmark.
MAX_REQUESTS = 10_000


def _number(text: str, convert, expected: str, ok, bound: str):
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{bound}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    return _number(text, int, "a positive integer", lambda v: v >= 1, "must be at least 1")


def positive_float(text: str) -> float:
    """A finite number above 0."""
    return _number(text, float, "a positive number", lambda v: math.isfinite(v) and v > 0,
                   "must be a positive number")


def port(text: str) -> int:
    """A TCP port, 1 to 65535."""
    return _number(text, int, "a port number", lambda v: 1 <= v <= 65535, "must be in 1..65535")


def requests(text: str) -> int:
    """A number of requests, 1 to MAX_REQUESTS."""
    return _number(text, int, "a positive integer", lambda v: 1 <= v <= MAX_REQUESTS,
                   f"must be in 1..{MAX_REQUESTS}")


def writable_dir(text: str) -> str:
    """An existing directory this user can create files in."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no such directory: {text!r}")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot create files in {text!r}")
    return text


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers, e.g. `256,1024,4096`."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, got nothing")
    return [positive_int(p) for p in parts if p]


def add_pull_options(parser: argparse.ArgumentParser) -> None:
    """The options of a measured P/D pull, shared by `kvconnect demo` and `kvconnect bench transfer`."""
    parser.add_argument("--backend", default="nixl", choices=["nixl", "mooncake"])
    parser.add_argument("--preset", default="llama3-8b", choices=preset_names(), help="KV-cache shape")
    parser.add_argument("--tokens", type=positive_int, default=4096, help="tokens per request")
    parser.add_argument("--requests", type=requests, default=8, help=f"requests pulled (at most {MAX_REQUESTS})")
    parser.add_argument("--concurrency", type=positive_int, default=2, help="requests in flight at once")
    parser.add_argument("--block-table", default="random", choices=["random", "contiguous"],
                        help="how block ids are laid out on each side")
    parser.add_argument("--seed", type=int, default=0)


def preset_names() -> list[str]:
    """The names of the model-shaped cache presets (kvconnect.presets)."""
    from kvconnect.presets import PRESETS

    return list(PRESETS)


class UsageError(Exception):
    """A command-line value that only the command itself can judge (exit code 2, one line).

    Raised from a command module's `check_arguments(args)`, it ends the parse like any bad flag.
    """
