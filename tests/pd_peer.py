"""A producer (prefill) worker in its own process, driven over a Pipe by P/D tests.

The pipe only plays the router's part (it carries transfer params out, commands in); metadata,
claims, heartbeats and done/abort notices travel over kvconnect's own side channel.
"""

from __future__ import annotations

import time

import torch

from kvconnect.connector import ConnectorConfig, KVConnector
from kvconnect.layout import MambaPage
from kvconnect import wire

MAMBA = MambaPage([(3, 64), (4, 8, 16)], [torch.float16, torch.float32], page_size_bytes=4096)


def make_caches(kind: str, num_blocks: int, seed: int) -> tuple[dict[str, torch.Tensor], list[list[int]] | None]:
    """KV caches of a model family filled with seeded random bytes, and their KV groups."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    if kind == "dense":  # GQA: 4 layers, 2 KV heads, 16 tokens, K|V of head size 64, bf16: 8 KiB pages
        return {f"layers.{i}.attn": rand(num_blocks, 2 * 16 * 128 * 2).view(torch.bfloat16).view(num_blocks, 2, 16, 128)
                for i in range(4)}, None
    if kind == "mla":  # one 576-element latent per token, 3 layers
        return {f"layers.{i}.mla": rand(num_blocks, 16 * 576 * 2).view(torch.bfloat16).view(num_blocks, 16, 576)
                for i in range(3)}, None
    if kind == "hybrid":  # 2 attention layers + 2 Mamba layers (int8 pages), two KV groups
        caches = {f"layers.{i}.attn": rand(num_blocks, 4096).view(torch.bfloat16).view(num_blocks, 1, 16, 128)
                  for i in (0, 2)}
        caches.update({f"layers.{i}.mamba": rand(num_blocks, 4096).view(torch.int8).view(num_blocks, 1, 1, 4096)
                       for i in (1, 3)})
        return caches, [[0, 1], [2, 3]]
    if kind == "cross":  # one cross-layer tensor: blocks outermost, 4 layers inside each block
        return {"all_layers": rand(num_blocks, 4 * 2 * 16 * 64 * 2).view(torch.float16).view(num_blocks, 4, 2, 16, 64)}, None
    if kind == "big":  # 64 KiB blocks, enough bytes that a pull is still running when the producer dies
        return {"big": rand(num_blocks, 65536)}, None
    raise ValueError(kind)


def producer_main(conn, kind: str, num_blocks: int, seed: int, engine_id: str, port: int, lease_s: float,
                  secret: str | None, backend: str) -> None:
    """Register a cache and serve: hold/abort/held/releases/stop."""
    caches, groups = make_caches(kind, num_blocks, seed)
    connector = KVConnector(ConnectorConfig(role="producer", engine_id=engine_id, port=port, lease_s=lease_s,
                                            secret=secret, group_regions=groups, backend=backend))
    connector.register_kv_caches(caches)
    conn.send(("ready", connector.side_channel, connector.metadata.incarnation))
    releases: list[tuple[str, str]] = []

    def drain() -> None:
        releases.extend((r.request_id, r.reason.value) for r in connector.producer.poll())

    try:
        while True:
            if not conn.poll(0.01):
                drain()
                continue
            cmd, *args = conn.recv()
            if cmd == "hold":
                rid, block_ids, tokens = args
                params = connector.request_finished(rid, block_ids, tokens)
                conn.send(wire.transfer_params_to_builtins(params))
            elif cmd == "abort":
                conn.send(connector.producer.abort(args[0]))
            elif cmd == "held":  # wait (bounded) until no blocks are held, then report the count
                deadline = time.monotonic() + args[0]
                while connector.held_blocks and time.monotonic() < deadline:
                    drain()
                    time.sleep(0.01)
                drain()
                conn.send(connector.held_blocks)
            elif cmd == "releases":
                drain()
                conn.send(list(releases))
            elif cmd == "stop":
                break
    finally:
        connector.close()
