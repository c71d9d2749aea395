"""NixlTransport against real NIXL agents in separate processes (spawned; metadata over a Pipe).

The test process is the initiator; a spawned peer process owns the other KV cache and answers
commands over a Pipe. Both caches hold several regions of different block sizes (per-layer pages, a
strided K/V pair sharing one buffer, a state page), filled from seeds so either side can rebuild the
other's bytes to compare against.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch

from kvconnect.errors import BlockRangeError, LayoutError, TransferError
from kvconnect.faults import FaultyTransport
from kvconnect.regions import RegionSet
from kvconnect.transport.base import TransferState
from kvconnect.transport.nixl import NixlTransport

import transport_checks

PEER_BLOCKS, LOCAL_BLOCKS = transport_checks.PEER_BLOCKS, 48
PEER_SEED, LOCAL_SEED = transport_checks.PEER_SEED, 22
TIMEOUT_S = 20.0
CTX = mp.get_context("spawn")


def small_caches(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    """Four 4 KiB-per-block layers, a K/V pair interleaved in one buffer (strided), a 1200-byte state page."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    caches = {f"attn.{i}": rand(num_blocks, 2 * 16 * 64 * 2).view(torch.bfloat16).view(num_blocks, 2, 16, 64)
              for i in range(4)}
    pair = rand(num_blocks, 2, 1536)
    caches["mla.k"], caches["mla.v"] = pair[:, 0], pair[:, 1]
    caches["state"] = rand(num_blocks, 1200).view(torch.float32).view(num_blocks, 300)
    return caches


def big_cache(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    """One region of 64 KiB blocks: enough bytes that a transfer is still running when the peer dies."""
    return {"big": torch.full((num_blocks, 64 * 1024), seed % 251, dtype=torch.uint8)}


def block_bytes(caches: dict[str, torch.Tensor], regions: RegionSet) -> list[np.ndarray]:
    """Per region, a `(num_blocks, block_bytes)` uint8 copy of its blocks."""
    out = []
    for r in regions:
        t = caches[r.names[0]]
        out.append(t.reshape(t.shape[0], -1).view(torch.uint8).numpy().copy())
    return out


def peer_main(conn, kind: str, num_blocks: int, seed: int, progress_thread: bool) -> None:
    """The peer process: build and register a cache, then serve commands until told to stop."""
    caches = (small_caches if kind == "small" else big_cache)(num_blocks, seed)
    regions = RegionSet.from_kv_caches(caches)
    t = NixlTransport(progress_thread=progress_thread)
    t.register(regions)
    conn.send((t.local_metadata(), regions, os.getpid()))
    handles = []
    while True:
        cmd, *args = conn.recv()
        if cmd == "add_peer":
            t.add_peer(*args)
            conn.send(None)
        elif cmd == "bytes":
            conn.send(block_bytes(caches, regions))
        elif cmd == "post":  # leave it unreleased: exit must still be orderly
            handles.append(t.post(*args))
            conn.send(t.wait(handles[-1], TIMEOUT_S))
        elif cmd == "close":
            t.close()
            t.close()
            conn.send(None)
            return
        elif cmd == "exit":  # no close(): the atexit hook must shut NIXL down in order
            conn.send(None)
            return


class Peer:
    """A spawned peer process and its command pipe."""

    def __init__(self, kind: str = "small", num_blocks: int = PEER_BLOCKS, seed: int = PEER_SEED,
                 progress_thread: bool = True, wait: bool = True):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=peer_main, args=(child, kind, num_blocks, seed, progress_thread),
                                daemon=True)
        self.proc.start()
        child.close()
        if wait:
            self.ready()

    def ready(self) -> Peer:
        if not self.conn.poll(60):
            raise RuntimeError("peer process did not start")
        self.metadata, self.regions, self.pid = self.conn.recv()
        return self

    def call(self, *cmd: object) -> object:
        self.conn.send(cmd)
        if not self.conn.poll(60):
            raise RuntimeError(f"peer did not answer {cmd[0]}")
        return self.conn.recv()

    def finish(self, cmd: str = "close") -> int:
        self.call(cmd)
        self.proc.join(30)
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(30)


@pytest.fixture(scope="module")
def pair():
    """A registered local transport with one peer added under "prefill", and the peer process."""
    peer = Peer()
    caches = small_caches(LOCAL_BLOCKS, LOCAL_SEED)
    regions = RegionSet.from_kv_caches(caches)
    t = NixlTransport(progress_thread=False)  # this side only initiates and polls
    t.register(regions)
    t.add_peer("prefill", peer.metadata, peer.regions)
    yield t, caches, regions, peer
    t.close()
    assert peer.finish() == 0


