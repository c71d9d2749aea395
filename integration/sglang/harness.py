"""Real SGLang servers for the kvconnect e2e tests: a tiny random Llama, a plain server, and a
prefill + decode pair with a kvconnect backend behind sglang_router's mini load balancer.

Every server runs in its own process group with its log under the run's directory and is stopped
(SIGTERM, then SIGKILL) by whoever started it. Servers run from that directory, not the checkout,
so the package metadata SGLang finds its plugins by is the virtualenv's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PY = sys.executable
VOCAB = 32000
START_S = 600.0  # a prefill + decode pair starts in about 80 s on two cores; far more when they are shared
REQUEST_S = 300.0
ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_HOST_IP": "127.0.0.1", "PYTHONWARNINGS": "ignore",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       # kvconnect's decode refuses a deferred KV release timeout shorter than its load deadline (60 s).
       "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "90"}
COMMON = ["--device", "cpu", "--host", "127.0.0.1", "--dtype", "float16", "--max-total-tokens", "8192",
          "--disable-overlap-schedule", "--chunked-prefill-size", "256"]

_MODEL = r'''
import json, sys, torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast, LlamaConfig, LlamaForCausalLM
out = sys.argv[1]
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
for w in [f"w{i}" for i in range(32000 - 3)]:
    vocab.setdefault(w, len(vocab))
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")
PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(out)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(vocab), max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                  **json.loads(sys.argv[2]))
LlamaForCausalLM(cfg).save_pretrained(out)
'''


# The e2e model: 4 layers, 2 KV heads of 64, about 2 KiB of KV per token in float16.
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2}
# For timing transfers: 16 KiB of KV per token (16 layers, 4 KV heads of 64) for little more compute.
KV_HEAVY = {"hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 16, "num_attention_heads": 4,
            "num_key_value_heads": 4}


def make_model(path: Path, shape: dict | None = None) -> Path:
    """A random Llama of `shape` (default `TINY`) with a word-level tokenizer, saved at `path`, built once."""
    if not (path / "model.safetensors").exists():
        subprocess.run([PY, "-c", _MODEL, str(path), json.dumps(shape or TINY)], check=True, timeout=600,
                       stdout=subprocess.DEVNULL, env={**os.environ, **ENV})
    return path


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, payload: dict | None = None, timeout: float = REQUEST_S) -> tuple[int, dict | str]:
    """(status, JSON body or text) of a GET (no payload) or POST; an HTTP error status is returned, not raised."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body = r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read().decode(errors="replace")
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


class PortTaken(RuntimeError):
    """A server could not bind a port `free_port` gave it: another process took it in between."""


class Server:
    """One process group (an SGLang server or the router) with its log file."""

    def __init__(self, name: str, args: list[str], logdir: Path, health: str, env: dict | None = None):
        self.name, self.health, self.log = name, health, logdir / f"{name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=logdir,
                                         env={**os.environ, **ENV, **(env or {})}, start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        """Until /health answers 200; RuntimeError (with the log's tail) if the server exits or the deadline passes."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited rc={self.proc.returncode}:\n{self.tail()}")
            if "error while attempting to bind on address" in self.log.read_text(errors="replace"):
                raise PortTaken(f"{self.name}: a port it was given was taken first:\n{self.tail()}")
            try:
                if http(self.health, timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready at {self.health}:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        """The last lines of the log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the whole group now."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; waits for the leader."""
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)
        self.proc.wait(timeout=30)


