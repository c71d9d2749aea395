"""The raw-backend baselines: the backend's own API moving one buffer, no kvconnect code.

Each side is a `RawSide` in its own process; the reader gets the writer's `metadata()` by any means
(the benchmarks use a pipe) and times READs, checking the bytes after the last one: the whole buffer as
one descriptor, and (`read_entries_gbps`) the same bytes as the entries a kvconnect request posts, in
the same batches, so that the backend's cost per entry shows apart from kvconnect's.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import torch

from kvconnect.workload.timing import best_seconds


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
        best = best_seconds(lambda: self._nixl_read(self._handle, "READ"), repeat, warmup=True)
        if not torch.equal(self.buf, _pattern(self.nbytes)):
            raise RuntimeError("raw NIXL READ delivered different bytes")
        return self.nbytes / best / 1e9

    def read_entries_gbps(self, remote: dict[str, Any], sizes: np.ndarray, runs: np.ndarray, batch: int,
                          repeat: int = 5, seed: int = 0) -> float:
        """Best-of GB/s of READs of `sizes` entries, posted `batch` entries at a time one batch after another;
        bytes verified. Entries come in `runs` (a request's blocks of one layer) and are shuffled within
        each, as a random block table's blocks are within their layer's region."""
        if int(sizes.sum()) != self.nbytes or remote["nbytes"] != self.nbytes or int(runs.sum()) != len(sizes):
            raise ValueError("the entries must cover both raw buffers exactly, in runs that cover the entries")
        sizes = sizes.astype(np.int64)
        rng = np.random.default_rng(seed)
        starts = np.concatenate(([0], np.cumsum(runs)[:-1]))
        order = np.concatenate([start + rng.permutation(n) for start, n in zip(starts.tolist(), runs.tolist())])
        local = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        far = np.empty_like(local)
        far[order] = np.concatenate(([0], np.cumsum(sizes[order])[:-1]))
        # Remote bytes land where the whole-buffer READ puts them only if the shuffle is undone: the check
        # compares against the pattern moved to the local offsets.
        expect = _pattern(self.nbytes).numpy()
        want = np.empty_like(expect)
        for lo, fo, n in zip(local.tolist(), far.tolist(), sizes.tolist()):  # verification only, after timing
            want[lo:lo + n] = expect[fo:fo + n]
        if self.backend == "mooncake":
            seconds = self._mooncake_entries(remote, local, far, sizes, batch, repeat)
        else:
            seconds = self._nixl_entries(remote, local, far, sizes, repeat)
        if not np.array_equal(self.buf.numpy(), want):
            raise RuntimeError(f"raw {self.backend} READ of entries delivered different bytes")
        return self.nbytes / seconds / 1e9

    def _nixl_entries(self, remote: dict[str, Any], local: np.ndarray, far: np.ndarray, sizes: np.ndarray,
                      repeat: int) -> float:
        if self._remote is None:
            self._remote = self.agent.add_remote_agent(remote["agent"])
        zeros = np.zeros_like(sizes)
        rows = np.stack([local + self.buf.data_ptr(), sizes, zeros], axis=1).astype(np.uint64)
        far_rows = np.stack([far + remote["addr"], sizes, zeros], axis=1).astype(np.uint64)
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(rows, "DRAM"),
                                            self.agent.get_xfer_descs(far_rows, "DRAM"), self._remote)
        try:
            return best_seconds(lambda: self._nixl_read(handle, "READ of entries"), repeat, warmup=True)
        finally:
            self.agent.release_xfer_handle(handle)

    def _nixl_read(self, handle: Any, what: str) -> None:
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL {what} ended in {state}")

    def _mooncake_entries(self, remote: dict[str, Any], local: np.ndarray, far: np.ndarray, sizes: np.ndarray,
                          batch: int, repeat: int) -> float:
        base = self.buf.data_ptr()
        batches = [((local[i:i + batch] + base).tolist(), (far[i:i + batch] + remote["addr"]).tolist(),
                    sizes[i:i + batch].tolist()) for i in range(0, len(sizes), batch)]
        return best_seconds(lambda: self._mooncake_read(remote["session"], batches, "READ of entries"), repeat,
                            warmup=True)

    def _mooncake_read(self, session: str, batches: list[tuple[list[int], list[int], list[int]]], what: str) -> None:
        for mine, theirs, lengths in batches:
            rc = self.engine.batch_transfer_sync_read(session, mine, theirs, lengths)
            if rc != 0:
                raise RuntimeError(f"raw Mooncake {what} returned {rc}")

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
        whole = [([self.buf.data_ptr()], [remote["addr"]], [self.nbytes])]
        best = best_seconds(lambda: self._mooncake_read(remote["session"], whole, "READ"), repeat, warmup=True)
        if not torch.equal(self.buf, _pattern(self.nbytes)):
            raise RuntimeError("raw Mooncake READ delivered different bytes")
        return self.nbytes / best / 1e9
