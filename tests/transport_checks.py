"""Checks every transport must pass, run by each backend's test module against its own real peer.

`pair` is a module's fixture: (transport, local caches, local regions, peer) with the peer registered
as "prefill"; caches are built from PEER_BLOCKS/PEER_SEED the same way in every module.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvconnect.descriptors import Pairing, select
from kvconnect.errors import LocalInvalid
from kvconnect.regions import RegionSet
from kvconnect.transport.base import TransferState

PEER_BLOCKS, PEER_SEED = 64, 11
TIMEOUT_S = 20.0


def a_checked_selection_posts_as_it_is_and_only_to_its_own_peer(pair, caches_of, block_bytes) -> None:
    """A selection checked once posts without further checks, and is refused by any other peer or with ids."""
    t, caches, regions, peer = pair
    remote_ref = block_bytes(caches_of(PEER_BLOCKS, PEER_SEED), peer.regions)
    lids, rids = [7, 8, 20], [50, 51, 2]
    selection = select("READ", regions, lids, peer.regions, rids)
    h = t.post(selection, "prefill")
    assert t.wait(h, TIMEOUT_S) is TransferState.DONE
    t.release(h)
    after = block_bytes(caches, regions)
    for k in range(len(regions)):
        np.testing.assert_array_equal(after[k][lids], remote_ref[k][rids])
    lookalike = RegionSet.from_wire(peer.regions.to_wire())  # equal geometry, but not the peer's checked set
    with pytest.raises(LocalInvalid, match="other regions"):
        t.post(select("READ", regions, [0], lookalike, [0]), "prefill")
    with pytest.raises(LocalInvalid, match="carries its own"):
        t.post(selection, "prefill", [0], [0])


def a_pairing_checked_elsewhere_is_taken_only_for_the_registered_regions(pair) -> None:
    """add_peer takes a pairing built for the transport's own registered regions, and no other."""
    t, _, regions, peer = pair
    with pytest.raises(LocalInvalid, match="other regions"):
        t.add_peer("paired", peer.metadata, Pairing(RegionSet.from_wire(regions.to_wire()), peer.regions))
    pairing = Pairing(regions, peer.regions)
    t.add_peer("paired", peer.metadata, pairing)
    h = t.post(pairing.select("READ", [1], [1]), "paired")
    assert t.wait(h, TIMEOUT_S) is TransferState.DONE
    t.release(h)
    t.remove_peer("paired")
