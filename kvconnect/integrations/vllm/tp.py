"""Tensor parallelism on vLLM: this worker's TP rank, and how each layer's pages split across ranks.

vLLM shards attention KV by KV head (a rank of a TP size above the head count holds one head,
replicated) and keeps an MLA latent whole on every rank. The split is described here, per layer,
from the registered tensor and its group's spec, for the core to pair pages between TP sizes
(`kvconnect.shards`). vLLM lays a hybrid model's attention and state pages in tensors the groups
share; the core keeps one split per group there. A Mamba2 state page is described from its spec's
shapes and the model's group count: the conv state's channels (x by head, then B and C by group,
replicated as vLLM replicates a single group) and the SSM state by head; the padding after them
never moves. Other state layers (Mamba1, short conv, GDN) get none: they move only between equal TP
sizes, and other pairs are refused naming both sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvconnect.shards import PageShards, attention, mamba2_state, replicated

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def tp_size(vllm_config: VllmConfig, connector: str) -> int:
    """The engine's tensor-parallel size; ValueError naming `connector` for pipeline parallelism, which
    kvconnect does not map."""
    parallel = vllm_config.parallel_config
    if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
        raise ValueError(f"{connector}: pipeline_parallel_size > 1 is not supported by kvconnect's connectors")
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def check_push_ports(mode: str, port: int, role: str, tp: int, connector: str) -> None:
    """ValueError naming `connector` for a push-mode instance that may prefill at TP > 1 without `port`:
    a push-mode decode finds prefill rank r at `port + r`, so a port each rank picks itself is never found."""
    if mode == "push" and tp > 1 and port == 0 and role in ("producer", "both"):
        raise ValueError(f'{connector}: "mode": "push" at tensor_parallel_size {tp} needs "port" set in '
                         f"kv_connector_extra_config (rank r listens at port + r, where push-mode decodes look)")


def tp_rank() -> int:
    """This worker's rank in its tensor-parallel group (0 outside one)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, AttributeError):  # no TP group initialised: a single-rank engine
        return 0


@dataclass(frozen=True)
class StateSplit:
    """What a Mamba2 state page's split needs beyond its spec: the TP size, the model's B/C group count
    and whether the conv state is stored channels first (vLLM's "DS" layout)."""

    tp: int
    groups: int
    conv_dim_first: bool = False


def state_split(vllm_config: VllmConfig, tp: int) -> StateSplit | None:
    """The model's Mamba2 state facts, None for a model without them."""
    hf = getattr(vllm_config.model_config, "hf_text_config", None) or vllm_config.model_config.hf_config
    groups = next((getattr(hf, k) for k in ("mamba_n_groups", "n_groups", "mamba_ngroups") if getattr(hf, k, None)),
                  None)
    if not isinstance(groups, int) or groups < 1:
        return None
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return StateSplit(tp=tp, groups=groups, conv_dim_first=bool(is_conv_state_dim_first()))


def layer_shards(kv_cache_config: KVCacheConfig | None, kv_caches: dict[str, torch.Tensor], total_heads: int,
                 layout: str, state: StateSplit | None = None) -> dict[str, PageShards]:
    """Per layer, how its registered pages split: attention by KV head (`layout`: LBHNC or LBNHC), Mamba2
    state pages by head and group when `state` is given."""
    out: dict[str, PageShards] = {}
    for group in getattr(kv_cache_config, "kv_cache_groups", ()) or ():
        spec = group.kv_cache_spec
        for name in group.layer_names:
            tensor = kv_caches.get(name)
            if tensor is not None:
                split = _split(spec, tensor, total_heads, layout)
                if split is None and state is not None:
                    split = mamba2_split(spec, tensor[0].numel() * tensor.element_size(), state)
                if split is not None:
                    out[name] = split
    return out


def mamba2_split(spec: Any, page: int, state: StateSplit) -> PageShards | None:
    """The split of a Mamba2 state page from its spec's shapes (conv state, SSM state) as this rank of
    `state.tp` holds them; None for another kind of state or shapes that do not add up."""
    kind = getattr(getattr(spec, "mamba_type", None), "name", None)
    shapes, dtypes = getattr(spec, "shapes", ()), getattr(spec, "dtypes", ())
    if kind != "MAMBA2" or len(shapes) != 2 or len(dtypes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return None
    tp, groups = state.tp, state.groups
    if groups % tp and groups != 1:  # vLLM replicates a single group only
        return None
    heads, head_dim, d_state = shapes[1]
    channels, taps = shapes[0] if state.conv_dim_first else shapes[0][::-1]
    if channels != heads * head_dim + 2 * max(groups // tp, 1) * d_state:
        return None
    conv_bytes, ssm_bytes = (torch.empty(0, dtype=d).element_size() for d in dtypes)
    split = mamba2_state(heads, head_dim, d_state, groups, taps, conv_bytes, ssm_bytes, tp, state.conv_dim_first)
    return split if split[-1].offset + heads * split[-1].unit <= page else None


def _split(spec: Any, tensor: torch.Tensor, total_heads: int, layout: str) -> PageShards | None:
    page = tensor[0].numel() * tensor.element_size()
    if type(spec).__name__ == "MLAAttentionSpec":
        return replicated(page)
    heads, tokens = getattr(spec, "num_kv_heads", None), getattr(spec, "block_size", None)
    if not heads or not tokens or getattr(spec, "tokens_per_state", 1) < 0 or page % (heads * tokens):
        return None
    dims = tuple(tensor.shape[1:3])
    if layout == "LBHNC" and dims == (heads, tokens):
        return attention(tokens, heads, page // (heads * tokens), total_heads, heads_outer=True)
    if layout == "LBNHC" and dims == (tokens, heads):
        return attention(tokens, heads, page // (heads * tokens), total_heads, heads_outer=False)
    return None
