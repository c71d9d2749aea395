"""A producer (prefill) worker in its own process, commanded by P/D tests over a TCP control connection.

Run as `python tests/pd_peer.py --control HOST:PORT --token TOKEN`. The test process launches it
(directly, or through a prefix such as `ip netns exec NS` or `ssh NODE`), so it may run in another
network namespace or on another host. It connects back to the test process's control listener,
proves with the token that it is the process that was launched, receives its setup (cache kind,
backend, addresses, device, secret, transport environment) and then answers commands.

Control frames are a 4-byte big-endian length followed by msgspec msgpack; nothing on that
connection is ever decoded any other way (no pickle). The control connection only plays the router's
part (transfer params out, commands in); metadata, claims, heartbeats and done/abort notices travel
over kvconnect's own side channel. The connection is not encrypted: it carries the run's
`KVCONNECT_SECRET`, so point it only at networks you trust (a test network, a namespace pair).

The module also holds what both ends share: the frames, `make_caches` and `Topology`, where the
environment says each side runs.
"""

from __future__ import annotations

import argparse
import math
import os
import select
import shlex
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Union

import msgspec
import torch

from kvconnect import wire
from kvconnect.connector import ConnectorConfig, KVConnector, KVGroup
from kvconnect.layout import MambaPage
from tp_caches import tp_caches

MAMBA = MambaPage([(3, 64), (4, 8, 16)], [torch.float16, torch.float32], page_size_bytes=4096)

# ---- where each side runs (all optional; the defaults keep everything on loopback and CPU) ----

ENV_LAUNCH = "KVCONNECT_TEST_PRODUCER_LAUNCH"
ENV_PYTHON = "KVCONNECT_TEST_PRODUCER_PYTHON"
ENV_PRODUCER_HOST = "KVCONNECT_TEST_PRODUCER_HOST"
ENV_CONSUMER_HOST = "KVCONNECT_TEST_CONSUMER_HOST"
ENV_DEVICE = "KVCONNECT_TEST_DEVICE"
ENV_PRODUCER_DEVICE = "KVCONNECT_TEST_PRODUCER_DEVICE"


@dataclass(frozen=True)
class Topology:
    """Where the producer and the consumer of a P/D test run, read from `KVCONNECT_TEST_*` variables."""

    launch: tuple[str, ...] = ()
    python: str = sys.executable
    producer_host: str = "127.0.0.1"
    consumer_host: str = "127.0.0.1"
    producer_device: str = "cpu"
    consumer_device: str = "cpu"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Topology:
        """The topology the environment describes; unset or empty variables keep the defaults."""
        consumer_device = environ.get(ENV_DEVICE) or "cpu"
        return cls(
            launch=tuple(shlex.split(environ.get(ENV_LAUNCH, ""))),
            python=environ.get(ENV_PYTHON) or sys.executable,
            producer_host=environ.get(ENV_PRODUCER_HOST) or "127.0.0.1",
            consumer_host=environ.get(ENV_CONSUMER_HOST) or "127.0.0.1",
            # One variable is enough for a single-GPU run; the producer's own variable splits them.
            producer_device=environ.get(ENV_PRODUCER_DEVICE) or consumer_device,
            consumer_device=consumer_device,
        )

    @property
    def uses_cuda(self) -> bool:
        """Either side keeps its caches on a GPU."""
        return any(d.startswith("cuda") for d in (self.producer_device, self.consumer_device))


# ---- caches ----

