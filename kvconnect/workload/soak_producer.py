"""The soak's producer: a prefill worker in its own process, and the handle the soak commands it through.

The child registers small KV caches with a producer `KVConnector` and answers holds: for each, it
takes free blocks, writes the request's seeded bytes into them (its "prefill"), holds them under a
lease and returns the transfer params. When a lease ends it scribbles over the blocks at once and
puts them back in its free list, as an engine reusing them would: a load that reads after the
lease ended gets other bytes, and the soak sees it. The pipe plays the router's part only (params
out, commands in); consumers reach the producer through kvconnect's own side channel.

The handle sends real signals: SIGKILL (then a fresh process on the same port), SIGSTOP, SIGCONT.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvconnect.workload.soak_schedule import content, quiet_logs

START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Shape:
    """The KV caches of both sides: `regions` layers of `num_blocks` blocks of `row_bytes` bytes."""

    regions: int = 2
    row_bytes: int = 4096
    num_blocks: int = 2048

    def caches(self, num_blocks: int | None = None) -> dict:
        """Zeroed torch caches of this shape (one uint8 tensor per layer)."""
        import torch

        n = self.num_blocks if num_blocks is None else num_blocks
        return {f"layers.{k}": torch.zeros(n, self.row_bytes, dtype=torch.uint8) for k in range(self.regions)}


class _Blocks:
    """The child's blocks: free list, held requests, and the writes of a prefill and of a reuse."""

    def __init__(self, views: list[np.ndarray], shape: Shape):
        self.views, self.shape = views, shape
        self.free = np.ones(shape.num_blocks, dtype=bool)
        self.held: dict[str, np.ndarray] = {}
        self.ends: dict[str, int] = {}  # leases ended, by reason
        self._scribble = np.random.default_rng(os.getpid())

    def take(self, rid: str, count: int, seed: int) -> np.ndarray:
        """Free blocks for request `rid`, filled with its seeded bytes."""
        free = np.flatnonzero(self.free)
        if free.size < count:
            raise RuntimeError(f"producer out of free blocks ({free.size} free, {len(self.held)} requests held)")
        ids = np.random.default_rng(seed).choice(free, size=count, replace=False)
        rows = content(seed, self.shape.regions, count, self.shape.row_bytes)
        for k, view in enumerate(self.views):
            view[ids] = rows[k]
        self.free[ids] = False
        self.held[rid] = ids
        return ids

    def give_back(self, rid: str) -> None:
        """A lease ended: the blocks are reused at once (other bytes written into them)."""
        ids = self.held.pop(rid, None)
        if ids is None:
            return
        for view in self.views:
            view[ids] = self._scribble.integers(0, 256, (ids.size, view.shape[1]), dtype=np.uint8)
        self.free[ids] = True


def _hold(connector: Any, blocks: _Blocks, rid: str, count: int, seed: int, lease_s: float | None) -> dict:
    from kvconnect import wire

    # An engine out of free blocks waits for leases to end; every lease ends by its expiry at the latest.
    deadline = time.monotonic() + connector.config.lease_s + 3.0
    while blocks.free.sum() < count and time.monotonic() < deadline:
        _drain(connector, blocks)
        time.sleep(0.005)
    ids = blocks.take(rid, count, seed)
    try:
        if lease_s is None:
            params = connector.request_finished(rid, [ids.tolist()], count * 16)
        else:  # a short lease of its own: the engine's hold with a length, as push mode uses it
            params = connector.producer.hold(rid, [ids.tolist()], count * 16, lease_s=lease_s)
    except BaseException:
        blocks.give_back(rid)
        raise
    return wire.transfer_params_to_builtins(params)


def _drain(connector: Any, blocks: _Blocks) -> None:
    for end in connector.producer.poll():
        blocks.give_back(end.request_id)
        blocks.ends[end.reason.value] = blocks.ends.get(end.reason.value, 0) + 1


