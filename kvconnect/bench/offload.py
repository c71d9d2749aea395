"""Store and load throughput of the CPU-offload tier for a model-shaped cache, beside a plain memcpy.

With `--tier disk|store`, a lower tier instead, beside the raw operation on the same bytes
(kvconnect.bench.tiers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvconnect.cliargs import UsageError, positive_int, positive_ints, preset_names, writable_dir
from kvconnect.progress import bar


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvconnect bench offload`."""
    parser.add_argument("--preset", default="llama3-8b", choices=preset_names(), help="model-shaped cache")
    parser.add_argument("--tokens", type=positive_int, default=2048, help="tokens per request")
    parser.add_argument("--requests", type=positive_int, default=2, help="requests stored and loaded per pass")
    parser.add_argument("--repeat", type=positive_int, default=7, help="timed passes; the best of each figure is reported")
    parser.add_argument("--policy", default="lru", choices=("lru", "arc"))
    parser.add_argument("--workers", type=positive_int, default=1, help="copy worker threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    # The tier options default to None so that one given without --tier is caught (check_arguments).
    tiers = parser.add_argument_group("lower tiers (--tier; the options below need it)")
    tiers.add_argument("--tier", choices=("disk", "store"), help="bench a lower tier instead of the host pool")
    tiers.add_argument("--page-kib", type=positive_ints, help="page sizes in KiB, comma-separated (default 64,256,2048)")
    tiers.add_argument("--pages", type=positive_int, help="pages per pass (default 64)")
    tiers.add_argument("--regions", type=positive_int, help="regions (layers) a page spans (default 4)")
    tiers.add_argument("--dir", type=writable_dir, help="an existing directory to make the bench's temporary "
                       "directory in: the file system measured (default: the temp directory)")
    tiers.add_argument("--master", help="Mooncake master host:port, with --tier store (default: start one on loopback)")


TIER_DEFAULTS = {"page_kib": [64, 256, 2048], "pages": 64, "regions": 4, "master": ""}


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse tier options without --tier (they would be ignored), then fill in their defaults."""
    given = [name for name in (*TIER_DEFAULTS, "dir") if getattr(args, name) is not None]
    if given and not args.tier:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(f"{flag} needs --tier disk or --tier store (without --tier the host pool is measured)")
    if args.tier == "disk" and args.master is not None:
        raise UsageError("--master needs --tier store")
    for name, default in TIER_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if any((kib * 1024) % args.regions for kib in args.page_kib):
        raise UsageError(f"--page-kib: each page size must split into --regions {args.regions} equal rows")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    """Store, load and memcpy the same bytes `--repeat` times; print GB/s and ratios to memcpy."""
    if args.tier:
        from kvconnect.bench.tiers import run_tier

        return run_tier(args)
    import numpy as np
    import torch

    from kvconnect.offload import OffloadConnector
    from kvconnect.offload.mover import region_rows
    from kvconnect.presets import PRESETS
    from kvconnect.regions import RegionSet

    preset = PRESETS[args.preset]
    per_request = -(-args.tokens // preset.block_size)
    full_blocks = args.tokens // preset.block_size
    if full_blocks == 0:
        raise UsageError(f"--tokens must cover at least one full block of {preset.block_size} tokens")
    n = full_blocks * args.requests
    # Twice the blocks moved: stores read one half, loads write the other, so the check is exact.
    caches, _ = preset.allocate(2 * per_request * args.requests)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    table = rng.permutation(2 * per_request * args.requests)
    src = table[:n].reshape(args.requests, full_blocks)
    dst = table[n: 2 * n].reshape(args.requests, full_blocks)

    slot_bytes = sum(r.block_bytes for r in RegionSet.from_kv_caches(caches))
    tier = OffloadConnector(n * slot_bytes, policy=args.policy, block_size=preset.block_size, workers=args.workers)
    regions = tier.register_kv_caches(caches)
    rows = [region_rows(caches, r) for r in regions]
    src_all = torch.from_numpy(src.reshape(-1).copy())
    dst_all = torch.from_numpy(dst.reshape(-1).copy())
    for k, r in enumerate(rows):
        # A random row per region, tagged with (region, block) in its first 8 bytes: a block landing
        # in the wrong place or region is caught, and so is any byte moved within a block.
        u8 = r.view(torch.uint8)
        pattern = torch.randint(0, 256, (u8.shape[1],), dtype=torch.uint8, generator=gen).expand(n, -1).clone()
        if u8.shape[1] >= 8:
            pattern[:, :8] = ((k << 32) | src_all).view(torch.uint8).view(n, 8)
        u8[src_all] = pattern
    total = n * slot_bytes
    flat_src = torch.ones(total, dtype=torch.uint8)
    flat_dst = torch.zeros(total, dtype=torch.uint8)

    # Second baseline: the same bytes as one plain copy per layer (what per-layer tensors allow at
    # best), into the flat destination so that it costs no extra memory.
    layer_pairs, offset = [], 0
    for r in rows:
        u8 = r.view(torch.uint8)[:n]
        layer_pairs.append((flat_dst[offset: offset + u8.numel()].view(u8.shape), u8))
        offset += u8.numel()

    store_s, load_s, memcpy_s, layer_s = [], [], [], []
    progress = None if args.json else bar("passes")
    for i in range(args.repeat):
        if progress:
            progress(i, args.repeat)
        # Fresh tokens per pass: the stores are real (the previous pass's blocks get evicted).
        keys = [tier.block_keys(rng.integers(0, 128_000, full_blocks * preset.block_size))
                for _ in range(args.requests)]
        for r in rows:  # so a load that moved nothing cannot pass the final check on old bytes
            r.view(torch.uint8)[dst_all] = 0
        memcpy_s.append(_timed(lambda: flat_dst.copy_(flat_src)))
        layer_s.append(_timed(lambda: [d.copy_(s) for d, s in layer_pairs]))
        store_s.append(_timed(lambda: [tier.wait(j) for j in [tier.store(k, s) for k, s in zip(keys, src)]]))
        load_s.append(_timed(lambda: [tier.wait(j) for j in [tier.load(k, d) for k, d in zip(keys, dst)]]))
    if progress:
        progress(args.repeat, args.repeat)
    # Compared as bytes: the rows are complex128 words, and random bytes include NaNs (never equal).
    verified = all(torch.equal(r.view(torch.uint8)[dst_all], r.view(torch.uint8)[src_all]) for r in rows)
    stats = tier.stats()
    tier.close()

    def gbps(seconds: list[float]) -> float:
        return total / min(seconds) / 1e9

    result = {
        "preset": args.preset,
        "tokens": args.tokens,
        "requests": args.requests,
        "blocks": n,
        "regions": len(regions),
        "slot_bytes": slot_bytes,
        "bytes_per_pass": total,
        "repeat": args.repeat,
        "policy": args.policy,
        "workers": args.workers,
        "threads": torch.get_num_threads(),
        "store_gbps": gbps(store_s),
        "load_gbps": gbps(load_s),
        "memcpy_gbps": gbps(memcpy_s),
        "memcpy_per_layer_gbps": gbps(layer_s),
        "memcpy_per_layer_gbps_median": total / statistics.median(layer_s) / 1e9,
        "store_gbps_median": total / statistics.median(store_s) / 1e9,
        "load_gbps_median": total / statistics.median(load_s) / 1e9,
        "memcpy_gbps_median": total / statistics.median(memcpy_s) / 1e9,
        "verified": bool(verified),
        "evictions": stats.evictions,
    }
    result["memcpy_per_layer_ratio"] = result["memcpy_per_layer_gbps"] / result["memcpy_gbps"]
    result["store_ratio"] = result["store_gbps"] / result["memcpy_gbps"]
    result["load_ratio"] = result["load_gbps"] / result["memcpy_gbps"]
    # Each pass against the memcpy timed just before it: steadier than best-of on a shared machine.
    result["store_ratio_paired"] = statistics.median(m / t for m, t in zip(memcpy_s, store_s))
    result["load_ratio_paired"] = statistics.median(m / t for m, t in zip(memcpy_s, load_s))
    result["memcpy_per_layer_ratio_paired"] = statistics.median(m / t for m, t in zip(memcpy_s, layer_s))
    if args.json:
        print(json.dumps(result))
    else:
        mib = total / (1 << 20)
        print(f"offload {args.preset}: {args.requests} requests x {full_blocks} blocks, {len(regions)} regions, "
              f"{mib:.0f} MiB per pass, best of {args.repeat}")
        print(f"  {'':10} {'GB/s':>8} {'median':>8} {'vs memcpy':>10} {'paired':>8}")
        print(f"  {'memcpy':10} {result['memcpy_gbps']:8.2f} {result['memcpy_gbps_median']:8.2f} {1:10.2f} {1:8.2f}")
        for name in ("per-layer", "store", "load"):
            key = "memcpy_per_layer" if name == "per-layer" else name
            print(f"  {name:10} {result[key + '_gbps']:8.2f} {result[key + '_gbps_median']:8.2f} "
                  f"{result[key + '_ratio']:10.2f} {result[key + '_ratio_paired']:8.2f}")
        print("  (per-layer: a plain copy of each layer's bytes, the best per-layer tensors allow)")
        print(f"  loaded bytes {'match' if verified else 'DO NOT match'} the stored blocks")
    return 0 if verified else 1
