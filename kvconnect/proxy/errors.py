"""The router's one error type: a request that ends with an error status and an OpenAI-style body."""

from __future__ import annotations

from typing import Any


class ProxyError(Exception):
    """A request that ends with an error status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "proxy_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}
