"""The side channel: a small ZMQ request/reply channel between workers, beside the data plane.

It carries the metadata handshake (engine metadata, regions, transport blobs) and the lease control
messages of P/D (claim, heartbeat, done, abort), all msgspec structs from `kvconnect.wire`, with
optional HMAC authentication. `server` is the listener, `client` the callers, `auth` the secret and
MACs, `addresses` the bind rules shared with the connector and the router.
"""

from kvconnect.sidechannel.auth import SECRET_ENV, resolve_secret
from kvconnect.sidechannel.client import Target, call, call_many, fetch_metadata
from kvconnect.sidechannel.server import DROP_REASONS, Handler, Refusal, SideChannelServer, metadata_handler

__all__ = [
    "DROP_REASONS",
    "SECRET_ENV",
    "Handler",
    "Refusal",
    "SideChannelServer",
    "Target",
    "call",
    "call_many",
    "fetch_metadata",
    "metadata_handler",
    "resolve_secret",
]
