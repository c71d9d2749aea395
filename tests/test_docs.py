"""Every shell command in the docs is one that works: checked against the code it names.

Each line of a ```sh block in README.md, docs/ and docker/README.md (continuations joined, comments
and leading `VAR=value` assignments dropped) must be one of the forms below, or this test fails, so a
new kind of command in the docs gets a check before it lands:

- `make TARGET`: the Makefile has a rule for TARGET;
- `kvconnect ...`: the command line parses (flags exist, values valid), without running;
- `python3 -m vllm.entrypoints.openai.api_server ...`: a kvconnect connector, a kv_role vLLM takes, and
  only extra-config keys the adapter reads (the e2e suite starts the README's P/D commands for real);
- `docker build -f FILE` / `docker compose -f FILE ...`: the files exist (test_docker renders them);
- `curl URL`: a route that `kvconnect proxy` serves;
- `vllm-router --vllm-pd-disaggregation --prefill URL --decode URL`: the e2e suite runs it for real
  (integration/vllm/test_router_e2e.py).
Synopses (`kvconnect demo [--tokens N]`) go in ```text blocks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from doc_commands import VLLM_SERVER, shell_commands
from kvconnect.cli import parse
from test_docker import adapter_keys

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docker" / "README.md",
        ROOT / "integration" / "vllm" / "README.md"]
ROUTER_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


COMMANDS = [(f"{p.relative_to(ROOT)}: {text}", argv) for p in DOCS for text, argv in shell_commands(p)]


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def _option(argv: list[str], name: str) -> str:
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    assert len(values) == 1, f"{name} given {len(values)} times"
    return values[0]


def check(argv: list[str]) -> None:
    """Fail unless `argv` is a documented command that works."""
    if argv[0] == "make":
        missing = set(argv[1:]) - _make_targets()
        assert not missing, f"no Makefile rule for {sorted(missing)}"
    elif argv[0] == "kvconnect":
        try:
            parse(argv[1:])
        except SystemExit as exc:
            pytest.fail(f"kvconnect refuses this command line (exit {exc.code})")
    elif argv[:3] == VLLM_SERVER:
        kv = json.loads(_option(argv, "--kv-transfer-config"))
        assert kv["kv_connector"] in ("KVConnectNixl", "KVConnectMooncake", "KVConnectOffload"), kv
        assert kv["kv_role"] in ("kv_producer", "kv_consumer", "kv_both"), kv
        struct = "OffloadConfig" if kv["kv_connector"] == "KVConnectOffload" else "PDConfig"
        unknown = set(kv.get("kv_connector_extra_config", {})) - adapter_keys(struct)
        assert not unknown, f"extra-config keys the adapter does not read: {unknown}"
        assert "--model" in argv
    elif argv[:2] == ["docker", "build"] or argv[:2] == ["docker", "compose"]:
        for name in [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-f"]:
            assert (ROOT / name).is_file(), f"{name} does not exist"
    elif argv[0] == "curl":
        url = next(a for a in argv if a.startswith("http"))
        assert re.sub(r"^https?://[^/]+", "", url) in ROUTER_ROUTES, url
    elif argv[0] == "vllm-router":
        assert {"--vllm-pd-disaggregation", "--prefill", "--decode"} <= set(argv), argv
    else:
        pytest.fail("a kind of command this check does not know: add a rule for it above")


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_works(where, argv) -> None:
    check(argv)


def test_the_docs_have_commands_to_check() -> None:
    kinds = {argv[0] if argv[0] != "python3" else argv[2] for _, argv in COMMANDS}
    assert {"make", "kvconnect", "vllm.entrypoints.openai.api_server", "docker", "curl"} <= kinds, kinds


@pytest.mark.parametrize("argv", [
    ["kvconnect", "demo", "--tokens", "0"],
    ["make", "bench"],
    ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--kv-transfer-config",
     '{"kv_connector":"KVConnectNixl","kv_role":"kv_both","kv_connector_extra_config":{"load_deadline":1}}'],
    ["curl", "http://127.0.0.1:8000/v1/embeddings"],
    ["vllm", "serve", "MODEL"],
])
def test_the_check_refuses_commands_that_would_not_work(argv) -> None:
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check(argv)