def _held(connector: Any, blocks: _Blocks, wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    while connector.held_blocks and time.monotonic() < deadline:
        _drain(connector, blocks)
        time.sleep(0.02)
    _drain(connector, blocks)
    return int(connector.held_blocks)


def serve(pipe: Any, backend: str, engine_id: str, port: int, lease_s: float, shape: Shape, quiet: bool) -> None:
    """The child: register, report ("ready", host, port, pid), then answer commands until None or EOF."""
    from kvconnect.connector import ConnectorConfig, KVConnector

    quiet_logs(quiet)
    caches = shape.caches()
    connector = KVConnector(ConnectorConfig(role="producer", backend=backend, engine_id=engine_id, port=port,
                                            lease_s=lease_s))
    try:
        connector.register_kv_caches(caches)
        blocks = _Blocks([t.numpy() for t in caches.values()], shape)
        host, bound = connector.side_channel
        pipe.send(("ready", host, bound, os.getpid()))
        while True:
            if not pipe.poll(0.005):
                _drain(connector, blocks)
                continue
            cmd = pipe.recv()
            if cmd is None:
                return
            _drain(connector, blocks)
            try:
                if cmd[0] == "hold":
                    value: Any = [_hold(connector, blocks, *h) for h in cmd[1]]
                elif cmd[0] == "ends":
                    value, blocks.ends = blocks.ends, {}
                else:
                    value = _held(connector, blocks, cmd[1])
                pipe.send(("ok", value))
            except Exception as exc:  # reported to the soak, which counts it; the producer keeps serving
                pipe.send(("error", f"{type(exc).__name__}: {exc}"))
    except EOFError:
        return
    finally:
        connector.close()


class ProducerProc:
    """A producer child process and the signals the soak sends it."""

    def __init__(self, backend: str, engine_id: str, lease_s: float, shape: Shape, quiet: bool = True):
        self.backend, self.engine_id, self.lease_s, self.shape = backend, engine_id, lease_s, shape
        self.quiet = quiet
        self.port = 0
        self.proc: Any = None
        self.pipe: Any = None
        self.pid = 0
        self.starts = 0

    def start(self) -> float:
        """Start a process (on the previous one's port once there was one); returns the seconds it took."""
        t0 = time.monotonic()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, self.backend, self.engine_id, self.port, self.lease_s,
                                                    self.shape, self.quiet), daemon=True)
        self.proc.start()
        child.close()
        self.pipe = parent
        tag, *rest = self._answer(START_TIMEOUT_S, "start")
        _, self.port, self.pid = rest
        self.starts += 1
        return time.monotonic() - t0

    def _answer(self, timeout: float, what: str) -> Any:
        if not self.pipe.poll(timeout):
            raise RuntimeError(f"producer {self.engine_id} did not answer {what!r} within {timeout} s")
        try:
            answer = self.pipe.recv()
        except EOFError:
            raise RuntimeError(f"producer {self.engine_id} exited (code {self.proc.exitcode}) "
                               f"during {what!r}") from None
        if answer[0] == "error":
            raise RuntimeError(f"producer {self.engine_id} failed {what!r}: {answer[1]}")
        return answer if answer[0] == "ready" else answer[1]

    def hold(self, holds: list[tuple[str, int, int, float | None]]) -> list[dict]:
        """Hold requests (rid, blocks, content seed, own lease or None); their transfer params as plain data."""
        self.pipe.send(("hold", holds))
        return self._answer(CALL_TIMEOUT_S, "hold")

    def held_blocks(self, wait_s: float) -> int:
        """Blocks still held after waiting up to `wait_s` for every lease to end."""
        self.pipe.send(("held", wait_s))
        return self._answer(wait_s + CALL_TIMEOUT_S, "held")

    def lease_ends(self) -> dict[str, int]:
        """How leases ended (done, aborted, expired) since the previous call."""
        self.pipe.send(("ends",))
        return self._answer(CALL_TIMEOUT_S, "ends")

    def signal(self, sig: int) -> None:
        """Send a signal to the child (SIGSTOP, SIGCONT)."""
        os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL: no goodbye, no cleanup; the pipe goes with it."""
        if self.proc is not None and self.proc.is_alive():
            os.kill(self.pid, signal.SIGCONT)  # a stopped process dies only once it runs
            self.proc.kill()
            self.proc.join(10)
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None

    def stop(self) -> None:
        """Orderly stop, killed if it does not exit."""
        if self.proc is None:
            return
        if self.proc.is_alive() and self.pipe is not None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.pipe.send(None)
            except (OSError, ValueError):
                pass
            self.proc.join(15)
        self.kill()
        self.proc = None
