"""`kvconnect bench offload --tier disk|store`: a lower tier beside the raw operation on the same bytes.

For each page size, a host pool of `--pages` pages (each a row of `--regions` regions, as a model's
layers make it) is stored to the tier and loaded back into other slots, then checked byte for byte.
The baseline moves the same bytes in the same run without kvconnect: for the disk, one sequential
write of a file from one buffer and one read back (what `dd` would do); for the store, Mooncake's
own `batch_put_from_multi_buffers` / `batch_get_into_multi_buffers` on the same registered buffers.
The checksum's own speed is reported separately, since every page in and out pays it, and per size a
second reference: the raw operation followed by one checksum pass over the same pages (`+check`),
what integrity costs when nothing overlaps; the target stays against the raw operation. The pool and
the baselines' buffers start on a page, as the engine's pool (torch's allocator) starts where a copy
runs at full speed (`hostbuffers` says why a plain numpy array may not).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from kvconnect.cliargs import UsageError
from kvconnect.offload.tiers.hostbuffers import aligned
from kvconnect.workload.timing import best_seconds

# What the tiers aim for: store and load at least this fraction of the raw operation on the same bytes.
TARGET_RATIO = 0.9


def _random_rows(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Random rows starting on a page, as the offload pool's (torch's) start at full copy speed."""
    out = aligned(shape)
    out[...] = rng.integers(0, 256, shape, dtype=np.uint8)
    return out


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


class _Disk:
    """The disk tier and its raw baseline: one sequential file write and read of the same bytes."""

    def __init__(self, root: Path, pool):
        from kvconnect.offload.tiers.disk import DiskTier

        self.root, self.pool = root, pool
        self.tier = DiskTier(root / "tier", 1 << 62)
        self.tier.attach(pool)
        self.raw_path = root / "raw.bin"
        self._raw_files = 0

    def fresh(self) -> None:
        """Start each pass from an empty tier (a put of pages already held would skip them)."""
        self.tier.close()
        for f in (self.root / "tier").glob("*.kvt"):
            f.unlink()
        from kvconnect.offload.tiers.disk import DiskTier

        self.tier = DiskTier(self.root / "tier", 1 << 62)
        self.tier.attach(self.pool)

    def raw_fresh(self) -> None:
        """A new file name per pass, as the tier uses: renaming over a file makes ext4 flush it first."""
        self.raw_path.unlink(missing_ok=True)
        self._raw_files += 1

    def raw_put(self, flat: np.ndarray) -> None:
        tmp = self.root / f"raw-{self._raw_files}.tmp"
        with open(tmp, "wb", buffering=0) as f:
            f.write(memoryview(flat))
        os.rename(tmp, self.raw_path)

    def raw_get(self, flat: np.ndarray) -> None:
        with open(self.raw_path, "rb", buffering=0) as f:
            f.readinto(memoryview(flat))

    def close(self) -> None:
        self.tier.close()


