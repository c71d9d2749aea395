"""Push mode as one object beside the pull sides: the decode's offers and the prefill's WRITEs.

A connector built with push on has a `PushRole`: on the decode side it offers allocated blocks to a
prefill and waits for the WRITE (`Offers`), on the prefill side it pairs offers with computed
prompts and writes them (`Pusher`), layer by layer when asked. Its results join the connector's
own: a decode's pushes are reported as loads, a prefill's as sends.
"""

from __future__ import annotations

from typing import Sequence

from kvconnect.descriptors import check_ids
from kvconnect.errors import KVConnectError
from kvconnect.pd.consumer import Consumer, LoadResults
from kvconnect.pd.failure import LoadFailure
from kvconnect.pd.leases import LeaseEnd
from kvconnect.pd.offers import Offers, PrefillAddr
from kvconnect.pd.fence import Fence
from kvconnect.pd.producer import Producer
from kvconnect.pd.pusher import Pusher, PushResults
from kvconnect.regions import RegionSet


class PushRole:
    """Both halves of push mode for one worker: offering blocks (decode) and writing them (prefill)."""

    def __init__(self, *, consumer: Consumer, producer: Producer, pusher: Pusher, regions: RegionSet,
                 group_regions: Sequence[Sequence[int]], engine_id: str, rank: int, world_size: int,
                 secret: bytes | str | None, timeout_s: float, load_timeout_s: float):
        self.consumer, self.producer, self.pusher = consumer, producer, pusher
        self.regions = regions
        self.group_regions = [list(g) for g in group_regions]
        self.load_timeout_s = load_timeout_s
        self.offers = Offers(producer, engine_id=engine_id, rank=rank, world_size=world_size, secret=secret,
                             timeout_s=timeout_s)
        self._region_of = {name: k for k, r in enumerate(regions) for name in r.names}
        self._saved: set[str] = set()  # layers of the running forward pass already computed

    # ---- decode ----

    def expect(self, key: str, prefill: tuple[str, int] | tuple[str, int, int],
               local_block_ids: Sequence[Sequence[int]], num_tokens: int, *, handle: str,
               timeout_s: float | None = None) -> None:
        """Offer these blocks to the prefill instance at (host, port[, TP size]) for the request the router
        named `key` (its rank p listens at port + p)."""
        self.offers.expect(key, PrefillAddr(*prefill), local_block_ids, num_tokens, handle=handle,
                           timeout_s=timeout_s or self.load_timeout_s)

    # ---- prefill ----

    def push(self, key: str, block_ids: Sequence[Sequence[int]], *, handle: str, timeout_s: float | None = None,
             layerwise: bool = False, fence: Fence | None = None) -> None:
        """This request's KV is computed (layer-wise: being computed) into these blocks; write it into
        the blocks the decode offers for `key`, once the engine's stream passed `fence` (None: now)."""
        if len(block_ids) != len(self.group_regions):
            raise KVConnectError(f"{len(block_ids)} block-id groups given, this connector has "
                                 f"{len(self.group_regions)} KV groups")
        checked = [check_ids(self.regions, ids, sel) for ids, sel in zip(block_ids, self.group_regions)]
        self.pusher.ready(key, checked, handle=handle, timeout_s=timeout_s, layerwise=layerwise, fence=fence)

    def layers_saved(self, names: Sequence[str], fence: Fence | None = None) -> int:
        """Layer-wise: these layers' KV is final once the engine's stream passed `fence` (None: now);
        returns how many regions went to running WRITEs."""
        if not self.pusher.streaming:
            return 0
        self._saved.update(names)
        done = [k for name in names if (k := self._region_of.get(name)) is not None
                and self._saved.issuperset(self.regions[k].names)]
        return len(done) * self.pusher.regions_ready(done, fence) if done else 0

    def forward_done(self, fence: Fence | None = None) -> None:
        """Layer-wise: the forward pass ended; every region of its pushes may be written once the
        engine's stream passed `fence` (None: now)."""
        self._saved.clear()
        if self.pusher.streaming:
            self.pusher.regions_ready(None, fence)

    # ---- both ----

    def abort(self, handle: str) -> None:
        """Give up a push on the prefill side (the decode's offer ends with its producer lease)."""
        self.pusher.abort(handle)

    def take_offers(self, ends: list[LeaseEnd], loaded: list[str], failed: dict[str, LoadFailure],
                    invalid: set[int]) -> list[LeaseEnd]:
        """Decode: the producer's lease ends that were offers, as loads; returns the others."""
        return self.offers.take(ends, loaded, failed, invalid)

    def take_pushes(self, loads: LoadResults) -> PushResults:
        """Prefill: the WRITEs that ended, taken out of the consumer's results."""
        return self.pusher.take(loads)

    def close(self) -> None:
        """Stop sending offers."""
        self.offers.close()