def sglang(name: str, model: Path, logdir: Path, extra: list[str], env: dict | None = None,
           core: int | None = None) -> tuple[Server, str]:
    """An SGLang server started with `extra` flags, and its base URL; `core`: every thread of it on that CPU,
    with one OpenMP thread (SGLang binds its CPU threads itself only on AMX and Arm hosts)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [PY, "-m", "sglang.launch_server", "--model-path", str(model), *COMMON, "--port", str(port), *extra]
    if core is not None:
        args = ["taskset", "-c", str(core), *args]
        env = {**(env or {}), "OMP_NUM_THREADS": "1"}
    return Server(name, args, logdir, f"{base}/health", env), base


def plain_outputs(name: str, model: Path, logdir: Path, prompts: list[list[int]], extra: list[str] | None = None,
                  env: dict | None = None) -> dict:
    """Greedy outputs of a plain (not disaggregated) server started with `extra` flags, by prompt; the
    server is stopped before returning (two cores, little memory: no pair runs beside it)."""
    server, base = sglang(name, model, logdir, extra or [], env)
    try:
        server.wait_ready(time.monotonic() + START_S)
        outs = generate_all(base, prompts)
    finally:
        server.stop()
    for o in outs:
        assert "error" not in o, o
    return {tuple(p): o for p, o in zip(prompts, outs)}


def tp_args(tp: int) -> tuple[list[str], dict]:
    """The flags and environment of a server of `tp` ranks: each rank on a core of its own (SGLang's CPU
    engine asks for it past one rank per NUMA node)."""
    if tp == 1:
        return [], {}
    return ["--tp", str(tp)], {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1))
                                                                      for i in range(tp))}


class PDSet:
    """A prefill and a decode server with one transfer backend, behind sglang_router's mini load balancer."""

    def __init__(self, model: Path, logdir: Path, backend: str, env: dict | None = None, tag: str = "",
                 extra: list[str] | None = None, tp: tuple[int, int] = (1, 1), cores: tuple[int, int] | None = None):
        """`tag` prefixes the servers' log names (a second set with the same backend keeps its own logs);
        `extra` flags go to both servers; `tp`: the prefill's and the decode's TP sizes; `cores`: the CPU
        the prefill and the decode each run on (TP 1 only), as timings need: unpinned, the decode's
        scheduler, which spins while it waits, takes CPU from the prefill's forward."""
        if cores is not None and tp != (1, 1):
            raise ValueError("cores pins servers of one rank each")
        self.backend, self.logdir, self.servers, self.cores = backend, logdir, [], cores or (None, None)
        for attempt in range(3):
            try:
                self._start(model, logdir, f"{tag}{backend}", env, extra, tp)
                return
            except PortTaken:  # a free port was taken before the server bound it: new ports, new servers
                if attempt == 2:
                    raise

    def _start(self, model: Path, logdir: Path, name: str, env: dict | None, extra: list[str] | None,
               tp: tuple[int, int]) -> None:
        self.servers = []
        self.bootstrap = free_port()
        pd = ["--disaggregation-transfer-backend", self.backend, *(extra or [])]
        (p_flags, p_env), (d_flags, d_env) = (tp_args(n) for n in tp)
        try:
            self.prefill, self.prefill_url = self._add(sglang(f"prefill-{name}", model, logdir, pd + p_flags + [
                "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(self.bootstrap)],
                {**(env or {}), **p_env}, self.cores[0]))
            self.decode, self.decode_url = self._add(sglang(f"decode-{name}", model, logdir, pd + d_flags + [
                "--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup", "cpu_tensor"],
                {**(env or {}), **d_env}, self.cores[1]))
            deadline = time.monotonic() + START_S
            self.prefill.wait_ready(deadline)
            self.decode.wait_ready(deadline)
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.router = self._add((Server(f"router-{name}", [
                PY, "-m", "sglang_router.launch_router", "--mini-lb", "--pd-disaggregation",
                "--prefill", self.prefill_url, str(self.bootstrap), "--decode", self.decode_url,
                "--host", "127.0.0.1", "--port", str(port)], logdir, f"{self.url}/health", env), None))[0]
            self.router.wait_ready(deadline)
        except BaseException:
            self.stop()
            raise

    def _add(self, pair):
        self.servers.append(pair[0])
        return pair

    def stop(self) -> None:
        """Stop every server this set started (router first)."""
        for s in reversed(self.servers):
            s.stop()


def generate(base: str, ids: list[int], max_new_tokens: int = 8, logprobs: bool = True,
             extra: dict | None = None) -> dict:
    """One greedy /generate by token ids: {"ids": output ids, "logprobs": per output token} or {"error": ...}.
    `extra` joins the body (a router's bootstrap fields, to talk to a prefill or decode server directly)."""
    try:
        status, body = http(f"{base}/generate", {
            "input_ids": ids, "return_logprob": logprobs, **(extra or {}),
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})
    except OSError as exc:  # the server went away (a fault test killed it) or the request timed out
        return {"error": f"{type(exc).__name__}: {exc}"}
    if status != 200 or not isinstance(body, dict) or "output_ids" not in body:
        return {"error": f"HTTP {status}: {str(body)[:300]}"}
    finish = body.get("meta_info", {}).get("finish_reason") or {}
    if finish.get("type") == "abort":
        return {"error": f"aborted: {finish.get('message', finish)}"}
    lp = [t[0] for t in body.get("meta_info", {}).get("output_token_logprobs", [])]
    return {"ids": body["output_ids"], "logprobs": lp}


def generate_all(base: str, prompts: list[list[int]], concurrent: int = 1, **kw) -> list[dict]:
    """`generate` for every prompt, `concurrent` at a time, in prompt order."""
    with ThreadPoolExecutor(concurrent) as pool:
        return list(pool.map(lambda ids: generate(base, ids, **kw), prompts))


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Prompts of these token counts, ids drawn from the word part of the vocabulary."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