class _Store:
    """The store tier and its raw baseline: Mooncake's multi-buffer batch calls on the same buffers."""

    def __init__(self, master: str, pool):
        from mooncake.store import MooncakeDistributedStore

        from kvconnect.offload.tiers.store import StoreTier

        self.pool = pool
        self.tier = StoreTier(master, retry_s=3600)
        self.tier.attach(pool)
        if not self.tier.available:
            raise UsageError(f"no Mooncake master answers at {master}")
        self.raw = MooncakeDistributedStore()
        if self.raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
            raise UsageError(f"no Mooncake master answers at {master}")
        for rows in pool.rows:
            self.raw.register_buffer(rows.ctypes.data, rows.nbytes)

    def fresh(self) -> None:
        self.raw.remove_all()

    def raw_batches(self, keys: list[str], slots: np.ndarray, put: bool) -> None:
        sizes = [int(n) for n in self.pool.row_bytes]
        call = self.raw.batch_put_from_multi_buffers if put else self.raw.batch_get_into_multi_buffers
        addrs = self.pool.addresses(slots).tolist()
        from kvconnect.offload.tiers.store import MAX_BATCH_BYTES, MAX_BATCH_KEYS

        per = max(1, min(MAX_BATCH_KEYS, MAX_BATCH_BYTES // self.pool.page_bytes))
        for i in range(0, len(keys), per):
            rc = call(keys[i:i + per], addrs[i:i + per], [sizes] * len(keys[i:i + per]))
            if any((r != 0) if put else (r != self.pool.page_bytes) for r in rc):
                raise RuntimeError(f"raw Mooncake {'put' if put else 'get'} failed: {sorted(set(rc))}")

    def close(self) -> None:
        self.tier.close()
        self.raw.close()


def run_tier(args: argparse.Namespace) -> int:
    """Store and load `--pages` pages per size through the tier and raw; print GB/s and ratios."""
    from kvconnect.offload.tiers import PoolView
    from kvconnect.offload.tiers.local_store import LocalStore

    sizes = list(args.page_kib)  # checked against --regions by offload.check_arguments
    rng = np.random.default_rng(args.seed)
    results, ok_all = [], True
    with tempfile.TemporaryDirectory(prefix="kvconnect-bench-", dir=args.dir) as tmp:
        local = None
        master = args.master
        if args.tier == "store" and not master:
            need = max(sizes) * 1024 * args.pages * 3
            local = LocalStore(Path(tmp), segment=f"{max(256, need >> 20)}MB").start()
            master = local.address
        try:
            for kib in sizes:
                page = kib * 1024
                rows = tuple(_random_rows(rng, (2 * args.pages, page // args.regions)) for _ in range(args.regions))
                pool = PoolView(rows)
                src, dst = np.arange(args.pages), np.arange(args.pages, 2 * args.pages)
                side = _Disk(Path(tmp), pool) if args.tier == "disk" else _Store(master, pool)
                try:
                    results.append(_one_size(args, side, pool, src, dst, page))
                finally:
                    side.close()
                ok_all &= results[-1]["verified"]
        finally:
            if local is not None:
                local.stop()
    # The checksum alone: its speed over the last size's pages, measured there for the `+check` reference.
    _report(args, results, results[-1]["check_gbps"], ok_all)
    return 0 if ok_all else 1


def _one_size(args, side, pool, src: np.ndarray, dst: np.ndarray, page: int) -> dict:
    from kvconnect.offload.tiers.integrity import page_checksums

    flat_out = pool.gather(src, aligned((src.size, page)))
    flat_in = aligned(flat_out.shape)
    total = args.pages * page
    tags = iter(range(1 << 30))
    keys: list[bytes] = []

    def new_keys() -> None:
        side.fresh()
        keys[:] = _keys(f"{page}/{next(tags)}", args.pages)

    def ours_put() -> None:
        assert side.tier.put(keys, src).all(), "the tier did not store every page"

    put_s = best_seconds(ours_put, args.repeat, before=new_keys)
    for rows in pool.rows:
        rows[dst] = 0
    get_s = best_seconds(lambda: side.tier.get(keys, dst), args.repeat)
    verified = all(np.array_equal(rows[dst], rows[src]) for rows in pool.rows)
    check_s = best_seconds(lambda: page_checksums(keys, flat_out), args.repeat)
    if isinstance(side, _Disk):
        raw_put_s = best_seconds(lambda: side.raw_put(flat_out), args.repeat, before=side.raw_fresh)
        raw_get_s = best_seconds(lambda: side.raw_get(flat_in), args.repeat)
        verified &= np.array_equal(flat_in, flat_out)
    else:
        names: list[str] = []

        def raw_keys() -> None:
            side.fresh()
            names[:] = [k.hex() for k in _keys(f"raw/{page}/{next(tags)}", args.pages)]

        raw_put_s = best_seconds(lambda: side.raw_batches(names, src, True), args.repeat, before=raw_keys)
        raw_get_s = best_seconds(lambda: side.raw_batches(names, dst, False), args.repeat)
    stats = side.tier.stats()
    return {"page_kib": page // 1024, "pages": args.pages, "bytes": total,
            "store_gbps": total / put_s / 1e9, "raw_store_gbps": total / raw_put_s / 1e9,
            "load_gbps": total / get_s / 1e9, "raw_load_gbps": total / raw_get_s / 1e9,
            "store_ratio": raw_put_s / put_s, "load_ratio": raw_get_s / get_s,
            "check_gbps": total / check_s / 1e9,
            "store_ratio_vs_raw_and_check": (raw_put_s + check_s) / put_s,
            "load_ratio_vs_raw_and_check": (raw_get_s + check_s) / get_s,
            "meets_target": bool(raw_put_s / put_s >= TARGET_RATIO and raw_get_s / get_s >= TARGET_RATIO),
            "rejected": stats.rejected, "verified": bool(verified)}


def _report(args, results: list[dict], hash_gbps: float, ok: bool) -> None:
    if args.json:
        print(json.dumps({"tier": args.tier, "regions": args.regions, "repeat": args.repeat,
                          "target_ratio": TARGET_RATIO, "hash_gbps": hash_gbps, "sizes": results, "verified": ok}))
        return
    print(f"offload tier {args.tier}: {args.pages} pages of {args.regions} regions per size, best of {args.repeat}")
    print(f"  {'page':>8} {'store':>8} {'raw':>8} {'ratio':>6} {'+check':>6}   {'load':>8} {'raw':>8} {'ratio':>6}"
          f" {'+check':>6}  (GB/s)")
    for r in results:
        print(f"  {r['page_kib']:>5}KiB {r['store_gbps']:8.2f} {r['raw_store_gbps']:8.2f} {r['store_ratio']:6.2f}"
              f" {r['store_ratio_vs_raw_and_check']:6.2f}   {r['load_gbps']:8.2f} {r['raw_load_gbps']:8.2f}"
              f" {r['load_ratio']:6.2f} {r['load_ratio_vs_raw_and_check']:6.2f}"
              f"  {'meets' if r['meets_target'] else 'BELOW'} target")
    print(f"  target: store and load >= {TARGET_RATIO} x raw (ratio column) at every page size")
    print("  +check: the same against the raw operation followed by one checksum pass over its pages (no overlap)")
    print(f"  checksum alone (xxh3-64 over key and page): {hash_gbps:.2f} GB/s")
    print(f"  loaded pages {'match' if ok else 'DO NOT match'} the stored pages byte for byte")
