"""A measured P/D pull between two processes: a producer child holds patterned blocks, this process pulls.

Shared by `kvconnect demo` and the transfer benchmark. The producer is a separate process (spawned,
so nothing is inherited) that talks to the consumer through kvconnect's own side channel; the pipe
between the two only plays the router's part (it carries transfer params, as an HTTP router would).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import numpy as np
import torch

from kvconnect.progress import bar

PIPE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PullSpec:
    """What to pull and how."""

    backend: str = "nixl"
    preset: str = "llama3-8b"
    tokens: int = 4096
    requests: int = 16
    concurrency: int = 4
    block_table: str = "random"
    raw: bool = True
    seed: int = 0
    block_size: int | None = None  # tokens per block; None keeps the preset's
    layout: str = "LBHNC"  # attention pages layers outermost, or BLHNC: blocks outermost (cross-layer)

    def model(self) -> Any:
        """The preset, with the block size overridden when asked."""
        from kvconnect.presets import PRESETS

        base = PRESETS[self.preset]
        return base if self.block_size is None else replace(base, block_size=self.block_size)


# ---- the byte pattern both sides derive independently ----

def _base_rows(num_regions: int, page_bytes: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (page_bytes[k],), dtype=torch.uint8, generator=gen) for k in range(num_regions)]


def _tags(region: int, request: int, count: int) -> torch.Tensor:
    # (request, region, position) in the first 8 bytes of a block: a block landing in the wrong place
    # is caught; the random base row behind it catches any byte moved within or across blocks.
    pos = torch.arange(count, dtype=torch.int64)
    return ((request << 40) | (region << 24) | pos).view(torch.uint8).view(count, 8)


def fill_blocks(view: torch.Tensor, ids: np.ndarray, base: torch.Tensor, region: int, request: int) -> None:
    """Write the pattern of `request` into blocks `ids` of one region's `(num_blocks, page)` byte view."""
    rows = base.expand(ids.size, -1).clone()
    rows[:, :8] = _tags(region, request, ids.size)
    view[torch.from_numpy(ids)] = rows


def blocks_match(view: torch.Tensor, ids: np.ndarray, base: torch.Tensor, region: int, request: int) -> bool:
    """Whether blocks `ids` of one region hold exactly the pattern `fill_blocks` wrote for `request`."""
    got = view[torch.from_numpy(ids)]
    return bool(torch.equal(got[:, :8], _tags(region, request, ids.size)) and (got[:, 8:] == base[8:]).all())


def _byte_views(caches: dict[str, torch.Tensor], regions: Any) -> list[torch.Tensor]:
    """Per region, its blocks as a `(num_blocks, block bytes)` uint8 view of the storage that holds them."""
    out = []
    for r in regions:
        tensor = caches[r.names[0]]
        storage = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
        offset = r.base_addr - tensor.untyped_storage().data_ptr()
        out.append(storage.as_strided((r.num_blocks, r.block_bytes), (r.block_stride, 1), offset))
    return out


def _pick_blocks(rng: np.random.Generator, num_blocks: int, need: list[int], slots: int, table: str) -> list[list[np.ndarray]]:
    """`slots` disjoint block tables (one array per group) within `num_blocks`."""
    out = []
    for g, n in enumerate(need):
        ids = rng.permutation(num_blocks)[: n * slots] if table == "random" else np.arange(n * slots)
        out.append([ids[i * n:(i + 1) * n] for i in range(slots)])
    return [[out[g][s] for g in range(len(need))] for s in range(slots)]


# ---- producer process ----

def _producer_main(conn: Any, spec: PullSpec, num_blocks: int) -> None:
    from kvconnect.connector import ConnectorConfig, KVConnector

    # The raw baseline runs first and alone: an idle transport's progress thread would take a core
    # from it on a small host.
    cmd, payload = conn.recv()
    if cmd == "raw":
        from kvconnect.workload.raw import RawSide

        raw = RawSide(spec.backend, payload, fill=True)
        try:
            conn.send(("raw", raw.metadata()))
            conn.recv()  # the reader is done
        finally:
            raw.close()
    preset = spec.model()
    caches, groups = preset.allocate(num_blocks, spec.layout)
    conn_ = KVConnector(ConnectorConfig(role="producer", backend=spec.backend, engine_id="bench-prefill",
                                        block_size=preset.block_size, groups=groups))
    try:
        conn_.register_kv_caches(caches)
        views = _byte_views(caches, conn_.regions)
        base = _base_rows(len(views), [v.shape[1] for v in views], spec.seed)
        rng = np.random.default_rng(spec.seed + 1)
        conn.send(("ready", conn_.side_channel))
        while True:
            cmd, payload = conn.recv()
            if cmd == "hold":
                tables = _pick_blocks(rng, num_blocks, preset.blocks_for(spec.tokens), len(payload), spec.block_table)
                params = []
                for (req, rid), table in zip(payload, tables):
                    for g, regions in enumerate(conn_.group_regions):
                        for k in regions:
                            fill_blocks(views[k], table[g], base[k], k, req)
                    params.append(conn_.request_finished(rid, table, spec.tokens))
                conn.send(("params", [_builtins(p) for p in params]))
            elif cmd == "drain":
                deadline = time.monotonic() + payload
                released: list[str] = []
                while conn_.held_blocks and time.monotonic() < deadline:
                    released += conn_.get_finished().sending
                    time.sleep(0.001)
                released += conn_.get_finished().sending
                conn.send(("drained", conn_.held_blocks))
            elif cmd == "stop":
                break
    finally:
        conn_.close()
        conn.send(("stopped", None))


