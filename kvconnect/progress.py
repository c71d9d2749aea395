"""One-line progress bars on stderr for commands that take more than a few seconds (stdout stays clean)."""

from __future__ import annotations

import sys
from typing import Callable


def bar(label: str) -> Callable[[int, int], None]:
    """A `progress(done, total)` callback drawing `label [####....] done/total` on one stderr line."""

    def progress(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        end = "\n" if done >= total else ""
        print(f"\r  {label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end, file=sys.stderr,
              flush=True)

    return progress
