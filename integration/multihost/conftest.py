"""Fixtures of the multi-host suite: a fresh network namespace pair per session, always removed.

Needs root and iproute2. Without them the suite is skipped with the reason, unless
`KVCONNECT_REQUIRE_MULTIHOST=1` (as `make multihost` sets it), which turns the skip into a failure:
CI must never count a suite that did not run as passed.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import (OWNERS, REPO, IpError, create_pair, namespaces, owner_record,  # noqa: E402
                   remove_namespace, sweep_stale)

sys.path.insert(0, str(REPO / "tests"))  # pd_peer: the caches the conformance suite moves


def unavailable(reason: str) -> None:
    """Skip with `reason`, or fail when KVCONNECT_REQUIRE_MULTIHOST=1 says the suite must run."""
    if os.environ.get("KVCONNECT_REQUIRE_MULTIHOST") == "1":
        pytest.fail(f"multi-host suite required (KVCONNECT_REQUIRE_MULTIHOST=1) but cannot run: {reason}",
                    pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def netns_pair():
    """A fresh namespace pair for this session, always removed afterwards (stale ones swept first)."""
    if not sys.platform.startswith("linux"):
        unavailable(f"network namespaces are Linux only (platform {sys.platform})")
    if os.geteuid() != 0:
        unavailable("creating network namespaces needs root")
    if shutil.which("ip") is None:
        unavailable("iproute2's `ip` command is missing")
    try:
        sweep_stale()
    except IpError as exc:
        unavailable(f"cannot list or remove network namespaces: {exc}")
    suffix = secrets.token_hex(3)
    OWNERS.mkdir(parents=True, exist_ok=True)
    owner = OWNERS / suffix
    # Written before the namespaces exist, so that no concurrent sweep takes them for stale.
    owner.write_text(owner_record())
    created = (f"kcp-{suffix}", f"kcd-{suffix}")
    try:
        try:
            pair = create_pair(suffix)
        except IpError as exc:
            unavailable(f"the kernel or container refused a namespace pair: {exc}")
        yield pair
    finally:
        try:
            present = namespaces()
        except IpError:
            present = list(created)
        for ns in created:
            if ns in present:
                remove_namespace(ns)
        owner.unlink(missing_ok=True)
