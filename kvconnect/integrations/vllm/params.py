"""vLLM's P/D `kv_transfer_params` convention, translated to and from our `TransferParams`.

Routers pass the params a prefill instance returned to a decode instance unchanged; the names below
(`do_remote_prefill`, `remote_block_ids`, `remote_engine_id`, ...) are vLLM's, so existing routers
work as they are. `remote_incarnation`, `remote_lease_expiry` and `remote_ranks` (every TP rank of
the prefill engine as `[host, port, incarnation]`, rank 0 first) are ours.
"""

from __future__ import annotations

from typing import Any

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