def make_caches(kind: str, num_blocks: int, seed: int,
                device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], list[KVGroup] | None]:
    """KV caches of a model family filled with seeded random bytes on `device`, and their KV groups."""
    # Bytes come from a CPU generator whatever the device, so every device holds the same bytes.
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    groups = None
    if kind == "dense":  # GQA: 4 layers, 2 KV heads, 16 tokens, K|V of head size 64, bf16: 8 KiB pages
        caches = {f"layers.{i}.attn":
                  rand(num_blocks, 2 * 16 * 128 * 2).view(torch.bfloat16).view(num_blocks, 2, 16, 128)
                  for i in range(4)}
    elif kind == "mla":  # one 576-element latent per token, 3 layers
        caches = {f"layers.{i}.mla": rand(num_blocks, 16 * 576 * 2).view(torch.bfloat16).view(num_blocks, 16, 576)
                  for i in range(3)}
    elif kind == "hybrid-shared":  # as vLLM registers hybrids: one tensor holds layers of two KV groups
        t = rand(num_blocks, 4096)
        caches = {"layers.0.attn": t.view(torch.bfloat16).view(num_blocks, 1, 16, 128),
                  "layers.1.mamba": t.view(torch.int8).view(num_blocks, 1, 1, 4096)}
        groups = [KVGroup(layers=("layers.0.attn",), label="attention"),
                  KVGroup(layers=("layers.1.mamba",), label="mamba")]
    elif kind.startswith("hybrid"):  # 2 attention layers + 2 Mamba layers (int8 pages), two KV groups
        # Variants a decode must refuse: smaller Mamba pages, one group of all layers, layers regrouped.
        state = 2048 if kind == "hybrid-small-state" else 4096
        caches = {f"layers.{i}.attn": rand(num_blocks, 4096).view(torch.bfloat16).view(num_blocks, 1, 16, 128)
                  for i in (0, 2)}
        caches.update({f"layers.{i}.mamba": rand(num_blocks, state).view(torch.int8).view(num_blocks, 1, 1, state)
                       for i in (1, 3)})
        groups = [KVGroup(layers=("layers.0.attn", "layers.2.attn"), label="attention"),
                  KVGroup(layers=("layers.1.mamba", "layers.3.mamba"), label="mamba")]
        if kind == "hybrid-one-group":
            groups = [KVGroup(layers=tuple(caches), label="attention")]
        elif kind == "hybrid-regrouped":
            groups = [KVGroup(layers=("layers.0.attn", "layers.1.mamba"), label="attention"),
                      KVGroup(layers=("layers.2.attn", "layers.3.mamba"), label="mamba")]
        elif kind not in ("hybrid", "hybrid-small-state"):
            raise ValueError(kind)
    elif kind == "cross":  # one cross-layer tensor: blocks outermost, 4 layers inside each block
        caches = {"all_layers":
                  rand(num_blocks, 4 * 2 * 16 * 64 * 2).view(torch.float16).view(num_blocks, 4, 2, 16, 64)}
    elif kind == "big":  # 64 KiB blocks, enough bytes that a pull is still running when the producer dies
        caches = {"big": rand(num_blocks, 65536)}
    else:
        raise ValueError(kind)
    return {name: t.to(device) for name, t in caches.items()}, groups


# ---- control frames ----

MAX_FRAME_BYTES = 16 << 20  # the largest answer (transfer params of 6144 block ids) is tens of KiB
_HEADER = struct.Struct(">I")
_NIL = msgspec.msgpack.encode(None)


