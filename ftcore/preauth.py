"""Connections that have not shown a token yet, kept apart from those being served: a short
deadline and a small pool per remote address, so sockets that never authenticate (a flood of
idle ones) cannot hold the slots a heal fetch or a rank's line needs. Used by the heal server
and the relay; the caller closes what this tells it to."""

from __future__ import annotations

from typing import Generic, TypeVar

PREAUTH_S = 1.0  # a new connection must deliver its request line and token within this
# Connections from one address that may be waiting to do so at once. Past it the oldest makes
# way: real clients send their request as they connect, so the oldest is the likeliest idle,
# and an idle flood churns itself instead of turning newcomers away.
PER_PEER = 8

C = TypeVar("C")


class PreauthPool(Generic[C]):
    """Per remote address, oldest first: the connections waiting for their token."""

    def __init__(self) -> None:
        self.waiting: dict[str, dict[C, None]] = {}

    def admit(self, peer: str, conn: C, per_peer: int = PER_PEER) -> C | None:
        """Let `conn` wait for its token; returns the connection it displaces (to close), if any."""
        pool = self.waiting.setdefault(peer, {})
        evicted = None
        if len(pool) >= per_peer:
            evicted = next(iter(pool))
            del pool[evicted]
        pool[conn] = None
        return evicted

    def leave(self, peer: str, conn: C) -> bool:
        """`conn` showed its token or closed; True if it was waiting here (not displaced before)."""
        pool = self.waiting.get(peer)
        if pool is None or conn not in pool:
            return False
        del pool[conn]
        if not pool:
            del self.waiting[peer]
        return True
