"""What the router does to a client's request body: refuse what P/D cannot serve, and cut the
prefill half (one token, no stream, a request for transfer params)."""

from __future__ import annotations

from typing import Any

from kvconnect.proxy.config import CHAT
from kvconnect.proxy.errors import ProxyError


def check_request(body: Any) -> dict[str, Any]:
    """Refuse what P/D routing cannot serve before any instance is bothered."""
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", "invalid_request_error")
    for key in ("n", "best_of"):
        if body.get(key, 1) not in (1, None):
            raise ProxyError(400, f"{key} > 1 is not supported by P/D routing", "invalid_request_error")
    if not isinstance(body.get("stream", False), bool):
        raise ProxyError(400, "stream must be a boolean", "invalid_request_error")
    return body


def prefill_body(body: dict[str, Any], route: str) -> dict[str, Any]:
    """The request as prefill sees it: one token, no stream, and a request for transfer params."""
    pre = dict(body)
    pre["stream"] = False
    pre.pop("stream_options", None)
    pre.pop("min_tokens", None)
    pre["max_tokens"] = 1
    if route == CHAT and "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    pre["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return pre


def snippet(content: bytes, limit: int = 300) -> str:
    """The start of an upstream answer, for an error message."""
    text = content[:limit].decode("utf-8", "replace").strip()
    return text + ("..." if len(content) > limit else "")
