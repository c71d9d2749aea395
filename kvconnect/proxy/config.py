"""What the router is told (its command line as a value) and the routes it serves."""

from __future__ import annotations

from dataclasses import dataclass

COMPLETIONS = "/v1/completions"
MODELS = "/v1/models"
CHAT = "/v1/chat/completions"
# Headers passed on to both instances: the client's credentials for vLLM's --api-key, and a request id
# so that the prefill and decode halves of one request can be found in both logs.
FORWARDED_HEADERS = ("authorization", "x-request-id")


@dataclass
class ProxyConfig:
    """Everything `kvconnect proxy` takes from its command line."""

    prefill: list[str]
    decode: list[str]
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    health_interval_s: float = 5.0
    max_body_bytes: int = 16 << 20
    max_connections: int = 512
    mode: str = "pull"  # "push": prefill and decode get the request at once (see kvconnect.proxy.push)

    def __post_init__(self) -> None:
        if self.mode not in ("pull", "push"):
            raise ValueError(f"mode must be pull or push, got {self.mode!r}")
        for name in ("connect_timeout_s", "request_timeout_s", "health_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.max_body_bytes <= 0 or self.max_connections <= 0:
            raise ValueError("max_body_bytes and max_connections must be positive")
