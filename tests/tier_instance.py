"""One engine instance with an offload tier chain, run as its own process by the tier tests.

`store` fills a KV cache with bytes derived from `--seed`, stores a request's blocks and waits until
they went down to the lower tier; `load` starts from a zeroed cache, looks the same tokens up, loads
the prefix it finds and compares every loaded block with the bytes `store` had, byte for byte. Both
print one JSON line: hits, equality, the job's error and the tier counters.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys

import numpy as np
import torch

from kvconnect.offload import OffloadConnector
from kvconnect.offload.tiers.disk import DiskTier
from kvconnect.offload.tiers.store import StoreTier

LAYERS, NUM_BLOCKS, BLOCK = 3, 64, 16


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    """Per-layer `[blocks, 2, 16 tokens, 32]` float32 caches, random bytes from `seed` (zeros without)."""
    out = {}
    gen = torch.Generator().manual_seed(seed or 0)
    for i in range(LAYERS):
        t = torch.zeros((NUM_BLOCKS, 2, BLOCK, 32), dtype=torch.float32)
        if seed is not None:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
        out[f"model.layers.{i}.attn"] = t
    return out


def make_tier(spec: str, local_host: str):
    kind, _, arg = spec.partition(":")
    if kind == "disk":
        path, _, size = arg.rpartition(":")
        return DiskTier(path, int(size))
    return StoreTier(arg, retry_s=1.0, local_host=local_host)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["store", "load"])
    ap.add_argument("--tier", required=True, help="disk:PATH:MAX_BYTES or store:HOST:PORT")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--cpu-blocks", type=int, default=48)
    ap.add_argument("--local-host", default="127.0.0.1", help="this instance's address for the store's transfers")
    ap.add_argument("--mount-tmpfs", default="", help="SIZE: mount a tmpfs of SIZE at the disk path first")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.mount_tmpfs:
        path = args.tier.split(":")[1]
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.mount_tmpfs}", "tmpfs", path], check=True)
    kv = caches(args.seed if args.mode == "store" else None)
    slot = sum(t[0].nbytes for t in kv.values())
    conn = OffloadConnector(cpu_bytes=slot * args.cpu_blocks, tiers=[make_tier(args.tier, args.local_host)])
    conn.register_kv_caches(kv)
    tokens = np.random.default_rng(args.seed).integers(0, 30000, args.blocks * BLOCK)
    keys = conn.block_keys(tokens)
    out: dict = {}
    if args.mode == "store":
        job = conn.store(keys, np.arange(args.blocks))
        job.wait(60)
        out["flushed"] = conn.flush_tiers(60)
        out["error"] = None if job.error is None else str(job.error)
    else:
        out["hits"] = conn.lookup(keys)
        dst = np.arange(NUM_BLOCKS - args.blocks, NUM_BLOCKS)  # other block ids than the store used
        job = conn.load_prefix(keys, dst)
        job.wait(60)
        out["error"] = None if job.error is None else str(job.error)
        out["loaded"] = job.num_blocks if job.error is None else 0
        want = caches(args.seed)
        n = out["loaded"]
        out["equal"] = all(torch.equal(kv[k][dst[:n]].view(torch.uint8), want[k][:n].view(torch.uint8)) for k in kv)
    out["stats"] = conn.tier_stats()
    conn.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
