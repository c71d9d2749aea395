"""The raw-backend baseline: the backend's own API moving one buffer as one descriptor, no kvconnect code.

Each side is a `RawSide` in its own process; the reader gets the writer's `metadata()` by any means
(the benchmarks use a pipe) and times whole-buffer READs, checking the bytes after the last one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import torch


def _pattern(nbytes: int) -> torch.Tensor:
    # A prime period, so no page-aligned copy mistake reproduces it; built by repetition, not arithmetic.
    period = torch.arange(251, dtype=torch.uint8)
    return period.repeat(-(-nbytes // 251))[:nbytes].clone()


class RawSide:
    """One end of a raw transfer: a registered buffer of `nbytes` and the backend's own agent."""

    def __init__(self, backend: str, nbytes: int, *, fill: bool):
        if backend not in ("nixl", "mooncake"):
            raise ValueError(f"no raw baseline for backend {backend!r}")
        self.backend = backend
        if backend == "mooncake":
            self._init_mooncake(nbytes, fill)
            return
        import nixl._api as nixl_api

        from kvconnect.transport.ucx import skip_ucx_ib_without_devices

        skip_ucx_ib_without_devices()
        self.nbytes = nbytes
        self.buf = _pattern(nbytes) if fill else torch.zeros(nbytes, dtype=torch.uint8)
        self.name = f"kvconnect-raw-{uuid.uuid4().hex[:8]}"
        # The reading side polls for itself; only the side being read needs NIXL's progress thread,
        # which otherwise keeps a core busy.
        self.agent = nixl_api.nixl_agent(self.name, nixl_api.nixl_agent_config(enable_prog_thread=fill, backends=["UCX"]))
        self._row = np.array([[self.buf.data_ptr(), nbytes, 0]], dtype=np.uint64)
        self.reg = self.agent.register_memory(self._row, "DRAM")
        self._remote: str | None = None
        self._handle: Any = None

    def metadata(self) -> dict[str, Any]:
        """What the reading side needs: agent metadata (Mooncake: session name) and the buffer's address."""
        if self.backend == "mooncake":
            return {"session": self.session, "addr": self.buf.data_ptr(), "nbytes": self.nbytes}
        return {"agent": bytes(self.agent.get_agent_metadata()), "addr": self.buf.data_ptr(), "nbytes": self.nbytes}

    def read_gbps(self, remote: dict[str, Any], repeat: int = 5) -> float:
        """Best-of GB/s of whole-buffer READs from the remote side (after one warm-up); bytes verified."""
        if remote["nbytes"] != self.nbytes:
            raise ValueError("raw sides differ in size")
        if self.backend == "mooncake":
            return self._mooncake_read_gbps(remote, repeat)
        self._remote = self.agent.add_remote_agent(remote["agent"])
        local = self.agent.get_xfer_descs(self._row, "DRAM")
        far = self.agent.get_xfer_descs(np.array([[remote["addr"], self.nbytes, 0]], dtype=np.uint64), "DRAM")
        self._handle = self.agent.initialize_xfer("READ", local, far, self._remote)
        best = float("inf")
        for i in range(repeat + 1):
            t0 = time.perf_counter()
            state = self.agent.transfer(self._handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(self._handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ ended in {state}")
            if i:
                best = min(best, time.perf_counter() - t0)
        if not torch.equal(self.buf, _pattern(self.nbytes)):
            raise RuntimeError("raw NIXL READ delivered different bytes")
        return self.nbytes / best / 1e9

    def close(self) -> None:
        """Release in the backend's order (NIXL: handle, remote agent, registration, agent)."""
        if self.backend == "mooncake":
            if self.engine is not None and self._registered:
                self.engine.unregister_memory(self.buf.data_ptr())
                self._registered = False
            self.engine = None
            return
        if self._handle is not None:
            self.agent.release_xfer_handle(self._handle)
            self._handle = None
        if self._remote is not None:
            self.agent.remove_remote_agent(self._remote)
            self._remote = None
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None
        self.agent = None

    # ---- Mooncake ----

    def _init_mooncake(self, nbytes: int, fill: bool) -> None:
        from kvconnect.transport.mooncake import import_engine

        self.nbytes = nbytes
        self.buf = _pattern(nbytes) if fill else torch.zeros(nbytes, dtype=torch.uint8)
        self.engine = import_engine().TransferEngine()
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("raw Mooncake engine did not start")
        self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"
        if self.engine.register_memory(self.buf.data_ptr(), nbytes) != 0:
            raise RuntimeError("raw Mooncake engine could not register its buffer")
        self._registered = True

    def _mooncake_read_gbps(self, remote: dict[str, Any], repeat: int) -> float:
        local = [self.buf.data_ptr()]
        best = float("inf")
        for i in range(repeat + 1):
            t0 = time.perf_counter()
            rc = self.engine.batch_transfer_sync_read(remote["session"], local, [remote["addr"]], [self.nbytes])
            if rc != 0:
                raise RuntimeError(f"raw Mooncake READ returned {rc}")
            if i:
                best = min(best, time.perf_counter() - t0)
        if not torch.equal(self.buf, _pattern(self.nbytes)):
            raise RuntimeError("raw Mooncake READ delivered different bytes")
        return self.nbytes / best / 1e9
