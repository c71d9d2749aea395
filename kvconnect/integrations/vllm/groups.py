"""vLLM's KV-cache groups as kvconnect moves them: which layers, and which of a request's blocks.

A group is the set of layers that share one block table. kvconnect registers every layer's tensor
as plain regions (layers viewing the same storage, across groups too, become one region) and moves
each group's blocks in the regions of its layers; the group's kind is a label compared with the
peer's, never interpreted. What differs per group is which blocks of a request carry its state,
read off the group's spec:

- a group that keeps one state for the whole sequence (vLLM's `tokens_per_state` < 0: Mamba, short
  conv, GDN) moves its running-state block only, never the speculative-decoding scratch slots;
- a sliding-window group moves the blocks in the window (vLLM nulls the ones before it);
- every other group moves the blocks that cover the prompt.

A model with a whole-sequence state cannot let decode recompute the last prompt token on top of a
state that already includes it: prefill stops one token short (`prefill_backoff`), so decode starts
from the state after the tokens it has not yet been fed and computes the last prompt token itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvconnect.kvgroups import KVGroup

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class GroupRule:
    """Which blocks of one group a request moves."""

    block_size: int  # tokens per block of this group
    whole_sequence_state: bool = False
    window_blocks: int = 0  # sliding window, in blocks (0: none)
    window_tokens: int = 0  # sliding window, in tokens (0: none)
    scratch_blocks: int = 0  # trailing speculative-decoding slots of a state group

    def select(self, blocks: Sequence[int], num_tokens: int | None) -> list[int]:
        """The blocks that carry this group's state for the first `num_tokens` tokens (None: all given)."""
        blocks = list(blocks)
        if self.whole_sequence_state:
            if self.scratch_blocks and len(blocks) > 1:
                blocks = blocks[:-min(self.scratch_blocks, len(blocks) - 1)]
            return blocks[-1:]
        if num_tokens is not None:
            blocks = blocks[:math.ceil(num_tokens / self.block_size)]
        if self.window_blocks:
            blocks = blocks[-self.window_blocks:]
        return blocks


@dataclass(frozen=True)
class Groups:
    """The transferable groups of one engine: kvconnect's KVGroups and the rule for each."""

    groups: tuple[KVGroup, ...]
    rules: tuple[GroupRule, ...]
    transfer_ids: tuple[int, ...]  # vLLM's index of each transferable group

    @property
    def prefill_backoff(self) -> int:
        """Prompt tokens prefill leaves to decode (1 when a group keeps a whole-sequence state)."""
        return 1 if any(r.whole_sequence_state for r in self.rules) else 0

    def select(self, block_ids: Sequence[Sequence[int]], num_tokens: int | None) -> list[list[int]]:
        """Per transferable group, the blocks a request moves, from vLLM's block ids of every group."""
        return [rule.select(block_ids[g], num_tokens) for g, rule in zip(self.transfer_ids, self.rules)]


def kv_groups(kv_cache_config: KVCacheConfig | None) -> Groups:
    """The transferable KV-cache groups of a model, with the blocks rule of each."""
    if kv_cache_config is None:
        return Groups((), (), ())
    groups, rules, ids = [], [], []
    for index, g in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(g, "enable_kv_transfer", True):
            continue  # rebuilt from another group after a load (vLLM's ephemeral replicas)
        spec = g.kv_cache_spec
        block_size = int(spec.block_size)
        window = getattr(spec, "sliding_window", None)
        rules.append(GroupRule(
            block_size=block_size,
            whole_sequence_state=getattr(spec, "tokens_per_state", 1) < 0,
            window_blocks=math.ceil(window / block_size) + 1 if window else 0,
            window_tokens=int(window or 0),
            scratch_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0)))
        groups.append(KVGroup(layers=tuple(g.layer_names), label=type(spec).__name__, block_size=block_size))
        ids.append(index)
    return Groups(tuple(groups), tuple(rules), tuple(ids))
