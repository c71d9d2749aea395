"""MooncakeTransport against real Mooncake Transfer Engines in separate processes (spawned; metadata over a Pipe).

The test process is the initiator; a spawned peer process owns the other KV cache and answers
commands over a Pipe. Both caches hold several regions of different block sizes (per-layer pages, a
strided K/V pair sharing one buffer, a state page), filled from seeds so either side can rebuild the
other's bytes to compare against. Everything runs over Mooncake's TCP transport on loopback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # what the transport sets; it must precede the first import
import mooncake.engine  # noqa: E402,F401  (a test dependency: `make test` installs it)

from kvconnect.errors import BlockRangeError, LayoutError, TransferError  # noqa: E402
from kvconnect.regions import RegionSet  # noqa: E402
from kvconnect.transport.base import TransferState  # noqa: E402
from kvconnect.transport.mooncake import DEFAULT_MAX_BATCH_ENTRIES, MooncakeTransport  # noqa: E402

import transport_checks  # noqa: E402

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


def tiny_cache(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    """64-byte blocks at a 128-byte stride: no two blocks merge, so every block is its own batch entry."""
    g = torch.Generator().manual_seed(seed)
    return {"tiny": torch.randint(0, 256, (num_blocks, 2, 64), dtype=torch.uint8, generator=g)[:, 0]}


CACHES = {"small": small_caches, "big": big_cache, "tiny": tiny_cache}


def block_bytes(caches: dict[str, torch.Tensor], regions: RegionSet) -> list[np.ndarray]:
    """Per region, a `(num_blocks, block_bytes)` uint8 copy of its blocks."""
    out = []
    for r in regions:
        t = caches[r.names[0]]
        out.append(t.reshape(t.shape[0], -1).view(torch.uint8).numpy().copy())
    return out


def peer_main(conn, kind: str, num_blocks: int, seed: int) -> None:
    """The peer process: build and register a cache, then serve commands until told to stop."""
    caches = CACHES[kind](num_blocks, seed)
    regions = RegionSet.from_kv_caches(caches)
    t = MooncakeTransport()
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
        elif cmd == "post":  # left unreleased: exit must still be orderly
            handles.append(t.post(*args))
            conn.send(t.wait(handles[-1], TIMEOUT_S))
        elif cmd == "close":
            t.close()
            t.close()
            conn.send(None)
            return
        elif cmd == "exit":  # no close(): the atexit hook must shut Mooncake down
            conn.send(None)
            return


class Peer:
    """A spawned peer process and its command pipe."""

    def __init__(self, kind: str = "small", num_blocks: int = PEER_BLOCKS, seed: int = PEER_SEED):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=peer_main, args=(child, kind, num_blocks, seed), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            raise RuntimeError("peer process did not start")
        self.metadata, self.regions, self.pid = self.conn.recv()

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
    t = MooncakeTransport()
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
    lids = torch.tensor([3, 4, 5, 6, 30, 31, 0])  # runs that merge into one entry where contiguous, a lone block
    rids = torch.tensor([40, 41, 42, 43, 10, 11, 63])
    h = t.post("READ", "prefill", lids, rids)
    assert t.wait(h, TIMEOUT_S) is TransferState.DONE
    assert h.batches == 1
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


def test_requests_split_into_batches_arrive_byte_exact(pair) -> None:
    """A tiny batch limit forces many batches per request, READ and WRITE, across every region."""
    _, _, _, peer = pair
    caches = small_caches(LOCAL_BLOCKS, LOCAL_SEED + 1)
    regions = RegionSet.from_kv_caches(caches)
    with MooncakeTransport(max_batch_entries=5) as t:
        t.register(regions)
        t.add_peer("prefill", peer.metadata, peer.regions)
        rng = np.random.default_rng(2)
        lids, rids = rng.permutation(LOCAL_BLOCKS)[:24], rng.permutation(PEER_BLOCKS)[:24]
        before = block_bytes(caches, regions)
        remote = peer.call("bytes")
        h = t.post("READ", "prefill", lids, rids)
        assert t.wait(h, TIMEOUT_S) is TransferState.DONE
        assert h.batches == h.submitted > len(regions)
        t.release(h)
        after = block_bytes(caches, regions)
        for k in range(len(regions)):
            expected = before[k].copy()
            expected[lids] = remote[k][rids]
            np.testing.assert_array_equal(after[k], expected, err_msg=f"region {k}")
        wl, wr = rng.permutation(LOCAL_BLOCKS)[:11], rng.permutation(PEER_BLOCKS)[:11]
        h = t.post("WRITE", "prefill", wl, wr)
        assert t.wait(h, TIMEOUT_S) is TransferState.DONE
        assert h.batches > 1
        t.release(h)
        landed = peer.call("bytes")
        for k in range(len(regions)):
            expected = remote[k].copy()
            expected[wr] = after[k][wl]
            np.testing.assert_array_equal(landed[k], expected, err_msg=f"region {k}")


def test_a_request_past_mooncakes_batch_limit_arrives_byte_exact() -> None:
    """4600 separate entries: one Mooncake batch of that many fails over TCP (about 2050 is the most that
    works); the default limit cuts it into batches of 1024."""
    blocks = 6000
    peer = Peer("tiny", blocks, seed=5)
    caches = tiny_cache(blocks, seed=6)
    regions = RegionSet.from_kv_caches(caches)
    t = MooncakeTransport()
    try:
        t.register(regions)
        t.add_peer("prefill", peer.metadata, peer.regions)
        rng = np.random.default_rng(3)
        lids, rids = rng.permutation(blocks)[:4600], rng.permutation(blocks)[:4600]
        before, remote = block_bytes(caches, regions)[0], block_bytes(tiny_cache(blocks, seed=5), regions)[0]
        h = t.post("READ", "prefill", lids, rids)
        assert t.wait(h, TIMEOUT_S) is TransferState.DONE
        assert h.batches == h.submitted == -(-h.lengths.size // DEFAULT_MAX_BATCH_ENTRIES)
        assert h.lengths.size > 4096
        t.release(h)
        expected = before.copy()
        expected[lids] = remote[rids]
        np.testing.assert_array_equal(block_bytes(caches, regions)[0], expected)
    finally:
        t.close()
        assert peer.finish() == 0


def test_an_empty_post_is_done_at_once(pair) -> None:
    t, caches, regions, _ = pair
    before = block_bytes(caches, regions)
    empty = t.post("READ", "prefill", [], [])
    assert t.poll(empty) is TransferState.DONE
    t.release(empty)
    for a, b in zip(block_bytes(caches, regions), before):
        np.testing.assert_array_equal(a, b)


def test_a_peer_id_in_use_is_refused_and_keeps_working(pair) -> None:
    t, _, _, peer = pair
    with pytest.raises(TransferError, match="already in use"):
        t.add_peer("prefill", peer.metadata, peer.regions)
    h = t.post("READ", "prefill", [0], [0])
    assert t.wait(h, TIMEOUT_S) is TransferState.DONE
    t.release(h)


@pytest.mark.parametrize(("lids", "rids", "regions"), [
    ([0, LOCAL_BLOCKS], [0, 1], None),          # local id past the end
    ([0, 1], [0, PEER_BLOCKS], None),           # remote id past the end
    ([0, -1], [0, 1], None),                    # negative
    ([0, 1.5], [0, 1], None),                   # not an integer
    ([0, 1, 2], [0, 1], None),                  # lengths differ
    ([0, 1], [0, PEER_BLOCKS], [0]),            # bad id in a subset
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
    assert MooncakeTransport.name == "mooncake"  # the handshake's compat fingerprint carries it
    with pytest.raises(TransferError):
        t.post("COPY", "prefill", [0], [0])
    with pytest.raises(TransferError):
        t.post("READ", "nobody", [0], [0])
    with pytest.raises(LayoutError):
        t.post("READ", "prefill", [0], [0], regions=[len(regions)])
    with pytest.raises(TransferError):
        t.poll(object())
    with pytest.raises(TransferError):
        t.release("not a handle")
    for garbage in (b"not mooncake metadata", b"", b"\x00" * 4096, "text"):
        with pytest.raises(TransferError):
            t.add_peer("garbage", garbage, peer.regions)
    other = RegionSet.from_kv_caches({"x": torch.zeros(4, 128, dtype=torch.uint8)})
    with pytest.raises(LayoutError):
        t.add_peer("mismatched", peer.metadata, other)
    with pytest.raises(TransferError):
        MooncakeTransport(protocol="carrier-pigeon")
    with pytest.raises(TransferError):
        MooncakeTransport(max_batch_entries=0)
    with pytest.raises(TransferError):
        MooncakeTransport(host="bad host")


def test_protocol_mismatch_is_refused_at_add_peer(pair) -> None:
    """An RDMA-configured peer is refused by a TCP transport (and the other way round), before any transfer."""
    t, _, regions, peer = pair
    import msgspec

    from kvconnect.transport.mooncake import _PeerInfo

    session = msgspec.msgpack.decode(peer.metadata)["session"]
    rdma = msgspec.msgpack.encode(_PeerInfo(session=session, protocol="rdma"))
    with pytest.raises(TransferError, match="rdma"):
        t.add_peer("rdma-peer", rdma, peer.regions)
    with pytest.raises(TransferError):
        t.post("READ", "rdma-peer", [0], [0])


def test_faulty_transport_injects_failures(pair) -> None:
    from kvconnect.faults import FaultyTransport

    t, _, _, _ = pair
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
    clock[0] = 6.0
    assert f.wait(h, TIMEOUT_S) is TransferState.DONE
    f.release(h)
    f.delay_s, f.fail_poll_after = 0.0, 0
    h = f.post("READ", "prefill", [2], [2])
    assert f.poll(h) is TransferState.FAILED
    f.release(h)


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


def test_cancel_in_flight_stops_further_batches_and_fails_once_the_running_one_returns() -> None:
    blocks = 1024  # every second block: 512 entries of 64 KiB in 32 batches, so the release lands mid-way
    peer = Peer("big", blocks, seed=3)
    caches = big_cache(blocks, seed=4)
    t = MooncakeTransport(max_batch_entries=16)
    try:
        t.register(RegionSet.from_kv_caches(caches))
        t.add_peer("prefill", peer.metadata, peer.regions)
        ids = np.arange(blocks)
        h = t.post("READ", "prefill", ids[::2], ids[1::2])
        other = t.post("READ", "prefill", ids[1::2][:16], ids[::2][:16])  # queued behind it
        deadline = time.monotonic() + TIMEOUT_S
        while h.submitted < 2 and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert t.poll(h) is TransferState.PENDING, "finished before the release: make the transfer bigger"
        t.cancel(h)
        submitted = h.submitted
        # FAILED only once the batch inside Mooncake returned: until then its bytes may still land.
        assert t.wait(h, TIMEOUT_S) is TransferState.FAILED and not h.running
        t.release(h)
        assert t.wait(other, TIMEOUT_S) is TransferState.DONE  # the worker moved on
        assert h.submitted == submitted < h.batches
        t.release(other)
        h = t.post("READ", "prefill", ids[:4], ids[:4])
        assert t.wait(h, TIMEOUT_S) is TransferState.DONE
        t.release(h)
        # close() with a batch running: it waits for that batch only, and the rest never goes out.
        h = t.post("READ", "prefill", ids[::2], ids[1::2])
        queued = t.post("READ", "prefill", ids[:4], ids[:4])
        while h.submitted < 2 and time.monotonic() < deadline + TIMEOUT_S:
            time.sleep(0.0005)
        assert t.poll(h) is TransferState.PENDING
        worker = t._peers["prefill"].worker
        t.close()
        assert t.poll(h) is TransferState.FAILED and h.submitted < h.batches
        assert t.poll(queued) is TransferState.FAILED and queued.submitted == 0
        assert not worker.is_alive()
    finally:
        t.close()
        assert peer.finish() == 0


def test_a_hung_peer_does_not_stall_the_others() -> None:
    """A stopped peer holds its batch until Mooncake's deadline (30 s); another peer's transfers go on."""
    blocks = 1024
    hung, healthy = Peer("big", blocks, seed=8), Peer("big", blocks, seed=9)
    caches = big_cache(blocks, seed=10)
    t = MooncakeTransport(max_batch_entries=32)
    try:
        t.register(RegionSet.from_kv_caches(caches))
        t.add_peer("hung", hung.metadata, hung.regions)
        t.add_peer("healthy", healthy.metadata, healthy.regions)
        ids = np.arange(blocks)
        stuck = t.post("READ", "hung", ids[::2], ids[1::2])
        deadline = time.monotonic() + TIMEOUT_S
        while stuck.submitted < 2 and time.monotonic() < deadline:
            time.sleep(0.0005)
        os.kill(hung.pid, signal.SIGSTOP)
        try:
            h = t.post("READ", "healthy", ids[:64], ids[64:128])
            assert t.wait(h, TIMEOUT_S) is TransferState.DONE
            t.release(h)
            assert t.poll(stuck) is TransferState.PENDING
            t.cancel(stuck)  # what the P/D layer does at its deadline
            # A batch is inside Mooncake with the stopped peer: its bytes may still land, so PENDING.
            assert t.poll(stuck) is TransferState.PENDING
        finally:
            hung.kill()  # SIGKILL ends a stopped process too
        # The peer's death ends the running batch; nothing can land any more.
        assert t.wait(stuck, TIMEOUT_S) is TransferState.FAILED and stuck.submitted < stuck.batches
        t.release(stuck)
        assert healthy.finish() == 0
    finally:
        t.close()


def test_close_is_ordered_idempotent_and_exits_cleanly() -> None:
    """Exit code 0 after close(), after exit with no close (atexit), and with handles left unreleased."""
    caches = small_caches(LOCAL_BLOCKS, LOCAL_SEED)
    regions = RegionSet.from_kv_caches(caches)
    t = MooncakeTransport()
    t.register(regions)
    closed, left_open = Peer(), Peer()
    for i, peer in enumerate((closed, left_open)):
        t.add_peer(f"p{i}", peer.metadata, peer.regions)
        h = t.post("READ", f"p{i}", [0, 1], [2, 3])
        assert t.wait(h, TIMEOUT_S) is TransferState.DONE  # unreleased on purpose
        peer.call("add_peer", "d", t.local_metadata(), regions)
        assert peer.call("post", "WRITE", "d", [5], [6]) is TransferState.DONE
    pending = t.post("READ", "p1", np.arange(LOCAL_BLOCKS), np.arange(LOCAL_BLOCKS))  # may be in flight at close
    assert closed.finish("close") == 0
    assert left_open.finish("exit") == 0
    t.close()
    t.close()
    assert t.closed
    assert t.poll(h) is TransferState.DONE  # final states stay readable
    assert t.poll(pending) in (TransferState.DONE, TransferState.FAILED)
    with pytest.raises(TransferError):
        t.post("READ", "p1", [0], [0])


def test_peer_killed_between_transfers_fails_the_next_one() -> None:
    peer = Peer()
    caches = small_caches(LOCAL_BLOCKS, LOCAL_SEED)  # kept referenced: the READ lands in it
    t = MooncakeTransport()
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


def test_peer_sigkill_mid_transfer_is_reported_within_a_deadline() -> None:
    blocks = 2048  # every second block: 64 MiB in 32 batches of 2 MiB, killed after the first is done
    peer = Peer("big", blocks, seed=7)
    caches = big_cache(blocks, seed=1)
    t = MooncakeTransport(max_batch_entries=32)
    try:
        t.register(RegionSet.from_kv_caches(caches))
        t.add_peer("prefill", peer.metadata, peer.regions)
        ids = np.arange(blocks)
        h = t.post("READ", "prefill", ids[::2], ids[1::2])
        deadline = time.monotonic() + TIMEOUT_S
        while h.submitted < 2 and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert t.poll(h) is TransferState.PENDING, "finished before the kill: make the transfer bigger"
        peer.kill()
        start = time.monotonic()
        # P/D polls with a deadline; Mooncake's TCP transport sees the reset long before it.
        assert t.wait(h, 10.0) is TransferState.FAILED
        assert time.monotonic() - start < 10.0
        assert h.submitted < h.batches
        t.release(h)
        assert _outcome(t, "prefill", 64, deadline_s=10.0) == "FAILED"
    finally:
        t.close()


def _outcome(t: MooncakeTransport, peer_id: str, n: int, deadline_s: float) -> str:
    """Post a READ of n blocks and report FAILED whether the post raised or the transfer failed or stalled."""
    try:
        h = t.post("READ", peer_id, np.arange(n), np.arange(n))
    except TransferError:
        return "FAILED"
    state = t.wait(h, deadline_s)
    t.release(h)
    return "FAILED" if state is not TransferState.DONE else "DONE"


@pytest.mark.parametrize("cfg, expected", [
    ({"advertise_host": "localhost"}, "localhost"),
    ({"host": "0.0.0.0", "allow_wildcard": True, "advertise_host": "localhost"}, "localhost"),
    ({}, "127.0.0.1"),
    ({"advertise_host": "localhost", "transport_options": {"host": "127.0.0.1"}}, "127.0.0.1"),
])
def test_producer_serves_mooncake_on_its_advertised_address(cfg, expected) -> None:
    from kvconnect.connector import ConnectorConfig, KVConnector

    conn = KVConnector(ConnectorConfig(role="producer", backend="mooncake", **cfg))
    try:
        conn.register_kv_caches({"layer": torch.zeros(4, 64, dtype=torch.uint8)})
        assert conn._transport.host == expected
    finally:
        conn.close()
