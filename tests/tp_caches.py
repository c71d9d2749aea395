"""KV caches of one tensor-parallel rank, cut from a model-wide cache made of seeded random bytes.

Every rank of every TP size cuts its shard from the same global bytes (one seed), so what a decode
rank of TP `d` must hold after a pull is simply `tp_caches(kind, ..., tp=d, rank=r)` of the
producer's seed. Kinds: `tp-hnd-H` and `tp-nhd-H` (attention with H KV heads, pages `[heads,
tokens, K|V]` or `[tokens, heads, K|V]`), `tp-mla` (a latent every rank holds whole), `tp-hybrid`
(an attention group and a Mamba-like group whose page packs a conv state `[3, channels]`, sharded by
channel, and an SSM state sharded by head), `tp-shared` (a hybrid as vLLM lays it: an attention layer
and a Mamba2 layer viewing one tensor, each group using its own blocks of it: blocks of even id hold
attention pages, odd ones Mamba2 state pages padded to the attention page's size, cut here as vLLM
shards them and described by `kvconnect.shards.mamba2_state`), `tp-aux` (a group of attention pages split by
head beside a group of rows every rank holds whole, as SGLang's aux rows: between TP sizes one prefill
rank supplies a decode rank heads and no row) and `tp-plain-H` (attention with no split described).
"""

from __future__ import annotations

import zlib

import torch

from kvconnect.kvgroups import KVGroup
from kvconnect.shards import PageShards, Segment, attention, mamba2_state, owned, replicated

TOKENS = 16
HEAD_BYTES = 2 * 32 * 2  # K|V of head size 32 in bf16
CONV_ROWS, CONV_CHANNELS, SSM_HEADS, SSM_HEAD_BYTES = 3, 64, 8, 512
# tp-shared's Mamba2 layer: 8 heads of 8 channels, one B/C group of state size 4 (replicated across
# ranks, as vLLM does), conv taps 3 in 2-byte values, SSM state in 4-byte values.
M2_HEADS, M2_HEAD_DIM, M2_STATE, M2_TAPS = 8, 8, 4, 3


