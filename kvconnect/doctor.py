"""Check what works on this host: each backend's real loopback round trip, RDMA, CUDA, side-channel settings."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

BACKENDS = ("nixl", "mooncake")
PROBE_TIMEOUT_S = 60.0

_HINTS = {
    "nixl": "pip install 'kvconnect[nixl]' (NIXL with UCX); on hosts with rdma-core and no RDMA device, "
            "kvconnect sets UCX_MODULES=^ib itself",
    "mooncake": "pip install 'kvconnect[mooncake-cpu]' on CPU hosts or 'kvconnect[mooncake]' on CUDA hosts; "
                "it needs libibverbs.so.1 (Debian package libibverbs1)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvconnect doctor`."""
    parser.add_argument("--backend", default="nixl", choices=BACKENDS,
                        help="the backend you intend to run: the exit status says whether it works")
    parser.add_argument("--host", default="127.0.0.1", help="the side-channel bind address you intend to use")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def probe(backend: str, nbytes: int = 4096) -> dict[str, Any]:
    """Move `nbytes` between two transports of `backend` in this process and compare them byte for byte."""
    import torch

    from kvconnect.transport import make_transport
    from kvconnect.regions import RegionSet

    t0 = time.perf_counter()
    src = {"probe": torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, -1)}
    dst = {"probe": torch.zeros(4, nbytes // 4, dtype=torch.uint8)}
    a, b = make_transport(backend, {}), make_transport(backend, {})
    try:
        ra, rb = RegionSet.from_kv_caches(src), RegionSet.from_kv_caches(dst)
        a.register(ra)
        b.register(rb)
        b.add_peer("a", a.local_metadata(), ra)
        handle = b.post("READ", "a", [0, 1, 2, 3], [3, 2, 1, 0])
        state = b.wait(handle, timeout_s=20.0)
        b.release(handle)
        ok = state.value == "DONE" and torch.equal(dst["probe"], src["probe"].flip(0))
        return {"ok": ok, "state": state.value, "bytes": nbytes, "seconds": time.perf_counter() - t0}
    finally:
        b.close()
        a.close()


def _probe_in_child(backend: str) -> dict[str, Any]:
    # A backend that cannot load may take its process down with it: probe each in its own interpreter.
    cmd = [sys.executable, "-c", f"import json, kvconnect.doctor as d; print(json.dumps(d.probe({backend!r})))"]
    env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no answer within {PROBE_TIMEOUT_S:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    err = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
    return {"ok": False, "error": err[:500]}


def _rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def _cuda() -> dict[str, Any]:
    try:
        import torch

        available = torch.cuda.is_available()
        return {"available": available, "devices": torch.cuda.device_count() if available else 0}
    except Exception as exc:  # a broken CUDA install is a finding, not a crash
        return {"available": False, "error": str(exc)[:200]}


def _side_channel(host: str) -> dict[str, Any]:
    from kvconnect.sidechannel import resolve_secret
    from kvconnect.sidechannel.addresses import is_local, is_loopback, is_wildcard

    secret = resolve_secret(None) is not None
    loopback, wildcard = is_loopback(host), is_wildcard(host)
    bindable = is_local(host)  # by binding it: a string comparison cannot tell
    hints = []
    if not bindable:
        hints.append(f"{host!r} is not an address of this host (binding it failed): use one of its own "
                     "addresses, and advertise_host for the name peers use")
    if wildcard:
        hints.append("a wildcard bind needs allow_wildcard=True; prefer the one interface peers use")
    if not loopback and not secret:
        hints.append("set KVCONNECT_SECRET on every worker: this side channel leaves the host")
    return {"host": host, "loopback": loopback, "bindable": bindable, "secret_set": secret, "hint": "; ".join(hints)}


def report(backend: str, host: str, progress: bool = False) -> dict[str, Any]:
    """Everything doctor checks, as one dict (`progress`: say on stderr what is being checked)."""
    backends = {}
    for name in BACKENDS:
        if progress:  # each probe starts a process and a transport: seconds, a minute at worst
            print(f"  checking {name} (a real round trip in a child process) ...", file=sys.stderr, flush=True)
        # One retry: on a loaded host a first round trip can miss its deadline; two misses are a finding.
        result = _probe_in_child(name)
        if not result.get("ok"):
            first = result.get("error", result.get("state", "failed"))
            result = _probe_in_child(name)
            result["first_attempt"] = first
        if not result.get("ok"):
            result["hint"] = _HINTS[name]
        backends[name] = result
    rdma = _rdma_devices()
    side_channel = _side_channel(host)
    return {
        "backend": backend,
        "backend_ok": bool(backends[backend].get("ok")),
        "ok": bool(backends[backend].get("ok")) and side_channel["bindable"],
        "backends": backends,
        "ucx": {"UCX_TLS": os.environ.get("UCX_TLS", "(UCX default: all available)"),
                "UCX_MODULES": os.environ.get("UCX_MODULES", "(kvconnect sets ^ib when no RDMA device)")},
        "rdma_devices": rdma,
        "rdma_hint": "" if rdma else "no RDMA device: transfers use TCP or shared memory (fine on one host)",
        "cuda": _cuda(),
        "side_channel": side_channel,
    }


def run(args: argparse.Namespace) -> int:
    """Print the report; exit status 1 when the chosen backend cannot move bytes here or `--host` is not bindable."""
    r = report(args.backend, args.host, progress=not args.json)
    if args.json:
        print(json.dumps(r))
    else:
        print("kvconnect doctor")
        for name, res in r["backends"].items():
            status = "ok" if res.get("ok") else "FAILED"
            detail = f"{res.get('bytes', 0)} bytes round trip in {res.get('seconds', 0) * 1e3:.0f} ms" if res.get("ok") \
                else res.get("error", res.get("state", ""))
            print(f"  backend {name:9s} {status:7s} {detail}")
            if res.get("hint"):
                print(f"      hint: {res['hint']}")
        print(f"  RDMA devices      {', '.join(r['rdma_devices']) or 'none'}")
        if r["rdma_hint"]:
            print(f"      hint: {r['rdma_hint']}")
        print(f"  UCX_TLS           {r['ucx']['UCX_TLS']}")
        print(f"  UCX_MODULES       {r['ucx']['UCX_MODULES']}")
        cuda = r["cuda"]
        print(f"  CUDA              {'%d device(s)' % cuda['devices'] if cuda.get('available') else 'not available'}")
        sc = r["side_channel"]
        print(f"  side channel      bind {sc['host']} ({'bindable here' if sc['bindable'] else 'NOT an address of this host'})"
              f", secret {'set' if sc['secret_set'] else 'not set'}")
        if sc["hint"]:
            print(f"      hint: {sc['hint']}")
        print(f"  configured backend {r['backend']}: {'works' if r['backend_ok'] else 'DOES NOT WORK'}")
    return 0 if r["ok"] else 1
