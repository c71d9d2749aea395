"""Network namespace pairs joined by a veth: creation, byte counters, removal and the sweep of stale ones.

Prefill (producer) lives in `kcp-<suffix>`, decode (consumer, and the inner pytest) in `kcd-<suffix>`.
Both ends of the veth are named `kc0` inside their namespace, so one `UCX_NET_DEVICES=kc0` fits both
sides; `lo` is up in both, because tests that use loopback on purpose run inside them too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEVICE = "kc0"
SUBNET = "10.213.0.{}/30"  # private, and seen only inside the two namespaces
_NAME = re.compile(r"^kc[pd]-([0-9a-f]{6})$")
# Which process created which pair, so a sweep never removes the namespaces of a run still going.
OWNERS = Path("/run/kvconnect-multihost")
IP_TIMEOUT_S = 30.0


class IpError(RuntimeError):
    """An `ip` command failed; the message holds its stderr."""


def ip(*args: str, timeout: float = IP_TIMEOUT_S) -> str:
    """Run `ip ARGS` (bounded) and return its stdout; IpError with its stderr when it fails."""
    try:
        res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise IpError(f"`ip {' '.join(args)}` did not finish within {timeout} s") from exc
    if res.returncode != 0:
        raise IpError(f"`ip {' '.join(args)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


@dataclass(frozen=True)
class NetnsPair:
    """Two namespaces joined by a veth named `device` on both sides."""

    prefill: str
    decode: str
    prefill_addr: str
    decode_addr: str
    device: str = DEVICE

    def counters(self) -> dict[str, int]:
        """Bytes the veth has carried so far: decode's rx/tx and prefill's rx/tx."""
        out = {}
        for side, ns in (("decode", self.decode), ("prefill", self.prefill)):
            (link,) = json.loads(ip("-n", ns, "-j", "-s", "link", "show", "dev", self.device))
            out[f"{side}_rx"] = int(link["stats64"]["rx"]["bytes"])
            out[f"{side}_tx"] = int(link["stats64"]["tx"]["bytes"])
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" if it is gone): a pid with its start time
    names one process, even where pids are reused quickly (containers)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(owner: Path) -> bool:
    try:
        pid, started = owner.read_text().split()
        return _start_time(int(pid)) == started
    except (OSError, ValueError):
        return False


def remove_namespace(ns: str) -> None:
    """SIGKILL whatever still runs in `ns`, then delete it (its end of the veth goes with it)."""
    try:
        pids = [int(p) for p in ip("netns", "pids", ns).split()]
    except IpError:
        pids = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10.0
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.05)
    try:
        ip("netns", "del", ns)
    except IpError:
        if ns in namespaces():
            raise


def namespaces() -> list[str]:
    """Names of the named network namespaces (`ip netns list`)."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Remove kcp-/kcd- namespaces whose creating process is gone (a run killed before its cleanup)."""
    removed = []
    for ns in namespaces():
        m = _NAME.match(ns)
        if not m:
            continue
        if _owner_alive(OWNERS / m.group(1)):
            continue
        remove_namespace(ns)
        removed.append(ns)
    for owner in OWNERS.glob("*") if OWNERS.is_dir() else []:
        if not _owner_alive(owner):
            owner.unlink(missing_ok=True)
    return removed


def create_pair(suffix: str) -> NetnsPair:
    """Create the two namespaces, the veth between them, addresses, and `lo`/`kc0` up on both sides."""
    pair = NetnsPair(prefill=f"kcp-{suffix}", decode=f"kcd-{suffix}",
                     prefill_addr=SUBNET.format(1).split("/")[0], decode_addr=SUBNET.format(2).split("/")[0])
    ip("netns", "add", pair.prefill)
    ip("netns", "add", pair.decode)
    # Created inside prefill with its peer inside decode: no name ever appears in the host's namespace.
    ip("-n", pair.prefill, "link", "add", DEVICE, "type", "veth", "peer", "name", DEVICE, "netns", pair.decode)
    for ns, addr in ((pair.prefill, SUBNET.format(1)), (pair.decode, SUBNET.format(2))):
        ip("-n", ns, "addr", "add", addr, "dev", DEVICE)
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "link", "set", DEVICE, "up")
    return pair




def owner_record() -> str:
    """What an owner file holds for this process: its pid and start time."""
    return f"{os.getpid()} {_start_time(os.getpid())}"
