"""The lighthouse's answers to a quorum request besides a quorum (ftcore.messages.Quorum): a
standby for a slow group, a leased round overtaken, and the refusals with their HTTP statuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ftcore.messages import MessageError, Quorum, _int, _object, _seconds


@dataclass(frozen=True)
class StandbyReply:
    """This group is held out of the quorum as slower than its peers: ask again after
    `retry_s` (it is alive, and rejoins through a heal)."""

    retry_s: float
    reason: str

    status: ClassVar[int] = 200

    def to_wire(self) -> dict[str, Any]:
        return {"standby": True, "retry_s": self.retry_s, "reason": self.reason}

    @classmethod
    def parse(cls, body: dict[str, Any]) -> StandbyReply:
        return cls(max(0.01, min(_seconds(body, "retry_s", 1.0), 5.0)), str(body.get("reason", "standby"))[:500])


@dataclass(frozen=True)
class OvertakenReply:
    """A leased round's late request: a peer already asks for `step` (the sender has moved on
    without this answer and asks again in its current round)."""

    step: int

    status: ClassVar[int] = 200

    def to_wire(self) -> dict[str, Any]:
        return {"overtaken": True, "step": self.step}

    @classmethod
    def parse(cls, body: dict[str, Any]) -> OvertakenReply:
        return cls(_int(body, "step", 0))


REFUSALS = {"stale": 409, "lost": 410, "finished": 410, "timeout": 504, "superseded": 504}


@dataclass(frozen=True)
class QuorumRefused:
    """No quorum for this request. `reason`: "stale" (the group incarnation was replaced:
    exit), "lost" (the group lost a rank: exit so that it restarts whole), "finished" (the
    job ended before the group could rejoin: exit cleanly), "timeout" or "superseded" (the
    same rank asked again): ask again."""

    reason: str
    error: str

    def __post_init__(self) -> None:
        if self.reason not in REFUSALS:
            raise MessageError(f"reason {self.reason!r} is not one of {sorted(REFUSALS)}")

    @property
    def status(self) -> int:
        return REFUSALS[self.reason]

    def to_wire(self) -> dict[str, Any]:
        flag = {"lost": True} if self.reason == "lost" else {"finished": True} if self.reason == "finished" else {}
        return {"error": self.error, **flag}

    @classmethod
    def parse(cls, status: int, body: Any) -> QuorumRefused:
        """A refusal from its status and body (a body that is not an object is its error text)."""
        msg = body if isinstance(body, dict) else {"error": str(body)}
        error = str(msg.get("error", ""))[:500]
        if status == 409:
            return cls("stale", error)
        if status == 410:
            return cls("finished" if msg.get("finished") else "lost", error)
        return cls("superseded" if "superseded" in error else "timeout", error)


QuorumAnswer = Quorum | StandbyReply | OvertakenReply


def parse_quorum_answer(body: Any) -> QuorumAnswer:
    """A 200 answer to a quorum request: a quorum, a standby or an overtaken round."""
    body = _object(body, "a quorum answer")
    if body.get("overtaken"):
        return OvertakenReply.parse(body)
    if body.get("standby"):
        return StandbyReply.parse(body)
    return Quorum.parse(body)
