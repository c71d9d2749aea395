"""A first check of a GPU host for kvconnect, in under three minutes: PASS/FAIL per check.

    .venv/bin/python integration/gpu/device_check.py [--device cuda:0] [--skip-suite]

It prints torch, CUDA, NIXL and Mooncake facts, then checks that CUDA tensors become VRAM regions
with their device id, that NIXL registers them and reads GPU to GPU between two agents, that a P/D
pull moves CUDA caches between two processes (a short selection of the conformance suite, the kill
test included, and one test across two GPUs where there are two), that the offload tier's CUDA path
(pinned pool, its own stream ordered after the engine's, direct and staged copies) moves exact
bytes, that a push fenced on the engine's stream writes only what that stream finished, and that a
CUDA build of Mooncake registers VRAM. Exit status 1 if any check failed; 0 with
"skipped: no CUDA" where torch sees no GPU. `--device cpu` runs the same checks on CPU tensors: a dry
run of this script, not of a GPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
SUITE_TIMEOUT_S = 150.0
RESULTS: list[tuple[str, bool]] = []


def check(name: str, fn: Callable[[], str]) -> None:
    """Run one check and print `PASS name: detail` or `FAIL name: error`."""
    t0 = time.monotonic()
    try:
        detail = fn()
    except Exception as exc:
        print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(limit=4)
        RESULTS.append((name, False))
        return
    print(f"PASS {name}: {detail} ({time.monotonic() - t0:.1f} s)", flush=True)
    RESULTS.append((name, True))


def random_cache(num_blocks: int, block_bytes: int, seed: int, device: torch.device) -> torch.Tensor:
    """A `(num_blocks, block_bytes)` uint8 cache of seeded random bytes on `device`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8, generator=g).to(device)