class Hello(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Producer -> test: the token it was launched with."""

    token: str
    pid: int


class Setup(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Test -> producer: what to register and where to serve."""

    kind: str
    num_blocks: int
    seed: int
    engine_id: str
    port: int
    lease_s: float
    secret: str | None
    backend: str
    host: str
    device: str
    env: dict[str, str]
    rank: int = 0
    world_size: int = 1
    push: bool = False


class Ready(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Producer -> test: registered and serving its side channel."""

    host: str
    port: int
    incarnation: str
    pid: int


class Command(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Test -> producer: hold, abort, held, releases, stop or kill."""

    name: str
    args: list[Any] = []


class Answer(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Producer -> test: a command's value (msgpack, decoded by the command's answer type) or its error."""

    value: msgspec.Raw = msgspec.Raw(_NIL)
    error: str = ""


Frame = Union[Hello, Setup, Ready, Command, Answer]

ANSWER_TYPES: dict[str, Any] = {"hold": dict[str, Any], "abort": bool, "held": int,
                                "releases": list[tuple[str, str]], "push": type(None),
                                "pushes": list[tuple[str, str]], "push_layerwise": type(None), "layers": int,
                                "forward_done": type(None), "fail_posts": type(None)}

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Frame).decode


class Channel:
    """One control connection: length-prefixed msgspec msgpack frames, every receive bounded."""

    def __init__(self, sock: socket.socket, send_timeout: float = 30.0):
        sock.settimeout(send_timeout)  # bounds sendall; receives wait in select() with their own deadline
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._buf = bytearray()

    def send(self, frame: Frame) -> None:
        """Send one frame."""
        body = _encode(frame)
        self.sock.sendall(_HEADER.pack(len(body)) + body)

    def readable(self, timeout: float) -> bool:
        """Whether a receive would find bytes (or the end of the connection) within `timeout`."""
        if self._buf:
            return True
        return self._wait_readable(timeout)

    def recv(self, timeout: float, what: str) -> Frame:
        """The next frame; TimeoutError if none arrives within `timeout`, ConnectionError at end of stream."""
        deadline = time.monotonic() + timeout
        self._fill(_HEADER.size, deadline, timeout, what)
        (size,) = _HEADER.unpack_from(self._buf)
        if size > MAX_FRAME_BYTES:
            raise ConnectionError(f"control frame of {size} bytes (limit {MAX_FRAME_BYTES}) while waiting for {what}")
        self._fill(_HEADER.size + size, deadline, timeout, what)
        body = bytes(self._buf[_HEADER.size:_HEADER.size + size])
        del self._buf[:_HEADER.size + size]
        try:
            return _decode(body)
        except msgspec.DecodeError as exc:
            raise ConnectionError(f"malformed control frame while waiting for {what}: {exc}") from exc

    def wait_closed(self, timeout: float) -> None:
        """Wait for the peer to close the connection (a dead process's sockets close), discarding bytes."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"control connection still open after {timeout} s")
            if self._wait_readable(left):
                try:
                    if not self.sock.recv(65536):
                        return
                except ConnectionError:
                    return

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def _wait_readable(self, timeout: float) -> bool:
        # poll, not select: a test process holding over 1024 descriptors is not an error.
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(max(0, math.ceil(timeout * 1000))))

    def _fill(self, n: int, deadline: float, timeout: float, what: str) -> None:
        while len(self._buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self._wait_readable(left):
                raise TimeoutError(f"no {what} on the control connection within {timeout} s")
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError(f"control connection closed by the peer while waiting for {what}")
            self._buf += chunk


def encode_value(value: Any) -> msgspec.Raw:
    """A command's answer value as msgpack, for `Answer.value`."""
    return msgspec.Raw(msgspec.msgpack.encode(value))


def decode_value(command: str, raw: msgspec.Raw) -> Any:
    """An answer value, checked against the command's answer type."""
    return msgspec.msgpack.decode(raw, type=ANSWER_TYPES.get(command, Any))


def split_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` or `[V6]:PORT` as (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    """(host, port) as `HOST:PORT`, bracketing IPv6 addresses."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---- the producer process ----

def fail_posts(connector: KVConnector, n: int) -> None:
    """Make the next `n` WRITEs (or READs) this peer's consumer posts fail (wrap its transport at the first call)."""
    from kvconnect.faults import FaultyTransport

    consumer = connector.consumer
    if not isinstance(consumer.transport, FaultyTransport):
        consumer.transport = FaultyTransport(consumer.transport)
    consumer.transport.fail_posts = n


def serve(channel: Channel, setup: Setup) -> None:
    """Register a cache, report Ready, then answer hold/abort/held/releases until stop, kill or disconnect."""
    # UCX and Mooncake read their variables when their engines start, which happens below.
    os.environ.update(setup.env)
    shards = None
    if setup.kind.startswith("tp-"):  # one tensor-parallel rank's shard of a model-wide cache
        caches, groups, shards = tp_caches(setup.kind, setup.num_blocks, setup.seed, setup.world_size, setup.rank)
        caches = {name: t.to(setup.device) for name, t in caches.items()}
    else:
        caches, groups = make_caches(setup.kind, setup.num_blocks, setup.seed, setup.device)
    connector = KVConnector(ConnectorConfig(
        role="producer", engine_id=setup.engine_id, host=setup.host, port=setup.port, lease_s=setup.lease_s,
        secret=setup.secret, groups=groups, backend=setup.backend, rank=setup.rank, world_size=setup.world_size,
        shards=shards, push=setup.push))
    try:
        connector.register_kv_caches(caches)
        host, port = connector.side_channel
        channel.send(Ready(host=host, port=port, incarnation=connector.metadata.incarnation, pid=os.getpid()))
        _command_loop(channel, connector)
    finally:
        connector.close()


def _command_loop(channel: Channel, connector: KVConnector) -> None:
    releases: list[tuple[str, str]] = []
    pushes: list[tuple[str, str]] = []  # (handle, "" when every byte landed, else why it failed)

    def drain() -> None:
        if connector.pusher is None:
            releases.extend((r.request_id, r.reason.value) for r in connector.producer.poll())
            return
        fin = connector.get_finished()
        pushes.extend((h, fin.push_failed.get(h, "")) for h in fin.sending)

    def held(wait_s: float) -> int:  # wait (bounded) until no blocks are held, then report the count
        deadline = time.monotonic() + wait_s
        while connector.held_blocks and time.monotonic() < deadline:
            drain()
            time.sleep(0.01)
        drain()
        return connector.held_blocks

    def releases_so_far() -> list[tuple[str, str]]:
        drain()
        return list(releases)

    handlers = {
        "hold": lambda rid, block_ids, tokens: wire.transfer_params_to_builtins(
            connector.request_finished(rid, block_ids, tokens)),
        "abort": lambda rid: connector.producer.abort(rid),
        "held": held,
        "releases": releases_so_far,
        "push": lambda key, block_ids: connector.push(key, block_ids, handle=key),
        "push_layerwise": lambda key, block_ids: connector.push(key, block_ids, handle=key, layerwise=True),
        "layers": connector.layers_saved,
        "forward_done": connector.forward_done,
        "fail_posts": lambda n: fail_posts(connector, n),
        "pushes": lambda: (drain(), list(pushes))[1],
    }
    while True:
        if not channel.readable(0.01):
            drain()
            continue
        try:
            frame = channel.recv(30.0, "a command")
        except ConnectionError:
            return  # the test process went away: nobody is left to command this producer
        if not isinstance(frame, Command):
            channel.send(Answer(error=f"expected a command, got {type(frame).__name__}"))
            continue
        if frame.name == "stop":
            return
        if frame.name == "kill":  # a real SIGKILL, sent by the process itself because a launcher may stand between
            os.kill(os.getpid(), signal.SIGKILL)
        handler = handlers.get(frame.name)
        if handler is None:
            channel.send(Answer(error=f"unknown command {frame.name!r}"))
            continue
        try:
            value = handler(*frame.args)
        except Exception as exc:  # reported to the test, which raises it; the producer keeps serving
            channel.send(Answer(error=f"{type(exc).__name__}: {exc}"))
        else:
            channel.send(Answer(value=encode_value(value)))


def main(argv: list[str] | None = None) -> int:
    """Connect back to the test process, take the setup and serve until told to stop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", required=True, help="HOST:PORT of the test process's control listener")
    parser.add_argument("--token", required=True, help="the token the test process launched this producer with")
    parser.add_argument("--connect-timeout", type=float, default=30.0)
    parser.add_argument("--setup-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    try:
        sock = socket.create_connection(split_address(args.control), timeout=args.connect_timeout)
    except OSError as exc:
        print(f"pd_peer: cannot reach the control listener {args.control}: {exc}", file=sys.stderr)
        return 2
    channel = Channel(sock)
    try:
        channel.send(Hello(token=args.token, pid=os.getpid()))
        setup = channel.recv(args.setup_timeout, "the setup")
        if not isinstance(setup, Setup):
            print(f"pd_peer: expected a setup, got {type(setup).__name__}", file=sys.stderr)
            return 2
        try:
            serve(channel, setup)
        except Exception as exc:
            # The test may be waiting for Ready: tell it why there will be none instead of letting it time out.
            try:
                channel.send(Answer(error=f"producer setup or serving failed: {type(exc).__name__}: {exc}"))
            except OSError:
                pass
            raise
    finally:
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
