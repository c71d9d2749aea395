import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import PDSet, make_model, plain_outputs, prompts_of  # noqa: E402

# Prompt lengths around page and chunk edges (page 1, chunked prefill 256) up to 1,500 tokens.
LENGTHS = [1, 2, 7, 64, 255, 256, 257, 600, 1023, 1500]
CONCURRENT = [3, 40, 130, 300, 513, 900]


@pytest.fixture(scope="session")
def logdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-logs")


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def reference(model, logdir) -> dict:
    """Greedy outputs of a plain (not disaggregated) server for every prompt the tests send; the server is
    stopped before any prefill/decode pair starts (two cores, little memory)."""
    return plain_outputs("plain", model, logdir, prompts_of(LENGTHS) + prompts_of(CONCURRENT, seed=2))


@pytest.fixture(scope="module", params=["kvconnect-mooncake", "kvconnect-nixl"])
def pd(request, model, logdir, reference):
    """A prefill/decode pair with one kvconnect backend behind the router, shared by a module's tests."""
    pair = PDSet(model, logdir, request.param, env={"KVCONNECT_SGLANG_PAGE_DIGESTS": "1"})
    yield pair
    pair.stop()