def _builtins(params: Any) -> dict:
    from kvconnect import wire

    return wire.transfer_params_to_builtins(params)


def expect_reply(conn: Any, expect: str, proc: mp.Process) -> Any:
    """The payload of a producer process's next reply, which must be `expect`; bounded by PIPE_TIMEOUT_S."""
    if not conn.poll(PIPE_TIMEOUT_S):
        raise RuntimeError(f"producer process sent nothing for {PIPE_TIMEOUT_S:.0f} s (exit code {proc.exitcode})")
    kind, payload = conn.recv()
    if kind != expect:
        raise RuntimeError(f"producer process said {kind!r}, expected {expect!r}")
    return payload


# ---- consumer (this process) ----

class _Run:
    """The consumer side of one measured pull: waves of concurrent requests, every byte checked."""

    def __init__(self, spec: PullSpec, progress: Callable[[int, int], None] | None):
        from kvconnect.connector import ConnectorConfig, KVConnector

        self.spec, self.progress = spec, progress
        self.preset = spec.model()
        self.need = self.preset.blocks_for(spec.tokens)
        self.num_blocks = max(self.need) * spec.concurrency + 8
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer_main, args=(child, spec, self.num_blocks), daemon=True)
        self.proc.start()
        self.caches, self.groups = self.preset.allocate(self.num_blocks, spec.layout)
        self.consumer = KVConnector(ConnectorConfig(role="consumer", backend=spec.backend, engine_id="bench-decode",
                                                    block_size=self.preset.block_size, groups=self.groups))
        self.latencies: list[float] = []
        self.failed: dict[str, str] = {}
        self.verified = True
        self.held_after = -1
        self.done = 0
        self.rng = np.random.default_rng(spec.seed + 2)

    def start(self) -> tuple[float, float]:
        """The raw baselines (when asked for), then registration; returns the raw GB/s, whole buffer and
        as this run's entries (0 without them)."""
        raw = (0.0, 0.0)
        if self.spec.raw:
            raw = _raw_baseline(self.spec, *self._entries(), self.pipe, self.proc)
        else:
            self.pipe.send(("no-raw", None))
        expect_reply(self.pipe, "ready", self.proc)
        self.consumer.register_kv_caches(self.caches)
        self.views = _byte_views(self.caches, self.consumer.regions)
        self.base = _base_rows(len(self.views), [v.shape[1] for v in self.views], self.spec.seed)
        return raw

    def _entries(self) -> tuple[np.ndarray, np.ndarray]:
        """The byte size of each descriptor one request posts (its blocks of every layer of every group),
        and how many of them each layer has."""
        def page(name: str) -> int:
            t = self.caches[name]
            return t[0].numel() * t.element_size()
        layers = [(n, page(name)) for n, group in zip(self.need, self.groups) for name in group.layers]
        return (np.concatenate([np.full(n, size, dtype=np.int64) for n, size in layers]),
                np.array([n for n, _ in layers], dtype=np.int64))

    def wave(self, members: list[tuple[int, str]], timed: bool) -> float:
        """Hold, pull and check one wave of requests; returns its pull seconds."""
        self.pipe.send(("hold", members))
        params = expect_reply(self.pipe, "params", self.proc)
        tables = _pick_blocks(self.rng, self.num_blocks, self.need, len(members), self.spec.block_table)
        started: dict[str, float] = {}
        t0 = time.perf_counter()
        for (_, rid), p, table in zip(members, params, tables):
            started[rid] = time.perf_counter()
            self.consumer.start_load(p, table)
        pending = set(started)
        while pending:
            fin = self.consumer.get_finished()
            now = time.perf_counter()
            for rid in fin.loaded:
                pending.discard(rid)
                if timed:
                    self._finished(now - started[rid])
            for rid, why in fin.failed.items():
                pending.discard(rid)
                self.failed[rid] = str(why)
            if pending:
                time.sleep(0.0002)
        seconds = time.perf_counter() - t0
        self._check(members, tables)
        self.pipe.send(("drain", 30.0))
        self.held_after = expect_reply(self.pipe, "drained", self.proc)
        return seconds

    def _finished(self, seconds: float) -> None:
        self.latencies.append(seconds)
        self.done += 1
        if self.progress:
            self.progress(self.done, self.spec.requests)

    def _check(self, members: list[tuple[int, str]], tables: list[list[np.ndarray]]) -> None:
        for (req, rid), table in zip(members, tables):
            if rid in self.failed:
                continue
            for g, regions in enumerate(self.consumer.group_regions):
                for k in regions:
                    self.verified &= blocks_match(self.views[k], table[g], self.base[k], k, req)

    def close(self) -> None:
        """Stop the producer and close the consumer."""
        self.consumer.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()

    def figures(self, pull_seconds: float, raw: tuple[float, float]) -> dict[str, Any]:
        """What the run measured, as one dict."""
        spec = self.spec
        per_request = self.preset.bytes_per_request(spec.tokens)
        moved = per_request * (spec.requests - len(self.failed))
        lat_ms = np.array(self.latencies) * 1e3 if self.latencies else np.array([float("nan")])
        gbps = moved / pull_seconds / 1e9 if pull_seconds else 0.0
        regions_per_group = [len(g) for g in self.consumer.group_regions]
        return {
            **asdict(spec), "description": self.preset.description, "bytes": moved, "bytes_per_request": per_request,
            "seconds": pull_seconds, "gbps": gbps, "p50_ms": float(np.percentile(lat_ms, 50)),
            "p99_ms": float(np.percentile(lat_ms, 99)),
            "descriptors_per_request": int(sum(n * k for n, k in zip(self.need, regions_per_group))),
            "verified": self.verified and not self.failed, "failed": self.failed,
            "held_blocks_after": self.held_after, "raw_backend": spec.backend, "raw_gbps": raw[0],
            "ratio_vs_raw": gbps / raw[0] if raw[0] else None, "raw_entries_gbps": raw[1],
            "ratio_vs_raw_entries": gbps / raw[1] if raw[1] else None,
        }


