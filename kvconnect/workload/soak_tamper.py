"""Tampered transfer params for the soak: each names something other than what the producer holds.

A router or a network between prefill and decode may hand a consumer params that were never issued:
an unknown or already ended request id, block ids outside the producer's cache, another engine's
id, an address that is garbled or that nobody answers on. Each must be refused when the params are
parsed or fail its own load, within the load's deadline; it must never load, and never disturb the
loads beside it.
"""

from __future__ import annotations

import socket
from typing import Sequence

import numpy as np

TAMPERS = ("tamper_request_id", "tamper_block_ids", "tamper_engine_id", "tamper_address")


def closed_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tampered(kind: str, params: dict, rng: np.random.Generator, *, num_blocks: int,
             ended_ids: Sequence[str]) -> tuple[dict, str]:
    """A copy of `params` tampered the way `kind` says, and a few words naming how."""
    p = {**params, "block_ids": [list(g) for g in params["block_ids"]]}
    choice = int(rng.integers(0, 4))
    if kind == "tamper_request_id":
        if ended_ids and choice < 2:
            p["request_id"] = str(ended_ids[int(rng.integers(0, len(ended_ids)))])
            return p, "the id of a request whose lease already ended"
        p["request_id"] = f"never-held-{int(rng.integers(0, 1 << 31))}"
        return p, "an id the producer never held"
    if kind == "tamper_block_ids":
        where = int(rng.integers(0, len(p["block_ids"][0])))
        bad = [num_blocks, num_blocks + int(rng.integers(1, 1 << 20)), 1 << 40, -1][choice]
        p["block_ids"][0][where] = bad
        return p, f"remote block id {bad} in a cache of {num_blocks} blocks"
    if kind == "tamper_engine_id":
        p["engine_id"] = f"impostor-{int(rng.integers(0, 1 << 31)):08x}"
        return p, "another engine's id at the producer's address"
    if kind == "tamper_address":
        if choice == 0:
            p["port"] = closed_port()
            return p, "a port nobody listens on"
        if choice == 1:
            p["host"] = "256.300.1.999"
            return p, "a host that is no address"
        if choice == 2:
            p["port"] = 0
            return p, "port 0"
        p["host"] = ""
        return p, "an empty host"
    raise ValueError(f"unknown tamper {kind!r}")
