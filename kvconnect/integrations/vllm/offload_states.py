"""The boundary states vLLM offers a connector, as KVConnectOffload keeps them.

In `mamba_cache_mode` `align`, a group with one state for the whole sequence (short conv, GDN) holds
a usable state only in the block of a block boundary where a prefill chunk or a decode step ended,
and vLLM frees that block two steps after writing it. It offers each such block in the scheduler
output of the step that writes it (`kv_connector_block_state.boundary_state_offloads`: per request,
`(vLLM's group index, block id, tokens the state covers)`), and nowhere else: by the time a request
finishes, its table holds only its running state. `offered_states` reads those offers for the tier.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from kvconnect.integrations.vllm.offload_groups import NULL_BLOCK


class StateOffer(NamedTuple):
    """One state block worth storing: the request, the group's position in the tier, the block, its boundary."""

    request_id: str
    group: int
    block: int
    boundary: int


def offered_states(scheduler_output: Any, group_ids: Sequence[int], state: Sequence[bool],
                   block_size: int) -> list[StateOffer]:
    """This step's offers of whole-block states of the tier's state groups, from live requests."""
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    offers = getattr(block_state, "boundary_state_offloads", None) or {}
    # A request preempted or finished this step may have its blocks reallocated and written already.
    gone = set(getattr(scheduler_output, "preempted_req_ids", None) or ()) | set(
        getattr(scheduler_output, "finished_req_ids", None) or ())
    out = []
    for rid, items in offers.items():
        if rid in gone:
            continue
        for group_id, block, boundary in items:
            pos = group_ids.index(group_id) if group_id in group_ids else -1
            # Only whole blocks: a boundary inside one (vLLM's finer hash blocks) has no key in the tier.
            if pos >= 0 and state[pos] and block != NULL_BLOCK and boundary > 0 and boundary % block_size == 0:
                out.append(StateOffer(rid, pos, int(block), int(boundary)))
    return out