def run_pull(spec: PullSpec, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Pull `spec.requests` requests from a producer process; returns the measured figures."""
    run = _Run(spec, progress)
    pull_seconds = 0.0
    try:
        raw = run.start()
        # One untimed request first: the handshake and the peer's prepared lists are a once-per-peer
        # cost, reported by `kvconnect bench handshake`, not part of a request's pull.
        run.wave([(spec.requests, "warm-up")], timed=False)
        if progress:
            progress(0, spec.requests)
        for start in range(0, spec.requests, spec.concurrency):
            members = [(r, f"req-{r}") for r in range(start, min(spec.requests, start + spec.concurrency))]
            pull_seconds += run.wave(members, timed=True)
        run.pipe.send(("stop", None))
        expect_reply(run.pipe, "stopped", run.proc)
    finally:
        run.close()
    return run.figures(pull_seconds, raw)


def _raw_baseline(spec: PullSpec, sizes: np.ndarray, runs: np.ndarray, parent: Any,
                  proc: mp.Process) -> tuple[float, float]:
    from kvconnect.transport.options import DEFAULT_MAX_BATCH_ENTRIES
    from kvconnect.workload.raw import RawSide

    nbytes = int(sizes.sum())
    parent.send(("raw", nbytes))
    remote = expect_reply(parent, "raw", proc)
    side = RawSide(spec.backend, nbytes, fill=False)
    repeat = max(3, spec.requests // spec.concurrency)
    try:
        whole = side.read_gbps(remote, repeat=repeat)
        # kvconnect's Mooncake transport posts a request in batches of max_batch_entries, one after another
        # per peer; NIXL takes a request's descriptors as one transfer.
        return whole, side.read_entries_gbps(remote, sizes, runs, batch=DEFAULT_MAX_BATCH_ENTRIES, repeat=repeat,
                                             seed=spec.seed)
    finally:
        side.close()
        parent.send(("raw-done", None))


progress_bar = bar("pulling")


def memcpy_gbps(nbytes: int, repeat: int = 5) -> float:
    """Best-of GB/s of one contiguous host copy of `nbytes`: this machine's ceiling for moving bytes."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