def same_bytes(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Raise unless two tensors hold the same bytes (compared in host memory)."""
    if not torch.equal(a.cpu(), b.cpu()):
        raise AssertionError(f"{what}: bytes differ")


def info(device: torch.device) -> None:
    """Print what this host offers."""
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if device.type == "cuda":
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
    for dist in ("nixl", "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            print(f"  {dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"  {dist} not installed")
    ucx = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    print(f"  UCX environment: {ucx or 'none (UCX defaults)'}")


# ---- regions and NIXL ----

def regions_are_vram(device: torch.device) -> Callable[[], str]:
    def run() -> str:
        from kvconnect.regions import MemoryKind, RegionSet

        kind = MemoryKind.VRAM if device.type == "cuda" else MemoryKind.DRAM
        devices = [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))] \
            if device.type == "cuda" else [device]
        seen = []
        for dev in devices:
            regions = RegionSet.from_kv_caches({"layer": torch.zeros(8, 4096, dtype=torch.uint8, device=dev)})
            (r,) = list(regions)
            want_id = dev.index or 0
            if r.memory_kind is not kind or r.device_id != want_id:
                raise AssertionError(f"{dev}: region is {r.memory_kind.value} device {r.device_id}, "
                                     f"want {kind.value} device {want_id}")
            seen.append(f"{dev}->{r.memory_kind.value}/{r.device_id}")
        return ", ".join(seen)
    return run


def nixl_read_between_agents(device: torch.device) -> Callable[[], str]:
    def run() -> str:
        from kvconnect.regions import RegionSet
        from kvconnect.transport.base import TransferState
        from kvconnect.transport.nixl import NixlTransport

        src = {"layer": random_cache(64, 65536, 1, device)}
        dst = {"layer": torch.zeros(64, 65536, dtype=torch.uint8, device=device)}
        a, b = NixlTransport(), NixlTransport()
        try:
            a.register(RegionSet.from_kv_caches(src))
            b.register(RegionSet.from_kv_caches(dst))
            b.add_peer("a", a.local_metadata(), RegionSet.from_kv_caches(src))
            remote, local = np.array([5, 6, 7, 40, 2]), np.array([0, 1, 2, 30, 63])
            handle = b.post("READ", "a", local, remote)
            deadline = time.monotonic() + 30
            while (state := b.poll(handle)) is TransferState.PENDING and time.monotonic() < deadline:
                time.sleep(0.001)
            b.release(handle)
            if state is not TransferState.DONE:
                raise AssertionError(f"READ ended {state.value}")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            same_bytes(dst["layer"][local], src["layer"][remote], "blocks read")
            untouched = np.setdiff1d(np.arange(64), local)
            if dst["layer"][untouched].count_nonzero().item():
                raise AssertionError("a block not read was written")
        finally:
            b.close()
            a.close()
        return f"5 blocks of 64 KiB read {device} -> {device} between two NIXL agents, bytes equal"
    return run


# ---- P/D between processes: the conformance suite's harness ----

def suite(selection: str, consumer: str, producer: str) -> Callable[[], str]:
    def run() -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCONNECT_TEST_")}
        env.update({"KVCONNECT_TEST_DEVICE": consumer, "KVCONNECT_TEST_PRODUCER_DEVICE": producer})
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_pd_conformance.py",
               "-k", selection]
        try:
            res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"pytest -k '{selection}' ran past {SUITE_TIMEOUT_S} s") from exc
        summary = (res.stdout.strip().splitlines() or ["(no output)"])[-1]
        if res.returncode != 0:
            print(res.stdout[-6000:], res.stderr[-3000:], sep="\n")
            raise AssertionError(f"pytest -k '{selection}' exited {res.returncode}: {summary}")
        return f"producer {producer}, consumer {consumer}, -k '{selection}': {summary}"
    return run


# ---- the offload tier's CUDA path ----

def offload_mover(device: torch.device, staged: bool) -> Callable[[], str]:
    def run() -> str:
        from kvconnect.offload.mover import BlockMover, slot_runs
        from kvconnect.regions import RegionSet

        caches = {"a": random_cache(96, 8192, 2, device), "b": random_cache(96, 1536, 3, device)}
        reference = {k: v.to("cpu", copy=True) for k, v in caches.items()}
        mover = BlockMover(caches, RegionSet.from_kv_caches(caches), 128)
        if device.type == "cuda":
            if not all(p.is_pinned() for p in mover.pool):
                raise AssertionError("the host pool is not pinned")
            if mover._stream is None or mover._stream == torch.cuda.current_stream(device):
                raise AssertionError("copies do not run on a stream of their own")
        rng = np.random.default_rng(4)
        ids = rng.permutation(96)[:40]
        # Scattered slots make more runs than max_runs: the staged path; consecutive ones the direct path.
        slots = rng.permutation(128)[:40] if staged else np.arange(10, 50)
        if (slot_runs(slots)[0].size > mover.max_runs) != staged:
            raise AssertionError("the slots chosen do not take the path this check is for")
        mover.store(ids, slots, mover.engine_event(), timeout=30.0)
        for k, pool in zip(caches, mover.pool):
            same_bytes(pool[torch.from_numpy(slots)].view(torch.uint8), reference[k][ids], f"store into pool ({k})")
        targets = rng.permutation(96)[:40]
        for t in caches.values():
            t.zero_()
        mover.load(slots, targets, mover.engine_event(), timeout=30.0)
        for k, t in caches.items():
            same_bytes(t[targets], reference[k][ids], f"load into cache ({k})")
            rest = np.setdiff1d(np.arange(96), targets)
            if t[rest].count_nonzero().item():
                raise AssertionError(f"load wrote blocks it was not given ({k})")
        path = "staged" if staged else "direct"
        return f"{path} path: 40 blocks of 2 regions stored and loaded back, bytes equal"
    return run


def offload_waits_for_the_engine_stream(device: torch.device) -> Callable[[], str]:
    def run() -> str:
        from kvconnect.offload.mover import BlockMover
        from kvconnect.regions import RegionSet

        cache = {"a": torch.zeros(16, 1 << 20, dtype=torch.uint8, device=device)}
        mover = BlockMover(cache, RegionSet.from_kv_caches(cache), 16)
        ids, slots = np.arange(16), np.arange(16)
        # The "engine" keeps its stream busy, then writes the blocks: a store ordered after its event
        # must copy the written bytes, never the zeros that were there when store() was called.
        torch.cuda._sleep(200_000_000)
        cache["a"].fill_(0x5A)
        mover.store(ids, slots, mover.engine_event(), timeout=30.0)
        if not bool((mover.pool[0].view(torch.uint8) == 0x5A).all()):
            raise AssertionError("the store copied blocks before the engine's stream had written them")
        return "a store after a busy engine stream copied the bytes that stream wrote last"
    return run


def push_waits_for_the_engine_stream(device: torch.device) -> Callable[[], str]:
    def run() -> str:
        from kvconnect.connector import ConnectorConfig, KVConnector
        from kvconnect.pd.fence import stream_fence

        def side(engine_id: str) -> tuple[KVConnector, torch.Tensor]:
            cache = torch.zeros(8, 1 << 20, dtype=torch.uint8, device=device)
            conn = KVConnector(ConnectorConfig(engine_id=engine_id, role="both", backend="nixl", push=True))
            conn.register_kv_caches({"layer": cache})
            return conn, cache

        (decode, dcache), (prefill, pcache) = side("decode"), side("prefill")
        try:
            decode.expect_push("k", prefill.side_channel, [[5, 6]], 32, handle="r")
            # The "engine" keeps its stream busy, then writes the blocks, and hands them over with a fence
            # at once, as vLLM's wait_for_save does: the WRITE must carry what the stream wrote last.
            torch.cuda._sleep(200_000_000)
            pcache[[3, 4]] = 0x5A
            prefill.push("k", [[3, 4]], handle="p", fence=stream_fence(device))
            deadline = time.monotonic() + 30.0
            while "r" not in (fin := decode.get_finished()).loaded + list(fin.failed):
                if time.monotonic() > deadline:
                    raise AssertionError("the push never ended")
                time.sleep(0.01)
            if fin.failed:
                raise AssertionError(f"the push failed: {fin.failed}")
            if not bool((dcache[[5, 6]] == 0x5A).all()):
                raise AssertionError("the WRITE carried bytes the engine's stream had not written yet")
        finally:
            prefill.close()
            decode.close()
        return "a push fenced on a busy engine stream wrote the bytes that stream wrote last"
    return run


def offload_connector(device: torch.device) -> Callable[[], str]:
    def run() -> str:
        from kvconnect.offload import OffloadConnector

        caches = {f"layer.{i}": random_cache(64, 16384, 10 + i, device) for i in range(4)}
        reference = {k: v.to("cpu", copy=True) for k, v in caches.items()}
        tokens = np.arange(16 * 20)
        with OffloadConnector(cpu_bytes=64 * 4 * 16384, timeout_s=30.0) as tier:
            tier.register_kv_caches(caches)
            src = np.arange(20) * 3
            tier.wait(tier.store_request(tokens, src), timeout=30.0)
            for t in caches.values():
                t.zero_()
            dst = np.arange(20) + 40
            job = tier.wait(tier.load_prefix(tier.block_keys(tokens), dst), timeout=30.0)
            if job.num_blocks != 20:
                raise AssertionError(f"{job.num_blocks} prefix hits, want 20")
            for k, t in caches.items():
                same_bytes(t[dst], reference[k][src], f"reloaded prefix ({k})")
            stats = tier.stats()
        return f"20 blocks x 4 layers stored and reloaded as a prefix; stats {stats}"
    return run


def mooncake_vram(device: torch.device) -> Callable[[], str]:
    def run() -> str:
        from kvconnect.regions import RegionSet
        from kvconnect.transport.mooncake import MooncakeTransport, import_engine

        if device.type == "cuda" and not getattr(import_engine(), "SUPPORT_CUDA", False):
            return "not checked: this Mooncake build has no CUDA support (install kvconnect[mooncake])"
        t = MooncakeTransport(host="127.0.0.1")
        try:
            t.register(RegionSet.from_kv_caches({"layer": torch.zeros(8, 4096, dtype=torch.uint8, device=device)}))
        finally:
            t.close()
        return f"registered a {device} region"
    return run


def main(argv: list[str] | None = None) -> int:
    """Run every check once; 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a dry run of this script")
    parser.add_argument("--skip-suite", action="store_true", help="leave out the conformance-suite selections")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"skipped: no CUDA (torch.cuda.is_available() is False; torch {torch.__version__})")
        return 0
    if device.type == "cpu":
        print("dry run on CPU tensors: checks this script, not a GPU")
    info(device)
    t0 = time.monotonic()
    check("regions", regions_are_vram(device))
    check("nixl-read", nixl_read_between_agents(device))
    if not args.skip_suite:
        dev = str(device)
        check("pd-one-device", suite("nixl and (dense or hybrid or thirty_two or killed)", dev, dev))
        if device.type == "cuda" and torch.cuda.device_count() >= 2:
            check("pd-two-devices", suite("nixl and (dense or thirty_two)", "cuda:1", "cuda:0"))
    check("offload-direct", offload_mover(device, staged=False))
    check("offload-staged", offload_mover(device, staged=True))
    if device.type == "cuda":
        check("offload-stream-order", offload_waits_for_the_engine_stream(device))
        check("push-stream-order", push_waits_for_the_engine_stream(device))
    check("offload-connector", offload_connector(device))
    check("mooncake-register", mooncake_vram(device))
    failed = [name for name, ok in RESULTS if not ok]
    print(f"{'FAIL' if failed else 'PASS'}: {len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed "
          f"in {time.monotonic() - t0:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
