"""A Mooncake Store on this host: `mooncake_master` and one storage node, for benchmarks, demos and tests.

Production runs the master as a service (docs/operators.md); this starts the two binaries that the
Mooncake wheel installs beside the Python interpreter, on loopback over tcp, and kills them at the end.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from kvconnect.errors import KVConnectError


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalStore:
    """A master and one storage node of `segment` memory (objects live there, not in the clients)."""

    def __init__(self, logs: Path, segment: str = "256MB", port: int | None = None, host: str = "127.0.0.1"):
        self.bin = Path(sys.executable).parent
        self.host = host
        self.port = free_port() if port is None else port
        self.logs = Path(logs)
        self.segment = segment
        self.master: subprocess.Popen | None = None
        self.node: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """The master's `host:port`, as a StoreTier takes it."""
        return f"{self.host}:{self.port}"

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        path = self.bin / name
        if not path.exists():
            raise KVConnectError(f"{path} not found: install kvconnect[mooncake-cpu] (or [mooncake]) in this environment")
        with open(self.logs / f"{name}.log", "ab") as log:
            return subprocess.Popen([str(path), *args], stdout=log, stderr=subprocess.STDOUT)

    def _tail(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]

    def start_master(self, timeout: float = 30.0) -> None:
        """Start (or restart) the master on the same port and wait until it accepts connections."""
        self.master = self._spawn("mooncake_master", f"--rpc_port={self.port}", f"--rpc_address={self.host}",
                                  f"--metrics_port={free_port()}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex((self.host, self.port)) == 0:
                    return
            if self.master.poll() is not None:
                raise KVConnectError(f"mooncake_master exited: {self._tail('mooncake_master')}")
            time.sleep(0.1)
        raise KVConnectError(f"mooncake_master did not listen within {timeout} s")

    def start(self) -> LocalStore:
        """Master, then the storage node that mounts its segment."""
        self.start_master()
        self.node = self._spawn("mooncake_client", f"--host={self.host}", f"--port={free_port()}",
                                f"--master_server_address={self.address}", "--metadata_server=P2PHANDSHAKE",
                                f"--global_segment_size={self.segment}", "--protocol=tcp")
        time.sleep(2.0)  # the node mounts its segment shortly after it starts; a put before that finds no space
        if self.node.poll() is not None:
            raise KVConnectError(f"mooncake_client exited: {self._tail('mooncake_client')}")
        return self

    def kill_master(self) -> None:
        """Kill the master at once (SIGKILL), as a crash would."""
        if self.master is not None:
            self.master.kill()
            self.master.wait(10)

    def stop(self) -> None:
        """Kill every process of the store."""
        for p in (self.node, self.master):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)

    def __enter__(self) -> LocalStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    """`python -m kvconnect.offload.tiers.local_store HOST LOG_DIR [SEGMENT]`: run a store until killed."""
    import signal

    host, logs = sys.argv[1], Path(sys.argv[2])
    store = LocalStore(logs, segment=sys.argv[3] if len(sys.argv) > 3 else "256MB", host=host)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        store.start()
        print(f"ready {store.address}", flush=True)
        signal.pause()
    finally:
        store.stop()


if __name__ == "__main__":
    main()
