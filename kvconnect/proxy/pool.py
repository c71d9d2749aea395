"""Which prefill or decode instance gets the next request: least outstanding requests among the live ones.

Policy only: this module keeps counts and health marks and never does I/O, so the router's choice
can be tested without a network.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ROLES = ("prefill", "decode")


class NoInstanceError(Exception):
    """Every instance of a role is marked down (or none is configured)."""


def normalise_url(url: str) -> str:
    """`http(s)://host:port[/prefix]` without a trailing slash; anything else is a ValueError."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"instance URL must be http(s)://host:port, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"instance URL must not carry a query or fragment: {url!r}")
    return url.strip().rstrip("/")


@dataclass(eq=False)
class Instance:
    """One vLLM server the router forwards to."""

    url: str
    role: str
    outstanding: int = 0
    up: bool = True  # optimistic until a probe or a failed connection says otherwise
    last_error: str = ""
    served: int = 0
    _order: int = field(default=0, repr=False)


class Pool:
    """Instances of one role; `acquire` picks the live one with the fewest requests in flight."""

    def __init__(self, role: str, urls: list[str]):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        seen: set[str] = set()
        self.role = role
        self.instances: list[Instance] = []
        for url in urls:
            u = normalise_url(url)
            if u in seen:
                raise ValueError(f"{role} instance listed twice: {u}")
            seen.add(u)
            self.instances.append(Instance(u, role))
        if not self.instances:
            raise ValueError(f"at least one {role} instance is needed")
        # Ties go to the least recently picked, so equal loads still spread over every instance.
        self._tick = itertools.count()
        for inst in self.instances:
            inst._order = next(self._tick)

    def acquire(self, exclude: frozenset[str] = frozenset()) -> Instance:
        """The live instance with the fewest outstanding requests (not in `exclude`), now counted busy."""
        live = [i for i in self.instances if i.up and i.url not in exclude]
        if not live:
            down = ", ".join(f"{i.url} ({i.last_error or 'excluded'})" for i in self.instances)
            raise NoInstanceError(f"no live {self.role} instance: {down}")
        best = min(live, key=lambda i: (i.outstanding, i._order))
        best.outstanding += 1
        best._order = next(self._tick)
        return best

    def release(self, inst: Instance, *, ok: bool) -> None:
        """The request on `inst` ended; `ok` counts it as served."""
        inst.outstanding = max(0, inst.outstanding - 1)
        if ok:
            inst.served += 1

    def mark(self, inst: Instance, up: bool, error: str = "") -> bool:
        """Record a probe's or a request's verdict on an instance; True if it changed the instance's state."""
        changed = inst.up != up
        inst.up = up
        inst.last_error = "" if up else error
        return changed

    @property
    def any_up(self) -> bool:
        """Whether at least one instance is live."""
        return any(i.up for i in self.instances)
