"""The remote agents one NIXL agent has loaded, counted by the peer ids that use each.

NIXL keeps one entry per agent name and loads the same metadata again without complaint (a different
blob under a known name is refused), so two peer ids that present one agent (a listener replaying a
producer's metadata, say) share the entry: neither can remove it from under the other.
"""

from __future__ import annotations

from kvconnect.transport.nixl_errors import nixl_errors, quietly


class RemoteAgents:
    """Loads a peer's agent once, and removes it when the last peer id using it lets go."""

    def __init__(self, agent: object, own_name: str):
        self._agent = agent
        self._own = own_name
        self._users: dict[str, int] = {}

    def load(self, peer_id: str, metadata: bytes) -> str:
        """The NIXL agent name of a peer's metadata, counted once more (RemoteRejected if NIXL refuses it)."""
        if bytes(metadata) == bytes(self._agent.get_agent_metadata()):
            name = self._own  # loopback: NIXL addresses its own memory by its own name
        else:
            with nixl_errors(f"refused the metadata of peer {peer_id}"):
                loaded = self._agent.add_remote_agent(metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._users[name] = self._users.get(name, 0) + 1
        return name

    def unload(self, name: str) -> None:
        """One peer id less uses `name`; the last one removes it from NIXL (a failure is logged)."""
        left = self._users.get(name, 1) - 1
        if left > 0:
            self._users[name] = left
            return
        self._users.pop(name, None)
        if name != self._own:
            quietly(f"removing agent {name}", self._agent.remove_remote_agent, name)
