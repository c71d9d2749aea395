"""SGLang's deferred decode KV release, which kvconnect's decode depends on.

When SGLang aborts or fails a request whose pages a kvconnect READ may still be writing, it frees
those pages at once unless the backend opts into its deferred release: the request's pages are then
held until the backend says nothing more can land in them (`is_abort_release_safe`), or until
`SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT` passes, after which SGLang frees them
regardless. kvconnect says so once its load ended (`KVConnector.get_finished()` reports it failed
only when the transport says no byte can still land), so the deferral must be on, and its timeout no
shorter than kvconnect's load deadline: by then kvconnect has cancelled the READ. Unless the operator
sets the load deadline, it is chosen to end well inside SGLang's timeout, so that SGLang's defaults work.
"""

from __future__ import annotations

from kvconnect.errors import KVConnectError

SWITCH = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
TIMEOUT = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
LOAD_TIMEOUT = "KVCONNECT_SGLANG_LOAD_TIMEOUT_S"
# A default load deadline ends by this share of SGLang's timeout: the rest is for a cancelled READ to return.
_SHARE = 0.8


def problem(enabled: bool, timeout_s: float, load_timeout_s: float) -> str | None:
    """Why these settings would let SGLang reuse pages a kvconnect READ can still write (None: they do not)."""
    if not enabled:
        return (f"{SWITCH} is off: SGLang would hand an aborted request's pages to another request while its "
                f"kvconnect READ can still land in them; leave it unset or set it to 1")
    if not timeout_s >= load_timeout_s:
        return (f"{TIMEOUT}={timeout_s:g} is shorter than {LOAD_TIMEOUT}={load_timeout_s:g}: SGLang would free an "
                f"aborted request's pages before kvconnect's load deadline; set {TIMEOUT} to at least "
                f"{load_timeout_s:g} (with a margin, e.g. {load_timeout_s + 30:g}) or lower {LOAD_TIMEOUT}")
    return None


def load_timeout(configured_s: float, explicit: bool, timeout_s: float) -> float:
    """The decode's load deadline: the operator's, else the default cut to end well inside SGLang's timeout."""
    return configured_s if explicit or not timeout_s > 0 else min(configured_s, _SHARE * timeout_s)


def check(enabled: bool, load_timeout_s: float, explicit: bool) -> float:
    """The decode's load deadline; KVConnectError where SGLang's settings could free pages under a READ."""
    from sglang.srt.environ import envs

    timeout_s = float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get())
    load_timeout_s = load_timeout(load_timeout_s, explicit, timeout_s)
    why = problem(enabled, timeout_s, load_timeout_s)
    if why is not None:
        raise KVConnectError(f"kvconnect sglang decode: {why}")
    return load_timeout_s
