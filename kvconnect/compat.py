"""The compatibility check: what two engines must agree on to exchange KV blocks, field by field.

A consumer compares the peer's `wire.Compat` fingerprint with its own before it decodes anything
else of the handshake, and names every field that differs.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from kvconnect.errors import HandshakeError
from kvconnect.wire import Compat, GroupCompat


class IncompatiblePeerError(HandshakeError):
    """The peer's compatibility fingerprint differs from ours; `.differences` is (field, ours, theirs)."""

    def __init__(self, message: str, differences: tuple[tuple[str, object, object], ...]) -> None:
        super().__init__(message)
        self.differences = differences


def check_compat(expected: Compat, got: Compat) -> None:
    """Raise IncompatiblePeerError (a HandshakeError) naming every field where `got` differs."""
    differences = [(name, getattr(expected, name), getattr(got, name))
                   for name in Compat.__struct_fields__
                   if name != "groups" and getattr(expected, name) != getattr(got, name)]
    differences += _group_differences(expected.groups, got.groups)
    if differences:
        listed = "; ".join(f"{name}: ours {ours!r}, peer's {theirs!r}" for name, ours, theirs in differences)
        fields = ", ".join(name for name, _, _ in differences)
        raise IncompatiblePeerError(f"incompatible peer ({fields} differ): {listed}", tuple(differences))


def _group_differences(ours: tuple[GroupCompat, ...], theirs: tuple[GroupCompat, ...]) -> list:
    if len(ours) != len(theirs):
        return [("group count", len(ours), len(theirs))]
    out: list[tuple[str, object, object]] = []
    for g, (a, b) in enumerate(zip(ours, theirs)):
        where = f"group {g} ({a.label})"
        if a.label != b.label:
            out.append((f"group {g} kind", a.label, b.label))
        if a.block_size != b.block_size:
            out.append((f"{where} block size", a.block_size, b.block_size))
        if len(a.page_bytes) != len(b.page_bytes):
            out.append((f"{where} layer count", len(a.page_bytes), len(b.page_bytes)))
        elif a.page_bytes != b.page_bytes:
            k = next(i for i, (x, y) in enumerate(zip(a.page_bytes, b.page_bytes)) if x != y)
            out.append((f"{where} page bytes of its layer {k}", a.page_bytes[k], b.page_bytes[k]))
        if a.layers != b.layers and len(a.page_bytes) == len(b.page_bytes):
            out.append((f"{where} layer-to-group map", a.layers, b.layers))
    return out


def layers_digest(names: Sequence[Sequence[str]]) -> str:
    """A stable digest of lists of layer names (a group's layers: the layer-to-group map)."""
    text = "\x1e".join("\x1f".join(sorted(n)) for n in names)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
