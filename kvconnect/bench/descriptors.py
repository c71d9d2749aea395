"""Time building transfer descriptors for a large block table, beside a plain Python loop."""

from __future__ import annotations

import argparse
import json
import sys

from kvconnect.cliargs import positive_int
from kvconnect.workload.timing import best_seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvconnect bench descriptors`."""
    parser.add_argument("--layers", type=positive_int, default=64, help="regions (one per layer)")
    parser.add_argument("--blocks", type=positive_int, default=2048, help="block ids per request")
    parser.add_argument("--block-bytes", type=positive_int, default=65536, help="bytes per block and layer")
    parser.add_argument("--repeat", type=positive_int, default=20, help="timed repetitions; the best is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Build descriptors for random and contiguous tables and print the timings."""
    import numpy as np

    from kvconnect.descriptors import block_rows
    from kvconnect.regions import MemoryKind, Region, RegionSet

    num_blocks = args.blocks * 2
    # Addresses only: descriptor math never touches memory, so the regions need no allocation.
    base0, layer_span = 1 << 40, num_blocks * args.block_bytes
    rs = RegionSet([
        Region((f"layer.{i}",), base0 + i * layer_span, num_blocks, args.block_bytes, args.block_bytes, 0,
               MemoryKind.DRAM)
        for i in range(args.layers)
    ])
    rng = np.random.default_rng(args.seed)
    random_ids = rng.permutation(num_blocks)[: args.blocks]
    contiguous_ids = np.arange(args.blocks) + 7

    n_random = len(block_rows(rs, random_ids))
    n_contiguous = len(block_rows(rs, contiguous_ids))
    seconds_random = best_seconds(lambda: block_rows(rs, random_ids), args.repeat)
    seconds_contiguous = best_seconds(lambda: block_rows(rs, contiguous_ids), args.repeat)

    ids_list = random_ids.tolist()

    def python_loop() -> np.ndarray:
        rows = []
        for region in rs.regions:
            for b in ids_list:
                rows.append((region.base_addr + b * region.block_stride, region.block_bytes, region.device_id))
        return np.array(rows, dtype=np.uint64)

    python_loop_seconds = best_seconds(python_loop, max(1, args.repeat // 5))
    # Check against the loop block by block: split each merged run back into its blocks first.
    ours = block_rows(rs, random_ids)
    blocks = ours[:, 1] // np.uint64(args.block_bytes)
    first = np.repeat(ours[:, 0], blocks.astype(np.int64))
    step = np.arange(first.size) - np.repeat(np.cumsum(blocks) - blocks, blocks.astype(np.int64)).astype(np.int64)
    split = np.stack([first + step.astype(np.uint64) * np.uint64(args.block_bytes),
                      np.full(first.size, args.block_bytes, dtype=np.uint64),
                      np.repeat(ours[:, 2], blocks.astype(np.int64))], axis=1)
    if not np.array_equal(split, python_loop()):
        print("kvconnect bench descriptors: descriptors differ from the Python loop's", file=sys.stderr)
        return 1
    result = {
        "layers": args.layers,
        "blocks": args.blocks,
        "descriptors": n_random,
        "descriptors_contiguous": n_contiguous,
        "seconds_random": seconds_random,
        "seconds_contiguous": seconds_contiguous,
        "python_loop_seconds": python_loop_seconds,
        "speedup_vs_python_loop": python_loop_seconds / seconds_random,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"descriptors for {args.layers} layers x {args.blocks} blocks (best of {args.repeat})")
        print(f"  random table     : {n_random:>8} descriptors  {seconds_random * 1e3:8.3f} ms")
        print(f"  contiguous table : {n_contiguous:>8} descriptors  {seconds_contiguous * 1e3:8.3f} ms")
        print(f"  python loop      : {n_random:>8} descriptors  {python_loop_seconds * 1e3:8.3f} ms"
              f"  ({result['speedup_vs_python_loop']:.0f}x slower than kvconnect)")
    return 0
