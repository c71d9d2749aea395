"""A measured P/D pull (or push) between engines of different tensor-parallel sizes, every byte checked.

Each prefill rank is a spawned process holding its shard (its KV heads) of every layer of a preset's
cache; each decode rank is a connector in this process. Every head of every block carries its own
tag (layer, block, head) and a per-head random row, so a decode rank checks that each head it
loaded is the one its TP size gives it, from the block the params named. Shared by `kvconnect bench
transfer --prefill-tp P --decode-tp D`, which runs the same bytes 1 -> 1 as its baseline and posts
the same descriptor lists through the backend alone. In push mode (`mode="push"`) the decode ranks
offer their blocks and the prefill ranks (rank r listening at a base port + r) write into them; a
request is timed from the offers to the last decode rank's load.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvconnect.workload.pull import expect_reply

@dataclass(frozen=True)
class TPSpec:
    """What to pull, between which TP sizes."""

    backend: str = "nixl"
    preset: str = "llama3-8b"
    tokens: int = 2048
    requests: int = 8
    prefill_tp: int = 2
    decode_tp: int = 1
    seed: int = 0
    mode: str = "pull"  # or "push": decode ranks offer, prefill ranks write
    port: int = 0  # push: prefill rank r listens at port + r


def consecutive_ports(host: str, n: int) -> int:
    """A base port with `n` free ports from it (a push-mode prefill's rank r listens at base + r)."""
    # Drawn below the kernel's ephemeral range: between this check and the ranks' binds, the ports
    # are free, and any outgoing connection or `bind(0)` on the host could take one from that range.
    low, high = _outside_ephemeral(n)
    for attempt in range(50):
        held: list[socket.socket] = []
        try:
            if low < high and attempt < 40:
                base = random.randrange(low, high)
            else:
                with socket.socket() as first:
                    first.bind((host, 0))
                    base = first.getsockname()[1]
            for p in range(base, base + n):
                held.append(socket.socket())
                held[-1].bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on {host}")


def _outside_ephemeral(n: int) -> tuple[int, int]:
    """Bases [low, high) whose `n` ports lie between 20000 and the kernel's ephemeral range (empty if none)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return 20000, first - n


def rank_caches(spec: TPSpec, num_blocks: int, tp: int, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """One rank's attention caches (pages `[heads, tokens, content]`, its heads only) and their splits."""
    from kvconnect.presets import PRESETS
    from kvconnect.shards import attention, owned

    p = PRESETS[spec.preset]
    first, n = owned(p.kv_heads, tp, rank)
    head_bytes = p.head_content * p.dtype.itemsize
    caches = {f"layers.{i}.attn": torch.zeros((num_blocks, n, p.block_size * head_bytes), dtype=torch.uint8)
              for i in range(p.attention_layers)}
    split = attention(p.block_size, n, head_bytes, p.kv_heads, heads_outer=True)
    return caches, {name: split for name in caches}


def _pattern(spec: TPSpec, layer: int, blocks: np.ndarray, first: int, n: int, unit: int) -> torch.Tensor:
    """The bytes of heads first..first+n of `blocks` in one layer: a per-head row, tagged per block and head."""
    rows = torch.from_numpy(np.random.default_rng(spec.seed + layer).integers(0, 256, (first + n, unit), np.uint8))
    out = rows[first:].expand(blocks.size, -1, -1).clone()
    heads = np.arange(first, first + n, dtype=np.int64)
    tags = (layer << 48) | (blocks.astype(np.int64)[:, None] << 16) | heads[None, :]
    out[:, :, :8] = torch.from_numpy(tags).view(torch.uint8).view(blocks.size, n, 8)
    return out


def _producer_main(conn: Any, spec: TPSpec, num_blocks: int, rank: int) -> None:
    from kvconnect import wire
    from kvconnect.connector import ConnectorConfig, KVConnector
    from kvconnect.shards import owned

    caches, shards = rank_caches(spec, num_blocks, spec.prefill_tp, rank)
    from kvconnect.presets import PRESETS

    first, n = owned(PRESETS[spec.preset].kv_heads, spec.prefill_tp, rank)
    for i, t in enumerate(caches.values()):
        t.copy_(_pattern(spec, i, np.arange(num_blocks), first, n, t.shape[2]))
    push = spec.mode == "push"
    c = KVConnector(ConnectorConfig(role="producer", backend=spec.backend, engine_id="bench-prefill-tp", rank=rank,
                                    world_size=spec.prefill_tp, shards=shards, push=push,
                                    port=spec.port + rank if push else 0))
    try:
        c.register_kv_caches(caches)
        conn.send(("ready", None))
        while True:
            cmd, payload = conn.recv()
            if cmd == "hold":
                rid, ids = payload
                conn.send(("params", wire.transfer_params_to_builtins(c.request_finished(rid, [ids], spec.tokens))))
            elif cmd == "push":  # write into the blocks the decode ranks offer for this key
                key, ids = payload
                c.push(key, [ids], handle=key)
            elif cmd == "drain":
                deadline = time.monotonic() + payload
                while c.held_blocks and time.monotonic() < deadline:
                    c.get_finished()
                    time.sleep(0.001)
                conn.send(("drained", c.held_blocks))
            elif cmd == "stop":
                break
    finally:
        c.close()
        conn.send(("stopped", None))


def run_tp_pull(spec: TPSpec) -> dict[str, Any]:
    """Pull (or push) `spec.requests` requests from `prefill_tp` rank processes into `decode_tp` ranks; figures."""
    from kvconnect.presets import PRESETS

    if spec.mode == "push" and not spec.port:
        spec = TPSpec(**{**spec.__dict__, "port": consecutive_ports("127.0.0.1", spec.prefill_tp)})
    preset = PRESETS[spec.preset]
    need = -(-spec.tokens // preset.block_size)
    num_blocks = need * 2 + 8
    ctx = mp.get_context("spawn")
    ranks = []
    for r in range(spec.prefill_tp):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_producer_main, args=(child, spec, num_blocks, r), daemon=True)
        proc.start()
        ranks.append((parent, proc))
    decoders: list = []
    rng = np.random.default_rng(spec.seed + 1)
    seconds, backend_seconds, verified, failed = [], [], True, 0
    try:
        decoders += _decode_ranks(spec, num_blocks)
        for pipe, proc in ranks:
            expect_reply(pipe, "ready", proc)
        for req in range(spec.requests + 1):  # the first is a warm-up: handshakes are once per peer
            remote, local = rng.permutation(num_blocks)[:need], rng.permutation(num_blocks)[:need]
            one = _one_push if spec.mode == "push" else _one_request
            took, ok, right = one(spec, ranks, decoders, f"req-{req}", remote, local)
            failed += not ok
            verified &= right
            if req:
                seconds.append(took)
                if spec.mode == "pull":
                    backend_seconds.append(_backend_only([c for c, _ in decoders], local, remote))
    finally:
        for c, _ in decoders:
            c.close()
        for pipe, proc in ranks:
            try:
                pipe.send(("stop", None))
            except OSError:
                pass
            proc.join(15)
            if proc.is_alive():
                proc.kill()
    per_request = preset.bytes_per_request(spec.tokens)
    backend = [per_request / s / 1e9 for s in backend_seconds if s]
    return {"prefill_tp": spec.prefill_tp, "decode_tp": spec.decode_tp, "mode": spec.mode,
            "bytes_per_request": per_request,
            "gbps": float(np.median([per_request / s / 1e9 for s in seconds])),
            "backend_gbps": float(np.median(backend)) if backend else None,
            "verified": verified and not failed, "failed": failed}


def _decode_ranks(spec: TPSpec, num_blocks: int) -> list:
    from kvconnect.connector import ConnectorConfig, KVConnector

    out = []
    for r in range(spec.decode_tp):
        caches, shards = rank_caches(spec, num_blocks, spec.decode_tp, r)
        c = KVConnector(ConnectorConfig(role="consumer", backend=spec.backend, engine_id="bench-decode-tp",
                                        rank=r, world_size=spec.decode_tp, shards=shards, push=spec.mode == "push"))
        out.append((c, caches))
        c.register_kv_caches(caches)
    return out


def _one_request(spec: TPSpec, ranks: list, decoders: list, rid: str, remote: np.ndarray,
                 local: np.ndarray) -> tuple[float, bool, bool]:
    """Hold on every prefill rank, pull into every decode rank; (seconds, loaded, bytes right and released)."""
    from kvconnect import wire
    from kvconnect.pd.producer import combine_ranks

    for pipe, _ in ranks:
        pipe.send(("hold", (rid, remote.tolist())))
    params = combine_ranks([wire.transfer_params_from_builtins(expect_reply(p, "params", proc)) for p, proc in ranks])
    t0 = time.perf_counter()
    for c, _ in decoders:
        c.start_load(params, [local], handle=rid)
    ok = _wait_all([c for c, _ in decoders], rid)
    return time.perf_counter() - t0, ok, _landed(spec, ranks, decoders, remote, local)


def _one_push(spec: TPSpec, ranks: list, decoders: list, key: str, remote: np.ndarray,
              local: np.ndarray) -> tuple[float, bool, bool]:
    """Every decode rank offers, every prefill rank writes; (seconds, loaded, bytes right and nothing held)."""
    t0 = time.perf_counter()
    for c, _ in decoders:
        c.expect_push(key, ("127.0.0.1", spec.port, spec.prefill_tp), [local], spec.tokens, handle=key)
    for pipe, _ in ranks:
        pipe.send(("push", (key, remote.tolist())))
    ok = _wait_all([c for c, _ in decoders], key)
    return time.perf_counter() - t0, ok, _landed(spec, ranks, decoders, remote, local)


def _landed(spec: TPSpec, ranks: list, decoders: list, remote: np.ndarray, local: np.ndarray) -> bool:
    """Each decode rank holds its heads of the remote blocks at `local`, and no prefill rank still holds any."""
    from kvconnect.presets import PRESETS
    from kvconnect.shards import owned

    right = True
    for r, (_, caches) in enumerate(decoders):
        first, n = owned(PRESETS[spec.preset].kv_heads, spec.decode_tp, r)
        for i, t in enumerate(caches.values()):
            right &= bool(torch.equal(t[torch.from_numpy(local)], _pattern(spec, i, remote, first, n, t.shape[2])))
    for pipe, _ in ranks:
        pipe.send(("drain", 30.0))
    right &= sum(expect_reply(p, "drained", proc) for p, proc in ranks) == 0
    return right


def _wait_all(conns: list, handle: str, timeout: float = 120.0) -> bool:
    pending, ok = set(range(len(conns))), True
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            fin = conns[r].get_finished()
            if handle in fin.loaded or handle in fin.failed:
                ok &= handle in fin.loaded
                pending.discard(r)
        if pending:
            time.sleep(0.0002)
    return ok and not pending


def _backend_only(conns: list, local: np.ndarray, remote: np.ndarray) -> float:
    """Seconds for every decode rank to post the same descriptors through its transport alone, at once."""
    t0 = time.perf_counter()
    posted = [(c.transport, c.transport.post("READ", peer_id, local, remote))
              for c in conns for peer_id in c.consumer.peer_ids()]
    states = [t.wait(h, timeout_s=60.0) for t, h in posted]
    took = time.perf_counter() - t0
    for t, h in posted:
        t.release(h)
    return took if all(s.value == "DONE" for s in states) else 0.0


def descriptor_build_ms(blocks: int = 131072, heads: int = 8, repeat: int = 5) -> tuple[float, int]:
    """Best milliseconds to build the descriptors of a 2 -> 1 head split of `blocks` blocks (one layer), and their count."""
    from kvconnect.regions import MemoryKind, Region, RegionSet
    from kvconnect.descriptors import slice_descriptors
    from kvconnect.shards import attention, page_slices

    unit = 16 * 256 * 2
    whole, half = attention(16, heads, 256 * 2, heads, True), attention(16, heads // 2, 256 * 2, heads, True)
    local = RegionSet([Region(("l",), 1 << 40, blocks, heads * unit, heads * unit, 0, MemoryKind.DRAM, whole)])
    peer = RegionSet([Region(("l",), 1 << 41, blocks, heads // 2 * unit, heads // 2 * unit, 0, MemoryKind.DRAM, half)])
    slices = {0: page_slices(whole, 1, 0, half, 2, 1)}
    ids = np.random.default_rng(0).permutation(blocks)
    best, rows = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        rows = slice_descriptors(local, ids, peer, ids, slices)[0].shape[0]
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, rows
