"""A kvconnect connector's bad `kv_connector_extra_config` is refused before any engine starts.

vLLM builds connector objects only after loading the weights; our plugin checks the config when vLLM
first looks the connector class up, while it builds its config in the server's own process. The unit
tests hold the check for every connector name; the server tests start the README's vLLM server command
with a bad key and read its output: a non-zero exit, one line naming the key, no traceback, and no
"Loading weights took" line, which the control test shows vLLM prints when a connector fails later.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.engine.arg_utils import EngineArgs

from harness import add_tokenizer, make_llama, plugin_registered
from kvconnect.integrations import CONNECTOR_NAMES
from kvconnect.integrations.vllm import precheck, register

pytestmark = pytest.mark.timeout(900)

WEIGHTS_LOADED = "Loading weights took"  # vLLM's default loader logs it (INFO) once the weights are in
# One mistake per connector: an unknown key, a wrong type, a value out of range.
BAD = [("KVConnectNixl", {"lease": 30}, "lease"),
       ("KVConnectMooncake", {"port": "8600"}, "port"),
       ("KVConnectOffload", {"cpu_gib": -1}, "cpu_gib")]


def _ktc(name: str, extra, role: str = "kv_both") -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_role=role, kv_connector_extra_config=extra)


@pytest.mark.parametrize("name,extra,key", BAD)
def test_a_bad_key_is_refused_in_one_line_naming_connector_key_and_allowed_keys(name, extra, key):
    with pytest.raises(precheck.BadExtraConfig) as err:
        precheck.check_transfer_config(_ktc(name, extra))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{name}: ") and (f"`{key}`" in msg or f"[{key!r}]" in msg), msg
    kind, _ = precheck.KINDS[name]
    assert f"(keys: {', '.join(kind.__struct_fields__)})" in msg, msg


def test_the_check_names_the_expected_type():
    want = r"kv_connector_extra_config\['port'\]: Expected `int`, got `str`"
    with pytest.raises(precheck.BadExtraConfig, match=want):
        precheck.check_transfer_config(_ktc("KVConnectNixl", {"port": "8600"}))


def test_every_registered_connector_name_is_checked():
    assert set(precheck.KINDS) == set(CONNECTOR_NAMES)
    for name in CONNECTOR_NAMES:
        want = f"^{name}: kv_connector_extra_config: unknown field `no_such_key`"
        with pytest.raises(precheck.BadExtraConfig, match=want):
            precheck.check_transfer_config(_ktc(name, {"no_such_key": 1}))


@pytest.mark.parametrize("name,extra", [("KVConnectNixl", {}), ("KVConnectNixl", {"lease_s": 10, "mode": "push"}),
                                        ("KVConnectMooncake", {}), ("KVConnectOffload", {"cpu_gib": 0.5})])
def test_good_configs_pass(name, extra):
    precheck.check_transfer_config(_ktc(name, extra))


def test_renamed_keys_and_cross_key_rules_are_checked_too():
    with pytest.raises(precheck.BadExtraConfig, match="'load_deadline_s'.* renamed 'load_timeout_s'"):
        precheck.check_transfer_config(_ktc("KVConnectNixl", {"load_deadline_s": 5}))
    with pytest.raises(precheck.BadExtraConfig, match="layerwise"):
        precheck.check_transfer_config(_ktc("KVConnectNixl", {"layerwise": True}))
    with pytest.raises(precheck.BadExtraConfig, match="cpu_bytes or cpu_gib"):
        precheck.check_transfer_config(_ktc("KVConnectOffload", {"cpu_bytes": 1 << 20, "cpu_gib": 1}))


def test_other_connectors_are_left_to_vllm():
    precheck.check_transfer_config(_ktc("NixlConnector", {"anything": object()}))


def test_the_factory_lookup_checks_our_connectors_once_wrapped():
    register()
    precheck.install(KVConnectorFactory)  # a second install must not wrap twice
    wrapped = KVConnectorFactory.__dict__["get_connector_class"].__func__
    assert wrapped._kvconnect_precheck and not getattr(wrapped.__closure__[0].cell_contents,
                                                        "_kvconnect_precheck", False)
    assert KVConnectorFactory.get_connector_class(_ktc("KVConnectNixl", {})).__name__ == "KVConnectNixl"
    with pytest.raises(precheck.BadExtraConfig, match="`lease`"):
        KVConnectorFactory.get_connector_class(_ktc("KVConnectNixl", {"lease": 30}))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return add_tokenizer(make_llama(tmp_path_factory.mktemp("precheck") / "tiny-llama-tokenizer"))


def test_building_the_engine_config_refuses_it_before_any_engine(model):
    """What `vllm serve` and `LLM(...)` do first, in the caller's process: no engine, no weights."""
    register()
    args = EngineArgs(model=str(model), dtype="float32", max_model_len=512,
                      kv_transfer_config=_ktc("KVConnectNixl", {"lease": 30}))
    with pytest.raises(ValueError, match="KVConnectNixl: kv_connector_extra_config: .*`lease`"):
        args.create_engine_config()


def _serve(model: Path, kv: dict, log: Path) -> tuple[int, str]:
    """The README's server command with `kv`, run to its exit (bounded); (exit status, its output)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", "0",
            "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
            "--kv-transfer-config", json.dumps(kv)]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0",
               TOKENIZERS_PARALLELISM="false")
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(30)
    return rc, log.read_text(errors="replace")


@pytest.mark.parametrize("name,extra,key", BAD)
def test_a_server_with_a_bad_key_exits_with_one_line_before_loading_weights(model, tmp_path, name, extra, key):
    assert plugin_registered(), "the early check needs kvconnect's vllm.general_plugins entry point installed"
    rc, out = _serve(model, {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": extra},
                     tmp_path / "serve.log")
    errors = [line for line in out.splitlines() if line.startswith(f"error: {name}: ")]
    assert rc != 0, out[-3000:]
    assert len(errors) == 1 and (f"`{key}`" in errors[0] or f"[{key!r}]" in errors[0]), out[-3000:]
    assert "Traceback" not in out and WEIGHTS_LOADED not in out, out[-3000:]


def test_control_a_connector_refusing_later_fails_after_the_weights_line(model, tmp_path):
    """A disk tier that cannot be created is found only when the connector is built: after the weights."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    kv = {"kv_connector": "KVConnectOffload", "kv_role": "kv_both",
          "kv_connector_extra_config": {"tiers": [{"kind": "disk", "path": str(blocker / "tier")}]}}
    rc, out = _serve(model, kv, tmp_path / "serve.log")
    assert rc != 0 and WEIGHTS_LOADED in out and "kv_connector_extra_config['tiers']" in out, out[-3000:]
