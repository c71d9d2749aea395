import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import make_llama, telling_lines  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries what its engines logged of kvconnect and of errors meanwhile."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when != "teardown":
        for name, text in telling_lines(since=call.start - 1.0):
            report.sections.append((f"engine log {name}", text))