def test_read_random_block_tables_is_byte_exact(pair) -> None:
    t, caches, regions, peer = pair
    rng = np.random.default_rng(0)
    remote_ref = block_bytes(small_caches(PEER_BLOCKS, PEER_SEED), peer.regions)
    for subset in (None, [1, 4, 6]):
        before = block_bytes(caches, regions)
        lids = rng.permutation(LOCAL_BLOCKS)[:20]
        rids = rng.permutation(PEER_BLOCKS)[:20]
        h = t.post("READ", "prefill", lids, rids, regions=subset)
        assert t.wait(h, TIMEOUT_S) is TransferState.DONE
        t.release(h)
        after = block_bytes(caches, regions)
        for k in range(len(regions)):
            expected = before[k].copy()
            if subset is None or k in subset:
                expected[lids] = remote_ref[k][rids]
            np.testing.assert_array_equal(after[k], expected, err_msg=f"region {k}")


def test_read_of_runs_and_torch_ids(pair) -> None:
    t, caches, regions, peer = pair
    remote_ref = block_bytes(small_caches(PEER_BLOCKS, PEER_SEED), peer.regions)
    lids = torch.tensor([3, 4, 5, 6, 30, 31, 0])  # runs NIXL may merge, and a lone block
    rids = torch.tensor([40, 41, 42, 43, 10, 11, 63])
    h = t.post("READ", "prefill", lids, rids)
    assert t.wait(h, TIMEOUT_S) is TransferState.DONE
    t.release(h)
    after = block_bytes(caches, regions)
    for k in range(len(regions)):
        np.testing.assert_array_equal(after[k][lids.numpy()], remote_ref[k][rids.numpy()])


def test_a_checked_selection_posts_as_it_is_and_only_to_its_own_peer(pair) -> None:
    transport_checks.a_checked_selection_posts_as_it_is_and_only_to_its_own_peer(pair, small_caches, block_bytes)


def test_a_pairing_checked_elsewhere_is_taken_by_add_peer_only_for_the_registered_regions(pair) -> None:
    transport_checks.a_pairing_checked_elsewhere_is_taken_only_for_the_registered_regions(pair)


def test_write_lands_in_the_named_peer_blocks_only(pair) -> None:
    t, caches, regions, peer = pair
    rng = np.random.default_rng(1)
    lids = rng.permutation(LOCAL_BLOCKS)[:16]
    rids = rng.permutation(PEER_BLOCKS)[:16]
    before = peer.call("bytes")
    local = block_bytes(caches, regions)
    h = t.post("WRITE", "prefill", lids, rids, regions=[0, 2, 5])
    assert t.wait(h, TIMEOUT_S) is TransferState.DONE
    t.release(h)
    after = peer.call("bytes")
    for k in range(len(regions)):
        expected = before[k].copy()
        if k in (0, 2, 5):
            expected[rids] = local[k][lids]
        np.testing.assert_array_equal(after[k], expected, err_msg=f"region {k}")


def test_a_peer_too_big_to_prepare_is_read_with_descriptors_built_per_post(pair) -> None:
    _, _, _, peer = pair
    caches = small_caches(LOCAL_BLOCKS, LOCAL_SEED + 1)
    regions = RegionSet.from_kv_caches(caches)
    remote_ref = peer.call("bytes")  # as earlier tests left them (they write into the peer)
    with NixlTransport(progress_thread=False, prepared_rows=0) as t:
        t.register(regions)
        t.add_peer("prefill", peer.metadata, peer.regions)
        rng = np.random.default_rng(5)
        # A run, coalesced on both sides, then random blocks.
        lids = np.concatenate([np.arange(10, 14), rng.permutation(np.setdiff1d(np.arange(LOCAL_BLOCKS), range(10, 14)))[:20]])
        rids = np.concatenate([np.arange(50, 54), rng.permutation(np.setdiff1d(np.arange(PEER_BLOCKS), range(50, 54)))[:20]])
        h = t.post("READ", "prefill", lids, rids)
        assert t.wait(h, TIMEOUT_S) is TransferState.DONE
        t.release(h)
        after = block_bytes(caches, regions)
        for k in range(len(regions)):
            np.testing.assert_array_equal(after[k][lids], remote_ref[k][rids], err_msg=f"region {k}")


