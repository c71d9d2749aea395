"""Shared fixtures: KV caches shaped like real models, filled with reproducible bytes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvconnect.layout import KVCacheLayout


def random_bytes_(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill a tensor's storage with random bytes (any dtype) in place."""
    raw = tensor.view(torch.uint8) if tensor.is_contiguous() else None
    gen = torch.Generator().manual_seed(seed)
    if raw is not None:
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    else:
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=gen).to(tensor.dtype))
    return tensor


def copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """Move bytes row by row between paired descriptor arrays, the way a transport would."""
    if dst.shape != src.shape:
        raise ValueError("descriptor arrays differ in shape")
    for (daddr, dlen, _), (saddr, slen, _) in zip(dst.tolist(), src.tolist()):
        if dlen != slen:
            raise ValueError("paired descriptors differ in length")
        ctypes.memmove(daddr, saddr, dlen)


def kv_cache(layout: KVCacheLayout, shape: tuple[int, int, int, int, int], dtype: torch.dtype,
             seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A flat buffer of random bytes and its per-layer `[B, H, N, C]` views in `layout`."""
    numel = int(np.prod(shape))
    buf = torch.empty(numel, dtype=dtype)
    random_bytes_(buf, seed)
    views = layout.per_layer_views(buf, shape)
    return buf, {f"model.layers.{i}.attn": v for i, v in enumerate(views)}


@pytest.fixture
def llama_like_cache() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A small Llama-shaped cache: 4 layers, 32 blocks, 2 KV heads, 16 tokens, K|V of head size 64, bf16."""
    return kv_cache(KVCacheLayout.LBHNC, (4, 32, 2, 16, 128), torch.bfloat16, seed=1)


class ProducerProcess:
    """A producer worker in a spawned process (see tests/pd_peer.py), commanded over a Pipe."""

    def __init__(self, kind: str, num_blocks: int, seed: int, *, engine_id: str = "prefill-0", port: int = 0,
                 lease_s: float = 30.0, secret: str | None = None, backend: str = "nixl"):
        import multiprocessing as mp

        import pd_peer

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=pd_peer.producer_main, daemon=True,
                                args=(child, kind, num_blocks, seed, engine_id, port, lease_s, secret, backend))
        self.proc.start()
        _, (self.host, self.port), self.incarnation = self._recv(60.0)
        self.kind, self.num_blocks, self.seed = kind, num_blocks, seed

    def _recv(self, timeout: float = 30.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"producer process silent for {timeout} s (exit code {self.proc.exitcode})")
        return self.conn.recv()

    def call(self, *cmd, timeout: float = 30.0):
        """Send a command and return the producer's answer."""
        self.conn.send(cmd)
        return self._recv(timeout)

    def hold(self, request_id: str, block_ids, tokens: int) -> dict:
        """Hold blocks (one list per KV group) and return the transfer params as plain data."""
        return self.call("hold", request_id, [list(map(int, g)) for g in block_ids], tokens)

    def held_blocks(self, wait_s: float = 10.0) -> int:
        """Blocks still held after waiting up to `wait_s` for them to be released."""
        return self.call("held", wait_s, timeout=wait_s + 30.0)

    def kill(self) -> None:
        """SIGKILL: no goodbye, no cleanup."""
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        """Orderly stop; kill if it does not exit."""
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(15)
        if self.proc.is_alive():
            self.kill()


@pytest.fixture
def producers():
    """Start producer processes with `producers(kind, num_blocks, seed, **kw)`; all stopped at teardown."""
    started: list[ProducerProcess] = []

    def start(*args, **kw) -> ProducerProcess:
        p = ProducerProcess(*args, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()
