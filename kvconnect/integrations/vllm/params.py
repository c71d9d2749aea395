"""vLLM's P/D `kv_transfer_params` convention, translated to and from our `TransferParams`.

Routers pass the params a prefill instance returned to a decode instance unchanged; the names below
(`do_remote_prefill`, `remote_block_ids`, `remote_engine_id`, ...) are vLLM's, so existing routers
work as they are. `remote_incarnation`, `remote_lease_expiry` and `remote_ranks` (every TP rank of
the prefill engine as `[host, port, incarnation]`, rank 0 first) are ours.

Push mode (the router sends both halves at once): the prefill's params carry `do_remote_decode` and
`push_key`; the decode's carry `do_remote_prefill`, the same `push_key`, `remote_host` and
`remote_port` of the prefill's side channel (its rank 0) and `remote_tp_size` (its TP size, 1 if
absent: rank r listens at port + r), which the router learns once per prefill instance from a request
with `kvconnect_identify` (answered with the instance's params, no blocks held).

Either mode: a decode request's params may carry `kvconnect_load_timeout_s` (seconds, a positive
finite number), the router's deadline for that request's KV: how long the decode waits for the read
(pull) or holds its offered blocks for the WRITE (push) before it fails the load. It only shortens:
a value above the instance's `load_timeout_s` is capped at it, not refused. Anything else (a string,
a bool, NaN or infinity, zero or less) is refused like other malformed params: a pull's load fails
(stage params), a push-routed request is computed on the decode.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvconnect import wire

_KEYS = {"remote_engine_id": "engine_id", "remote_host": "host", "remote_port": "port",
         "remote_request_id": "request_id", "remote_num_tokens": "num_tokens",
         "remote_lease_expiry": "lease_expiry", "remote_incarnation": "incarnation"}


def to_vllm(p: wire.TransferParams) -> dict[str, Any]:
    """Our TransferParams as vLLM's P/D kv_transfer_params (what the decode request carries)."""
    out: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, "tp_size": p.tp_size,
                           "remote_block_ids": p.block_ids[0] if len(p.block_ids) == 1 else p.block_ids}
    out.update({theirs: getattr(p, ours) for theirs, ours in _KEYS.items()})
    if p.ranks:
        out["remote_ranks"] = [[r.host, r.port, r.incarnation] for r in p.ranks]
    return out


def from_vllm(d: dict[str, Any]) -> wire.TransferParams:
    """vLLM P/D kv_transfer_params (as a router forwards them) as checked TransferParams; WireError otherwise."""
    missing = sorted(k for k in (*_KEYS, "remote_block_ids") if k not in d)
    if missing:
        raise wire.WireError(f"kv_transfer_params lack {missing} (were they produced by a kvconnect prefill?)")
    ids = d["remote_block_ids"]
    groups = ids if ids and isinstance(ids[0], (list, tuple)) else [ids]
    ranks = {"ranks": d["remote_ranks"]} if d.get("remote_ranks") else {}
    return wire.transfer_params_from_builtins({"block_ids": groups, **ranks,
                                               **{ours: d[theirs] for theirs, ours in _KEYS.items()}})


def wants_remote_prefill(d: dict[str, Any] | None) -> bool:
    """Whether a decode request's params ask for a pull."""
    return bool(d) and bool(d.get("do_remote_prefill")) and d.get("remote_block_ids") is not None


def wants_remote_decode(d: dict[str, Any] | None) -> bool:
    """Whether a prefill request's params ask for its blocks to be held for a decode instance."""
    return bool(d) and bool(d.get("do_remote_decode"))


class PushSource(NamedTuple):
    """A decode request routed in push mode: the router's key, and where the prefill's side channel is."""

    key: str
    host: str
    port: int
    tp_size: int = 1  # the prefill's TP size: its rank r listens at port + r
    timeout_s: float | None = None  # the router's shorter load deadline (`load_timeout`; None: load_timeout_s)


def push_source(d: dict[str, Any] | None) -> PushSource | None:
    """The push half of a decode request's params (None for a pull); WireError if they are malformed."""
    if not d or not d.get("do_remote_prefill") or "push_key" not in d:
        return None
    key, host, port = d.get("push_key"), d.get("remote_host"), d.get("remote_port")
    tp = d.get("remote_tp_size", 1)
    if not (_is_key(key) and isinstance(host, str) and 1 <= len(host) <= 255 and _is_int(port, 1, 65535)
            and _is_int(tp, 1, wire.MAX_TP) and port + tp - 1 <= 65535):
        names = ("push_key", "remote_host", "remote_port", "remote_tp_size")
        raise wire.WireError("push-mode kv_transfer_params need push_key (1 to 128 characters), remote_host, "
                             f"remote_port and optionally remote_tp_size; got {({k: d.get(k) for k in names})}")
    return PushSource(key, host, port, tp)


def push_key(d: dict[str, Any] | None) -> str | None:
    """The key of a prefill request routed in push mode (None for a pull); WireError if malformed."""
    if not wants_remote_decode(d) or "push_key" not in d:
        return None
    if not _is_key(d["push_key"]):
        raise wire.WireError(f"push_key must be a string of 1 to 128 characters, got {d['push_key']!r}")
    return d["push_key"]


def load_timeout(d: dict[str, Any] | None, limit_s: float) -> float | None:
    """A decode request's own load deadline, capped at `limit_s` (None without one); WireError if malformed."""
    if not d or wire.LOAD_TIMEOUT_KEY not in d:
        return None
    return wire.load_timeout_from_builtins(d[wire.LOAD_TIMEOUT_KEY], limit_s)


def wants_identity(d: dict[str, Any] | None) -> bool:
    """Whether a request only asks who this prefill instance is (a router learning where to push from)."""
    return bool(d) and bool(d.get("kvconnect_identify"))


def _is_int(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_key(key: object) -> bool:
    return isinstance(key, str) and 1 <= len(key) <= 128