def test_a_replayed_agent_under_another_peer_id_never_removes_the_first(pair) -> None:
    t, _, _, peer = pair
    with pytest.raises(TransferError, match="already in use"):
        t.add_peer("prefill", peer.metadata, peer.regions)  # the same peer id again
    # The same agent's metadata under another id, with regions NIXL cannot prepare (past its memory).
    lie = RegionSet([dataclasses.replace(r, base_addr=r.base_addr + (1 << 40)) for r in peer.regions])
    with pytest.raises(TransferError, match="prepare"):
        t.add_peer("impostor", peer.metadata, lie)
    t.add_peer("replay", peer.metadata, peer.regions)  # accepted: it shares the agent's entry
    t.remove_peer("replay")
    h = t.post("READ", "prefill", [0], [0])  # the first peer id still reaches its agent
    assert t.wait(h, TIMEOUT_S) is TransferState.DONE
    t.release(h)


@pytest.mark.parametrize(("lids", "rids", "regions"), [
    ([0, LOCAL_BLOCKS], [0, 1], None),          # local id past the end
    ([0, 1], [0, PEER_BLOCKS], None),           # remote id past the end
    ([0, -1], [0, 1], None),                    # negative
    ([0, 1.5], [0, 1], None),                   # not an integer
    ([0, 1, 2], [0, 1], None),                  # lengths differ
    ([0, 1], [0, PEER_BLOCKS], [0]),            # bad id in a subset
    ([3, 3], [3, 3], None),                     # a destination named twice
])
def test_bad_block_ids_are_rejected_before_anything_moves(pair, lids, rids, regions) -> None:
    t, caches, regions_local, peer = pair
    local_before, remote_before = block_bytes(caches, regions_local), peer.call("bytes")
    for op in ("READ", "WRITE"):
        with pytest.raises(BlockRangeError):
            t.post(op, "prefill", lids, rids, regions=regions)
    for a, b in zip(block_bytes(caches, regions_local), local_before):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(peer.call("bytes"), remote_before):
        np.testing.assert_array_equal(a, b)


def test_bad_requests_raise_typed_errors(pair) -> None:
    t, _, regions, peer = pair
    with pytest.raises(TransferError):
        t.post("COPY", "prefill", [0], [0])
    with pytest.raises(TransferError):
        t.post("READ", "nobody", [0], [0])
    with pytest.raises(LayoutError):
        t.post("READ", "prefill", [0], [0], regions=[len(regions)])
    with pytest.raises(TransferError):
        t.poll(object())
    with pytest.raises(TransferError):
        t.add_peer("garbage", b"not nixl metadata", peer.regions)
    other = RegionSet.from_kv_caches({"x": torch.zeros(4, 128, dtype=torch.uint8)})
    with pytest.raises(LayoutError):
        t.add_peer("mismatched", peer.metadata, other)


def test_faulty_transport_injects_failures(pair) -> None:
    t, _, _, peer = pair
    clock = [0.0]
    f = FaultyTransport(t, fail_posts=1, clock=lambda: clock[0])
    with pytest.raises(TransferError):
        f.post("READ", "prefill", [0], [0])
    h = f.post("READ", "prefill", [0], [0])
    assert f.wait(h, TIMEOUT_S) is TransferState.DONE
    f.release(h)
    f.delay_s = 5.0
    h = f.post("READ", "prefill", [1], [1])
    assert f.poll(h) is TransferState.PENDING
    assert f.wait(h, 0.01) is TransferState.PENDING  # wait() gives up at its deadline, PENDING
    clock[0] = 6.0
    assert f.wait(h, TIMEOUT_S) is TransferState.DONE
    f.release(h)
    f.delay_s, f.fail_poll_after = 0.0, 0
    h = f.post("READ", "prefill", [2], [2])
    assert f.poll(h) is TransferState.FAILED
    f.release(h)
    f.fail_poll_after, f.delay_s = None, 60.0
    h = f.post("READ", "prefill", [3], [3])
    assert f.poll(h) is TransferState.PENDING
    f.cancel(h)  # ends the injected delay; the real transfer ran already, and stays final
    assert f.wait(h, TIMEOUT_S) in (TransferState.DONE, TransferState.FAILED)
    f.release(h)
    assert f.posted == 4


def test_loopback_peer_moves_blocks_within_one_process() -> None:
    caches = small_caches(PEER_BLOCKS, PEER_SEED)
    regions = RegionSet.from_kv_caches(caches)
    with NixlTransport(progress_thread=False) as t:
        t.register(regions)
        t.add_peer("self", t.local_metadata(), regions)
        before = block_bytes(caches, regions)
        h = t.post("READ", "self", [0, 1, 2, 9], [40, 41, 42, 5])
        assert t.wait(h, TIMEOUT_S) is TransferState.DONE
        t.release(h)
        after = block_bytes(caches, regions)
        for k in range(len(regions)):
            expected = before[k].copy()
            expected[[0, 1, 2, 9]] = before[k][[40, 41, 42, 5]]
            np.testing.assert_array_equal(after[k], expected)
        t.remove_peer("self")
    assert t.closed


