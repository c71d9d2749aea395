"""Moved: the side channel lives in `kvconnect.sidechannel` (server, client, auth, addresses)."""

raise ImportError(
    "kvconnect.handshake was split into kvconnect.sidechannel: HandshakeServer is now "
    "kvconnect.sidechannel.SideChannelServer (with metadata_handler(provider, control)), send_control is "
    "kvconnect.sidechannel.call, fetch_metadata and resolve_secret keep their names there"
)