def _global(seed: int, name: str, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def tp_caches(kind: str, num_blocks: int, seed: int, tp: int = 1, rank: int = 0
              ) -> tuple[dict[str, torch.Tensor], list[KVGroup] | None, dict[str, PageShards] | None]:
    """Rank `rank` of `tp`'s caches (uint8 pages), KV groups and page splits for a TP kind."""
    caches: dict[str, torch.Tensor] = {}
    shards: dict[str, PageShards] = {}
    groups = None
    family, _, heads_text = kind.removeprefix("tp-").partition("-")
    if family in ("hnd", "nhd", "plain"):
        heads = int(heads_text)
        first, n = owned(heads, tp, rank)
        for i in range(2):
            name = f"layers.{i}.attn"
            full = _global(seed, name, num_blocks, heads, TOKENS, HEAD_BYTES)[:, first:first + n]
            caches[name] = full.transpose(1, 2).contiguous() if family == "nhd" else full.contiguous()
            if family != "plain":
                shards[name] = attention(TOKENS, n, HEAD_BYTES, heads, heads_outer=family != "nhd")
    elif family == "aux":
        first, n = owned(4, tp, rank)
        for i in range(2):
            name = f"layers.{i}.attn"
            full = _global(seed, name, num_blocks, 4, TOKENS, HEAD_BYTES)[:, first:first + n]
            caches[name] = full.transpose(1, 2).contiguous()
            shards[name] = attention(TOKENS, n, HEAD_BYTES, 4, heads_outer=False)
        caches["aux.0"] = _global(seed, "aux.0", num_blocks, 96)
        shards["aux.0"] = replicated(96)
        groups = [KVGroup(layers=("layers.0.attn", "layers.1.attn"), label="kv"),
                  KVGroup(layers=("aux.0",), label="aux")]
    elif family == "mla":
        for i in range(2):
            name = f"layers.{i}.mla"
            caches[name] = _global(seed, name, num_blocks, TOKENS, 576 * 2)
            shards[name] = replicated(TOKENS * 576 * 2)
    elif family == "hybrid":
        first, n = owned(4, tp, rank)
        caches["layers.0.attn"] = _global(seed, "layers.0.attn", num_blocks, 4, TOKENS, HEAD_BYTES)[
            :, first:first + n].contiguous()
        shards["layers.0.attn"] = attention(TOKENS, n, HEAD_BYTES, 4, heads_outer=True)
        c0, nc = owned(CONV_CHANNELS, tp, rank)
        h0, nh = owned(SSM_HEADS, tp, rank)
        conv = _global(seed, "conv", num_blocks, CONV_ROWS, CONV_CHANNELS, 2)[:, :, c0:c0 + nc]
        ssm = _global(seed, "ssm", num_blocks, SSM_HEADS, SSM_HEAD_BYTES)[:, h0:h0 + nh]
        page = torch.cat((conv.reshape(num_blocks, -1), ssm.reshape(num_blocks, -1)), dim=1)
        caches["layers.1.mamba"] = page.contiguous().view(torch.int8).view(num_blocks, 1, 1, -1)
        shards["layers.1.mamba"] = (
            Segment(offset=0, repeat=CONV_ROWS, stride=nc * 2, unit=2, total=CONV_CHANNELS),
            Segment(offset=CONV_ROWS * nc * 2, repeat=1, stride=0, unit=SSM_HEAD_BYTES, total=SSM_HEADS))
        groups = [KVGroup(layers=("layers.0.attn",), label="attention"),
                  KVGroup(layers=("layers.1.mamba",), label="mamba")]
    elif family == "shared":
        caches, shards = _shared_hybrid(num_blocks, seed, tp, rank)
        groups = [KVGroup(layers=("layers.0.attn",), label="attention"),
                  KVGroup(layers=("layers.0.mamba",), label="mamba")]
    else:
        raise ValueError(kind)
    return caches, groups, shards or None


def _shared_hybrid(num_blocks: int, seed: int, tp: int, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    first, n = owned(4, tp, rank)
    attn = _global(seed, "layers.0.attn", num_blocks, 4, TOKENS, HEAD_BYTES)[:, first:first + n].contiguous()
    page = attn[0].numel()
    # The Mamba2 state of every block, model-wide: conv taps over [x | B | C] channels, SSM per head.
    x = M2_HEADS * M2_HEAD_DIM
    conv = _global(seed, "conv2", num_blocks, M2_TAPS, x + 2 * M2_STATE, 2)
    ssm = _global(seed, "ssm2", num_blocks, M2_HEADS, M2_HEAD_DIM * M2_STATE * 4)
    c0, nc = owned(x, tp, rank)
    h0, nh = owned(M2_HEADS, tp, rank)
    local_conv = torch.cat((conv[:, :, c0:c0 + nc], conv[:, :, x:]), dim=2)  # B and C: every rank holds the group
    state = torch.cat((local_conv.reshape(num_blocks, -1), ssm[:, h0:h0 + nh].reshape(num_blocks, -1)), dim=1)
    raw = attn.reshape(num_blocks, page).clone()
    raw[1::2] = 0  # padding after the state never moves between TP sizes: zero on every side
    raw[1::2, :state.shape[1]] = state[1::2]
    caches = {"layers.0.attn": raw.view(num_blocks, n, TOKENS, HEAD_BYTES),
              "layers.0.mamba": raw.view(torch.int8).view(num_blocks, 1, 1, page)}
    return caches, {"layers.0.attn": attention(TOKENS, n, HEAD_BYTES, 4, heads_outer=True),
                    "layers.0.mamba": mamba2_state(nh, M2_HEAD_DIM, M2_STATE, 1, M2_TAPS, 2, 4, tp)}