def test_remove_peer_with_transfer_in_flight_and_readd(pair) -> None:
    t, _, _, peer = pair
    h = t.post("READ", "prefill", np.arange(LOCAL_BLOCKS), np.arange(LOCAL_BLOCKS))
    t.remove_peer("prefill")
    assert t.poll(h) in (TransferState.DONE, TransferState.FAILED)
    t.release(h)
    with pytest.raises(TransferError):
        t.post("READ", "prefill", [0], [0])
    t.add_peer("prefill", peer.metadata, peer.regions)
    h = t.post("READ", "prefill", [0], [0])
    assert t.wait(h, TIMEOUT_S) is TransferState.DONE
    t.release(h)


def test_close_is_ordered_idempotent_and_exits_cleanly() -> None:
    """Exit code 0 after close(), after exit with no close (atexit), and with handles left unreleased."""
    # Started together, and before this side's progress thread takes a core.
    closed, left_open = (p.ready() for p in [Peer(wait=False), Peer(wait=False)])
    caches = small_caches(LOCAL_BLOCKS, LOCAL_SEED)
    regions = RegionSet.from_kv_caches(caches)
    t = NixlTransport()  # the peers write into this side: it needs its progress thread
    t.register(regions)
    for i, peer in enumerate((closed, left_open)):
        t.add_peer(f"p{i}", peer.metadata, peer.regions)
        h = t.post("READ", f"p{i}", [0, 1], [2, 3])
        assert t.wait(h, TIMEOUT_S) is TransferState.DONE  # unreleased on purpose: close() frees it
        peer.call("add_peer", "d", t.local_metadata(), regions)
        assert peer.call("post", "WRITE", "d", [5], [6]) is TransferState.DONE
    assert closed.finish("close") == 0
    assert left_open.finish("exit") == 0
    t.close()
    t.close()
    assert t.closed
    assert t.poll(h) is TransferState.DONE  # final states stay readable
    with pytest.raises(TransferError):
        t.post("READ", "p1", [0], [0])


def test_peer_killed_between_transfers_fails_the_next_one() -> None:
    peer = Peer()
    caches = small_caches(LOCAL_BLOCKS, LOCAL_SEED)  # regions hold bare addresses: keep the tensors alive
    t = NixlTransport(progress_thread=False)
    try:
        t.register(RegionSet.from_kv_caches(caches))
        t.add_peer("prefill", peer.metadata, peer.regions)
        h = t.post("READ", "prefill", [0], [0])
        assert t.wait(h, TIMEOUT_S) is TransferState.DONE
        t.release(h)
        peer.kill()
        assert _outcome(t, "prefill", 8, deadline_s=10.0) == "FAILED"
    finally:
        t.close()


def test_peer_sigkill_mid_transfer_is_reported_within_a_deadline(monkeypatch) -> None:
    """Over UCX's TCP transport a READ is asynchronous, so the peer can die while it is PENDING."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    blocks = 2048  # 128 MiB: seconds over loopback TCP here, so the kill lands mid-transfer
    peer = Peer("big", blocks, seed=7)
    caches = big_cache(blocks, seed=1)
    t = NixlTransport(progress_thread=False)
    try:
        t.register(RegionSet.from_kv_caches(caches))
        t.add_peer("prefill", peer.metadata, peer.regions)
        ids = np.arange(blocks)
        h = t.post("READ", "prefill", ids, ids)
        assert t.poll(h) is TransferState.PENDING, "finished before the kill: make the transfer bigger"
        peer.kill()
        start = time.monotonic()
        # P/D polls with a deadline; what UCX does here is report the disconnect, well before it.
        assert t.wait(h, 10.0) is TransferState.FAILED
        assert time.monotonic() - start < 10.0
        t.release(h)
        assert _outcome(t, "prefill", blocks, deadline_s=10.0) == "FAILED"
    finally:
        t.close()


def _outcome(t: NixlTransport, peer_id: str, n: int, deadline_s: float) -> str:
    """Post a READ of n blocks and report FAILED whether the post raised or the transfer failed or stalled."""
    try:
        h = t.post("READ", peer_id, np.arange(n), np.arange(n))
    except TransferError:
        return "FAILED"
    state = t.wait(h, deadline_s)
    t.release(h)
    return "FAILED" if state is not TransferState.DONE else "DONE"
