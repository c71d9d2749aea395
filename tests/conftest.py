"""Shared fixtures: KV caches shaped like real models, filled with reproducible bytes."""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from kvconnect.connector import ConnectorConfig, Finished, KVConnector
from kvconnect.layout import KVCacheLayout
from kvconnect.offload.tiers.local_store import LocalStore, free_port  # noqa: F401 - shared with the tests
from kvconnect.transport import make_transport
from pd_peer import (Answer, Channel, Command, Hello, Ready, Setup, Topology, decode_value, join_address,
                     make_caches)


def random_bytes_(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill a tensor's storage with random bytes (any dtype) in place."""
    raw = tensor.view(torch.uint8) if tensor.is_contiguous() else None
    gen = torch.Generator().manual_seed(seed)
    if raw is not None:
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    else:
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=gen).to(tensor.dtype))
    return tensor


def copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """Move bytes row by row between paired descriptor arrays, the way a transport would."""
    if dst.shape != src.shape:
        raise ValueError("descriptor arrays differ in shape")
    for (daddr, dlen, _), (saddr, slen, _) in zip(dst.tolist(), src.tolist()):
        if dlen != slen:
            raise ValueError("paired descriptors differ in length")
        ctypes.memmove(daddr, saddr, dlen)


def kv_cache(layout: KVCacheLayout, shape: tuple[int, int, int, int, int], dtype: torch.dtype,
             seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A flat buffer of random bytes and its per-layer `[B, H, N, C]` views in `layout`."""
    numel = int(np.prod(shape))
    buf = torch.empty(numel, dtype=dtype)
    random_bytes_(buf, seed)
    views = layout.per_layer_views(buf, shape)
    return buf, {f"model.layers.{i}.attn": v for i, v in enumerate(views)}


@pytest.fixture
def llama_like_cache() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A small Llama-shaped cache: 4 layers, 32 blocks, 2 KV heads, 16 tokens, K|V of head size 64, bf16."""
    return kv_cache(KVCacheLayout.LBHNC, (4, 32, 2, 16, 128), torch.bfloat16, seed=1)


# Variables a producer gets from this process's environment even when its launcher does not pass the
# environment on (ssh): the transports' own settings, e.g. UCX_TLS for the kill test.
FORWARDED_ENV_PREFIXES = ("UCX_", "NIXL_", "MC_")
# kvconnect sets UCX_MODULES for the host it runs on (no RDMA device here); another host decides for itself.
_UCX_MODULES_AT_START = os.environ.get("UCX_MODULES")
PEER_SCRIPT = Path(__file__).resolve().parent / "pd_peer.py"


def forwarded_env() -> dict[str, str]:
    """The transport variables of this process that a launched producer applies before its engines start."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    if _UCX_MODULES_AT_START is None:
        env.pop("UCX_MODULES", None)
    return env


class ProducerProcess:
    """A producer worker: `tests/pd_peer.py` launched with an optional prefix, commanded over TCP.

    The launcher comes from `KVCONNECT_TEST_PRODUCER_LAUNCH` (e.g. `ip netns exec NS`, or `ssh NODE`;
    over ssh this checkout must be at the same path on the other host, and
    `KVCONNECT_TEST_PRODUCER_PYTHON` names its interpreter). The producer connects back to a control
    listener on the consumer host, so it works wherever the test process is reachable from.
    """

    connect_timeout_s = 90.0  # launcher + interpreter + torch import on a loaded host (or over ssh)
    setup_timeout_s = 90.0    # caches made, transport started, memory registered

    def __init__(self, kind: str, num_blocks: int, seed: int, *, engine_id: str = "prefill-0", port: int = 0,
                 lease_s: float = 30.0, secret: str | None = None, backend: str = "nixl",
                 topology: Topology | None = None, rank: int = 0, world_size: int = 1, push: bool = False):
        topo = topology or Topology.from_env()
        self.kind, self.num_blocks, self.seed, self.topology = kind, num_blocks, seed, topo
        token = secrets.token_hex(16)
        family = socket.AF_INET6 if ":" in topo.consumer_host else socket.AF_INET
        with socket.create_server((topo.consumer_host, 0), family=family) as listener:
            control = join_address(topo.consumer_host, listener.getsockname()[1])
            self.command = [*topo.launch, topo.python, str(PEER_SCRIPT), "--control", control, "--token", token]
            # stdin closed: an ssh launcher must not read the test's terminal.
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL)
            try:
                self.channel = self._accept(listener, token, control)
            except BaseException:
                self._kill_local()
                raise
        try:
            self.channel.send(Setup(
                kind=kind, num_blocks=num_blocks, seed=seed, engine_id=engine_id, port=port, lease_s=lease_s,
                secret=secret if secret is not None else os.environ.get("KVCONNECT_SECRET") or None,
                backend=backend, host=topo.producer_host, device=topo.producer_device, env=forwarded_env(),
                rank=rank, world_size=world_size, push=push))
            ready = self.channel.recv(self.setup_timeout_s, "the producer's Ready")
            if isinstance(ready, Answer) and ready.error:
                raise RuntimeError(f"producer ({' '.join(self.command)}) failed: {ready.error}")
            if not isinstance(ready, Ready):
                raise RuntimeError(f"producer sent {type(ready).__name__} instead of Ready")
        except BaseException:
            self._kill_local()
            self.channel.close()
            raise
        self.host, self.port, self.incarnation, self.pid = ready.host, ready.port, ready.incarnation, ready.pid

    def _accept(self, listener: socket.socket, token: str, control: str) -> Channel:
        """The control connection of the process launched with `token`, within `connect_timeout_s`."""
        deadline = time.monotonic() + self.connect_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"producer launch exited with code {rc} before connecting back to {control}: "
                                   f"{' '.join(self.command)}")
            listener.settimeout(min(0.5, left))
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                continue
            channel = Channel(sock)
            try:
                hello = channel.recv(max(0.1, deadline - time.monotonic()), "the producer's hello")
            except (TimeoutError, ConnectionError):
                channel.close()
                continue
            if isinstance(hello, Hello) and secrets.compare_digest(hello.token, token):
                return channel
            channel.close()  # someone else dialled the listener; keep waiting for ours
        raise TimeoutError(f"producer did not connect back to {control} within {self.connect_timeout_s} s "
                           f"(launched: {' '.join(self.command)}); can it reach that address?")

    def call(self, name: str, *args, timeout: float = 30.0):
        """Send a command and return the producer's answer (its error raised as RuntimeError)."""
        self.channel.send(Command(name=name, args=list(args)))
        answer = self.channel.recv(timeout, f"the answer to {name!r}")
        if not isinstance(answer, Answer):
            raise RuntimeError(f"producer answered {name!r} with {type(answer).__name__}")
        if answer.error:
            raise RuntimeError(f"producer failed {name!r}: {answer.error}")
        return decode_value(name, answer.value)

    def hold(self, request_id: str, block_ids, tokens: int) -> dict:
        """Hold blocks (one list per KV group) and return the transfer params as plain data."""
        return self.call("hold", request_id, [list(map(int, g)) for g in block_ids], tokens)

    def held_blocks(self, wait_s: float = 10.0) -> int:
        """Blocks still held after waiting up to `wait_s` for them to be released."""
        return self.call("held", wait_s, timeout=wait_s + 30.0)

    def kill(self) -> None:
        """SIGKILL: no goodbye, no cleanup. The producer kills itself (a launcher such as ssh may stand
        between it and the local process); if it cannot be told, the local process is killed."""
        if self.proc.poll() is None:
            try:
                self.channel.send(Command(name="kill"))
                # The kernel closes a dead process's sockets: end of stream proves the producer is gone.
                self.channel.wait_closed(10.0)
            except (OSError, TimeoutError):
                self._kill_local()
        self.channel.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self._kill_local()

    def stop(self) -> None:
        """Orderly stop; kill if it does not exit."""
        if self.proc.poll() is None:
            try:
                self.channel.send(Command(name="stop"))
            except OSError:
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.channel.close()

    def _kill_local(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired as exc:
                raise TimeoutError(f"producer process {self.proc.pid} survived SIGKILL for 10 s") from exc


@pytest.fixture
def producer_processes():
    """Start producer processes with `producer_processes(kind, num_blocks, seed, **kw)`.

    At teardown every producer still alive must hold no blocks (every lease ended: done, aborted or
    expired), then all are stopped.
    """
    started: list[ProducerProcess] = []

    def start(*args, **kw) -> ProducerProcess:
        p = ProducerProcess(*args, **kw)
        started.append(p)
        return p

    yield start
    try:
        for p in started:
            if p.proc.poll() is None:
                assert p.held_blocks(wait_s=15.0) == 0, f"producer {p.pid} still holds blocks after the test"
    finally:
        for p in started:
            p.stop()


# ---- P/D between a producer process and consumers in this process, on the backend under test ----

BACKENDS = ["nixl", "mooncake"]
PRODUCER_SEED, CONSUMER_SEED = 101, 202


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """The transport under test."""
    return request.param


@pytest.fixture
def producers(producer_processes, backend):
    """Producer processes on the backend under test."""
    return lambda *args, **kw: producer_processes(*args, backend=backend, **kw)


def real_transport(backend: str):
    """A fresh transport of the backend under test, for wrapping."""
    return make_transport(backend, {})


@pytest.fixture
def made_connectors():
    """Connectors a test made: at teardown each must have reported every load it started (no load
    state left behind), then all close."""
    made: list[KVConnector] = []
    yield made
    try:
        for c in made:
            assert c.consumer.pending == 0, f"{c.consumer.pending} loads never reported"
    finally:
        for c in made:
            c.close()


@pytest.fixture
def consumers(backend, made_connectors):
    """Make registered consumer connectors with `consumers(kind, num_blocks, **config)` (closed and
    checked by `made_connectors`)."""
    made = made_connectors
    topo = Topology.from_env()

    def make(kind: str, num_blocks: int, *, transport=None, **cfg) -> tuple[KVConnector, dict[str, torch.Tensor]]:
        caches, groups = make_caches(kind, num_blocks, CONSUMER_SEED, topo.consumer_device)
        cfg.setdefault("backend", backend)
        cfg.setdefault("engine_id", "decode-0")
        c = KVConnector(ConnectorConfig(role="consumer", host=topo.consumer_host, groups=groups, **cfg),
                        transport=transport)
        c.register_kv_caches(caches)
        made.append(c)
        return c, caches

    return make


def wait_for(conn: KVConnector, request_ids, timeout: float = 30.0) -> Finished:
    """Collect get_finished() until every load has ended (finished or failed), within `timeout`."""
    out = Finished()
    pending = set(request_ids)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        fin = conn.get_finished()
        out.loaded += fin.loaded
        out.failed.update(fin.failed)
        out.invalid_block_ids |= fin.invalid_block_ids
        pending -= set(fin.loaded) | set(fin.failed)
        time.sleep(0.002)
    assert not pending, f"requests never reported: {sorted(pending)}"
    return out


def byte_rows(caches: dict[str, torch.Tensor], conn: KVConnector) -> list[torch.Tensor]:
    """Per region, its blocks as `(num_blocks, block_bytes)` uint8 rows in host memory.

    A view of CPU caches; a copy of GPU caches, so that bytes from any device compare with each other.
    """
    tensors = [caches[r.names[0]] for r in conn.regions]
    return [t.reshape(t.shape[0], -1).view(torch.uint8).cpu() for t in tensors]


def assert_pulled(conn, local_caches, before, producer, pulls) -> None:
    """Pulled blocks equal the producer's, and every block not pulled is unchanged."""
    remote_caches, _ = make_caches(producer.kind, producer.num_blocks, producer.seed)
    got, want, old = byte_rows(local_caches, conn), byte_rows(remote_caches, conn), before
    touched = [set() for _ in conn.regions]
    for local_groups, remote_groups in pulls:
        for g, regions in enumerate(conn.group_regions):
            lids, rids = np.asarray(local_groups[g]), np.asarray(remote_groups[g])
            for k in regions:
                assert torch.equal(got[k][lids], want[k][rids]), f"region {k} differs"
                touched[k].update(lids.tolist())
    for k in range(len(conn.regions)):
        rest = sorted(set(range(got[k].shape[0])) - touched[k])
        assert torch.equal(got[k][rest], old[k][rest]), f"region {k}: a block not named was touched"


def snapshot(caches, conn) -> list[torch.Tensor]:
    """A copy of every region's bytes, to compare against later."""
    return [rows.clone() for rows in byte_rows(caches, conn)]


# Any value msgpack can carry (what a hostile peer may send in place of a field), for fuzzing decoders
# and listeners.
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=24),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=16,
)


@pytest.fixture
def mooncake_store(tmp_path):
    """A running Mooncake Store (master and storage node), killed at the end of the test."""
    cluster = LocalStore(tmp_path)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(params=["disk", "store"])
def where(request, tmp_path):
    """A lower tier's site: ("disk", directory) or ("store", master address of a real Mooncake Store)."""
    if request.param == "disk":
        yield "disk", str(tmp_path / "kv-disk")
        return
    store = LocalStore(tmp_path).start()
    try:
        yield "store", store.address
    finally:
        store.stop()
