"""The CPU-offload backend: a host-memory KV tier with prefix lookup, eviction and asynchronous moves.

`keys` (content hashing), `policy` (LRU, ARC) and `manager` (slots, pins, stats) decide; `mover`
(host pool, vectorised copies) and `jobs` (worker threads) execute; `connector` ties them together.
"""

from kvconnect.offload.connector import OffloadConnector
from kvconnect.offload.jobs import OffloadJob
from kvconnect.offload.keys import block_keys, root_key
from kvconnect.offload.manager import LoadPlan, OffloadManager, OffloadStats, StorePlan
from kvconnect.offload.policy import ARCPolicy, LRUPolicy, make_policy

__all__ = [
    "ARCPolicy",
    "LRUPolicy",
    "LoadPlan",
    "OffloadConnector",
    "OffloadJob",
    "OffloadManager",
    "OffloadStats",
    "StorePlan",
    "block_keys",
    "make_policy",
    "root_key",
]
