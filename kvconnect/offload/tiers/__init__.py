"""Lower tiers of the offload tier: local disk and Mooncake Store, below the host-memory pool.

`base.Tier` is the interface (pages move between a tier and the host pool's slots, a batch at a
time), `integrity` the per-page checksum every tier stores and checks, `disk.DiskTier` and
`store.StoreTier` the two tiers (`batchfile` is the disk tier's file format, `fileio` its vectored
reads and writes; `overlap` the helper thread that hashes while bytes move; `calls` the store's
library calls on threads of their own, `store_put` its gathered puts, `store_staging` its staged and
time-bounded gets, `store_denylist` the corrupt objects it forgets; `local_store` a
stand-in Mooncake Store for one host), `chain.TierChain` the asynchronous copies down (after a host
store) and up (a promotion on a hit below the host pool).
"""

from kvconnect.offload.tiers.base import PoolView, Tier, TierStats, leading

__all__ = ["PoolView", "Tier", "TierStats", "leading"]
