"""Every message between a rank and the lighthouse, each one frozen dataclass parsed and
checked once where it arrives; a malformed one is a MessageError naming the field (a 400 at
the lighthouse, a LighthouseError at the client). `quorum_id` numbers one job's quorums;
`lighthouse_id` names one start of a lighthouse. The routes: docs/ftcore.md, "messages"."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from ftcore import timeouts

# Bounds on what a client may send: ids the lighthouse cannot plan for are refused at the door.
DEFAULT_JOB = "default"
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+@=-]{0,127}")
MAX_GROUPS = 1 << 16  # replica groups per job
MAX_WORLD = 1 << 16  # ranks per replica group
MAX_ID = 1 << 53  # steps, incarnations, quorum ids: integers JSON carries exactly
MAX_ADDRESS = 256  # characters of a host:port
MAX_RELAYED = 1024  # ranks one relay speaks for (ftcore/relay.py): its address lists stay under 256 KB
MAX_LIGHTHOUSE_ID = 64
MAX_INT_DIGITS = 20  # a JSON integer longer than this is refused before Python builds it
MAX_EVENT_BYTES = 1024  # an event's values, JSON-encoded (a status of 100 events stays small)

Identity = tuple[tuple[int, int], ...]  # a quorum's members as (group, incarnation), in member order


class MessageError(ValueError):
    """A message that is not what its type says; the text names the field."""


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise MessageError(f"an integer of {len(text)} digits is out of range")
    return int(text)


def _no_constant(name: str) -> Any:
    raise MessageError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_int=_bounded_int, parse_constant=_no_constant)  # one, not one per message


def loads(raw: bytes | str) -> Any:
    """JSON as both ends read it: no NaN/Infinity, no integer past MAX_INT_DIGITS digits
    (an empty body is an empty object)."""
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.decode()  # as json.loads does (UTF-8 here: both ends send it)
    return _DECODER.decode(raw or "{}")


# ---- field checks ----------------------------------------------------------------------------
def _true_or_false(msg: dict[str, Any], key: str) -> bool:
    raw = msg.get(key, False)
    if not isinstance(raw, bool):
        raise MessageError(f"{key} must be true or false, got {raw!r}"[:200])
    return raw


def _int(msg: dict[str, Any], key: str, default: int | None = None, lo: int = 0, hi: int = MAX_ID) -> int:
    """msg[key] as an int in [lo, hi) (an integer, or a string of one)."""
    raw = msg.get(key, default)
    if type(raw) is int and lo <= raw < hi:  # the usual case, first: every message has a dozen
        return raw
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise MessageError(f"{key} must be an integer, got {raw!r}"[:200])
    try:
        value = int(raw)
    except ValueError:
        raise MessageError(f"{key} must be an integer, got {raw!r}"[:200]) from None
    if not lo <= value < hi:
        raise MessageError(f"{key}={value} is outside [{lo}, {hi})")
    return value


def _str(msg: dict[str, Any], key: str, default: str = "", limit: int = MAX_ADDRESS) -> str:
    raw = msg.get(key, default)
    if raw is None:
        return default
    if not isinstance(raw, str) or len(raw) > limit:
        raise MessageError(f"{key} must be a string of at most {limit} characters, got {raw!r}"[:200])
    return raw


def _seconds(msg: dict[str, Any], key: str, default: float | None = None, hi: float = 1e6) -> float:
    raw = msg.get(key, default)
    if isinstance(raw, int) and not isinstance(raw, bool) and abs(raw) >= hi:
        raw = math.inf  # an integer too large for a float is out of range, not an OverflowError
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not (math.isfinite(raw) and 0 <= raw < hi):
        raise MessageError(f"{key} must be a number of seconds in [0, {hi:g}), got {raw!r}"[:200])
    return float(raw)


def _object(body: Any, what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise MessageError(f"{what} must be a JSON object, got {type(body).__name__}")
    return body


def job_id(raw: Any) -> str:
    """A job id as sent (None or "": the default job)."""
    job = raw or DEFAULT_JOB
    if not isinstance(job, str) or not JOB_ID.fullmatch(job):
        raise MessageError(f"job id {job!r} must match {JOB_ID.pattern}"[:300])
    return job


def identity_key(identity: Identity) -> str:
    """A quorum's members as 16 hex digits: what a rank's request names its last quorum by
    (the whole list in every request would cost the lighthouse O(groups^2) per round)."""
    text = ",".join(f"{g}:{i}" for g, i in identity).encode()
    return hashlib.blake2b(text, digest_size=8).hexdigest() if identity else ""


def _groups(raw: Any, key: str) -> tuple[int, ...]:
    if not (isinstance(raw, list) and len(raw) <= MAX_GROUPS):
        raise MessageError(f"{key} must be a list of group ids, got {raw!r}"[:200])
    return tuple(_int({key: g}, key, hi=MAX_GROUPS) for g in raw)


def to_runs(groups: tuple[int, ...]) -> list[list[int]]:
    """Groups as runs of consecutive ids, [first, last + 1) each, in order: a quorum of 1,562
    groups with one missing is three numbers, not 1,561 in every reply (O(groups^2) per round)."""
    runs: list[list[int]] = []
    for g in groups:
        if runs and runs[-1][1] == g:
            runs[-1][1] = g + 1
        else:
            runs.append([g, g + 1])
    return runs


def _from_runs(raw: Any, key: str) -> tuple[int, ...]:
    shape = f"{key} must be a list of [first, end) runs of group ids, got {raw!r}"[:200]
    if not (isinstance(raw, list) and len(raw) <= MAX_GROUPS):
        raise MessageError(shape)
    out: list[int] = []
    for run in raw:
        if not (isinstance(run, list) and len(run) == 2):
            raise MessageError(shape)
        a, b = _int({key: run[0]}, key, hi=MAX_GROUPS), _int({key: run[1]}, key, hi=MAX_GROUPS + 1)
        if not a < b <= a + MAX_GROUPS - len(out):
            raise MessageError(shape)
        out += range(a, b)
    if len(set(out)) != len(out):
        raise MessageError(f"{key} lists a group twice: {raw!r}"[:200])
    return tuple(out)


def aside_of(groups: tuple[int, ...] | list[int], heal: dict[int, int]) -> frozenset[int]:
    """Quorum.aside of these members and heals (the lighthouse names a quorum anew when it changes)."""
    out = frozenset(heal) | frozenset(heal.values())
    return out if len(out) < len(groups) else frozenset()


# ---- what a rank sends -------------------------------------------------------------------------
@dataclass(frozen=True)
class RankInfo:
    """Who a rank is and where it stands. Every message carries it whole, so that a
    restarted lighthouse relearns the job from the next heartbeat."""

    group: int  # this replica group
    rank: int  # k, within the group
    world: int = 1  # K: ranks per group
    incarnation: int = 0  # this start of the group
    job: str = DEFAULT_JOB
    num_groups: int = 0  # R, when the rank knows it (0: not said); describes the job to a new lighthouse
    min_replicas: int = 1  # ... and the fewest groups its quorums need
    step: int = 0  # committed steps
    quorum_id: int = 0  # the last quorum this rank trained in (ids resume above it after a restart)
    store: str = ""  # host:port of this rank's TCPStore (the rendezvous of cross-group groups)
    heal: str = ""  # host:port of this rank's heal server
    # a group's relay (ftcore/relay.py) speaks as rank 0 for all `world` ranks: `store` and
    # `heal` then list the ranks' addresses in rank order, comma-separated
    relay: bool = False

    def addresses(self, field_: str) -> list[str]:
        """A relay's list of rank addresses (one address otherwise)."""
        value: str = getattr(self, field_)
        return value.split(",") if self.relay else [value]

    def to_wire(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "group": self.group,
            "rank": self.rank,
            "world": self.world,
            "incarnation": self.incarnation,
            "num_groups": self.num_groups,
            "min_replicas": self.min_replicas,
            "step": self.step,
            "quorum_id": self.quorum_id,
            "store": self.store,
            "heal": self.heal,
            **({"relay": True} if self.relay else {}),
        }

    @classmethod
    def parse(cls, msg: Any) -> RankInfo:
        """Check every field; `group` must lie within `num_groups` when the rank says it."""
        msg = _object(msg, "a rank's message")
        num_groups = _int(msg, "num_groups", 0, hi=MAX_GROUPS)
        world = _int(msg, "world", 1, lo=1, hi=MAX_WORLD)
        relay = msg.get("relay", False) is True
        if relay and world > MAX_RELAYED:
            raise MessageError(f"a relay speaks for at most {MAX_RELAYED} ranks, this one for world={world}")
        limit = MAX_ADDRESS * world if relay else MAX_ADDRESS
        info = cls(
            group=_int(msg, "group", hi=num_groups or MAX_GROUPS),
            rank=_int(msg, "rank", hi=1 if relay else world),
            world=world,
            incarnation=_int(msg, "incarnation", 0),
            job=job_id(msg.get("job")),
            num_groups=num_groups,
            min_replicas=_int(msg, "min_replicas", 1, hi=MAX_GROUPS),
            step=_int(msg, "step", 0),
            quorum_id=_int(msg, "quorum_id", 0),
            store=_str(msg, "store", limit=limit),
            heal=_str(msg, "heal", limit=limit),
            relay=relay,
        )
        for f in ("store", "heal"):
            listed = getattr(info, f).count(",") + 1
            if relay and getattr(info, f) and listed != world:
                raise MessageError(f"a relay's {f} lists {listed} addresses for world={world}")
        return info


@dataclass(frozen=True)
class Busy:
    """A rank's compute in its last step (start of the step to its entry into FTAR), and the
    quorum it ran in: what fail-slow compares (ftcore/pace.py). From a relay: its slowest
    rank's, with every rank's in rank order (`ranks`), so the slow rank can still be named."""

    quorum_id: int
    seconds: float
    ranks: tuple[float, ...] = ()

    def to_wire(self) -> list[Any]:
        return [self.quorum_id, self.seconds, list(self.ranks)] if self.ranks else [self.quorum_id, self.seconds]

    @classmethod
    def parse(cls, raw: Any) -> Busy | None:
        if raw is None:
            return None
        ranks = raw[2] if isinstance(raw, list) and len(raw) == 3 else []
        try:
            if not (isinstance(raw, list) and len(raw) in (2, 3) and isinstance(ranks, list)):
                raise MessageError("shape")
            if len(ranks) > MAX_RELAYED:
                raise MessageError("too many")
            return cls(
                _int({"quorum_id": raw[0]}, "quorum_id"),
                _seconds({"busy": raw[1]}, "busy"),
                tuple(x if type(x) is float and 0 <= x < 1e6 else _seconds({"busy": x}, "busy") for x in ranks),
            )
        except MessageError:  # the message is built only for a bad one: a relay's has 64 figures
            shape = "busy must be [quorum_id, seconds] or [quorum_id, seconds, [seconds per rank]]"
            raise MessageError(f"{shape}, got {raw!r}"[:200]) from None


@dataclass(frozen=True)
class QuorumRequest:
    """A rank asks for this step's quorum. Besides its `info`: the last quorum it trained in
    (with `info.quorum_id`; a restarted lighthouse hands that quorum out again when every
    member reports the same), its last step's compute, and whether that step went on
    without the lighthouse."""

    info: RankInfo
    quorum_lighthouse_id: str = ""  # the lighthouse that formed the rank's last quorum ("": none yet)
    quorum_key: str = ""  # that quorum's members, as identity_key() names them ("": none yet)
    quorum_settled: bool = False  # ... and whether it was that quorum settled (Quorum.settled)
    busy: Busy | None = None
    idle: int = -1  # the quorum id of its last step if nobody had work in it, else -1
    leased: bool = False  # sent after its step had gone on without the lighthouse: the reply is ignored
    # it may have been given an answer for this step that it did not apply (lost with its
    # connection, or its round had been given up): the lighthouse hands it the same one again
    again: bool = False
    timeout: float = timeouts.QUORUM_TIMEOUT  # seconds the rank waits for the answer

    def to_wire(self) -> dict[str, Any]:
        return {
            **self.info.to_wire(),
            "quorum_lighthouse_id": self.quorum_lighthouse_id,
            "quorum_key": self.quorum_key,
            "quorum_settled": self.quorum_settled,
            "busy": self.busy.to_wire() if self.busy is not None else None,
            "idle": self.idle,
            "leased": self.leased,
            "again": self.again,
            "timeout": self.timeout,
        }

    @classmethod
    def parse(cls, msg: Any) -> QuorumRequest:
        msg = _object(msg, "a quorum request")
        leased, again = _true_or_false(msg, "leased"), _true_or_false(msg, "again")
        timeout = msg.get("timeout", timeouts.QUORUM_TIMEOUT)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (0 < timeout < 1e6 and math.isfinite(timeout))
        ):
            raise MessageError(f"timeout={timeout!r} must be a number of seconds in (0, 1e6)"[:200])
        return cls(
            info=RankInfo.parse(msg),
            quorum_lighthouse_id=_str(msg, "quorum_lighthouse_id", limit=MAX_LIGHTHOUSE_ID),
            quorum_key=_str(msg, "quorum_key", limit=MAX_LIGHTHOUSE_ID),
            quorum_settled=_true_or_false(msg, "quorum_settled"),
            busy=Busy.parse(msg.get("busy")),
            idle=_int(msg, "idle", -1, lo=-1),
            leased=leased,
            again=again,
            timeout=float(timeout),
        )


@dataclass(frozen=True)
class FailureReport:
    """A rank's data plane failed in `quorum_id` (its peers re-form without waiting for a
    heartbeat timeout), or only `stalled`: it made no progress for a while, and the members
    not heard from within the failure probe are failed (a partition closes no connection)."""

    job: str
    group: int
    rank: int
    incarnation: int
    quorum_id: int
    error: str
    stalled: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "group": self.group,
            "rank": self.rank,
            "incarnation": self.incarnation,
            "quorum_id": self.quorum_id,
            "error": self.error,
            "stalled": self.stalled,
        }

    @classmethod
    def parse(cls, msg: Any) -> FailureReport:
        msg = _object(msg, "a failure report")
        return cls(
            job=job_id(msg.get("job")),
            group=_int(msg, "group", hi=MAX_GROUPS),
            rank=_int(msg, "rank", hi=MAX_WORLD),
            incarnation=_int(msg, "incarnation", 0),
            quorum_id=_int(msg, "quorum_id", 0),
            error=str(msg.get("error", ""))[:200],
            stalled=_true_or_false(msg, "stalled"),
        )


@dataclass(frozen=True)
class ClientEvent:
    """Something a rank wants on the lighthouse's event log (heal_started, heal_finished ...):
    a kind and flat values (numbers, strings, lists); anything else is dropped."""

    kind: str
    job: str = DEFAULT_JOB
    data: dict[str, Any] = field(default_factory=dict)

    RESERVED: ClassVar[tuple[str, ...]] = ("t", "kind", "job")

    def to_wire(self) -> dict[str, Any]:
        return {**self.data, "kind": self.kind, "job": self.job}

    @classmethod
    def parse(cls, msg: Any) -> ClientEvent:
        msg = _object(msg, "an event")
        data = {
            str(k)[:64]: v
            for k, v in list(msg.items())[:32]
            if k not in cls.RESERVED and isinstance(v, (int, float, str, list))
        }
        size = len(json.dumps(data))
        if size > MAX_EVENT_BYTES:
            raise MessageError(f"an event's values are {size} bytes of JSON; at most {MAX_EVENT_BYTES}")
        return cls(kind=str(msg.get("kind", "event"))[:64], job=job_id(msg.get("job")), data=data)


# ---- what the lighthouse answers ---------------------------------------------------------------
@dataclass(frozen=True)
class HeartbeatReply:
    quorum_id: int  # the job's current quorum id (a rank in an older one is stale)
    failed: tuple[int, ...] = ()  # members of the current quorum found unhealthy at the last sweep
    silent_s: float = 0.0  # from a relay: how long the lighthouse has not answered it
    beat_s: float = 0.0  # from a loaded lighthouse: beat no more often than this (0: as configured)
    # a member reported the current quorum's exchange failed: nobody can finish it, so a member
    # still waiting in it (or only now reaching its rendezvous) leaves now, not after its timeout
    abandoned: bool = False

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"quorum_id": self.quorum_id, "failed": list(self.failed)}
        if self.silent_s:
            wire["silent_s"] = self.silent_s
        if self.beat_s:
            wire["beat_s"] = self.beat_s
        if self.abandoned:
            wire["abandoned"] = True
        return wire

    @classmethod
    def parse(cls, body: Any) -> HeartbeatReply:
        body = _object(body, "a heartbeat reply")
        failed = _groups(body.get("failed", []), "failed")
        silent, beat = _seconds(body, "silent_s", 0.0), _seconds(body, "beat_s", 0.0, hi=60.0)
        return cls(_int(body, "quorum_id", 0), failed, silent, beat, _true_or_false(body, "abandoned"))


@dataclass(frozen=True)
class Pace:
    """The members' compute in the step they just finished in quorum `quorum_id`: each sees
    its own wait for the slowest (the cross-group straggler time)."""

    quorum_id: int
    slowest_s: float
    mean_s: float

    def to_wire(self) -> list[Any]:
        return [self.quorum_id, self.slowest_s, self.mean_s]

    @classmethod
    def parse(cls, raw: Any) -> Pace | None:
        if raw is None:
            return None
        if not (isinstance(raw, list) and len(raw) == 3):
            raise MessageError(f"pace must be [quorum_id, slowest_s, mean_s], got {raw!r}"[:200])
        return cls(
            _int({"pace": raw[0]}, "pace"), _seconds({"pace": raw[1]}, "pace"), _seconds({"pace": raw[2]}, "pace")
        )


@dataclass(frozen=True)
class Quorum:
    """One round's answer: the members, the step they meet at, who heals from whom. The
    lighthouse encodes the part every rank shares once per round (`shared_json`) and adds
    each rank's two addresses to it (`for_rank`)."""

    quorum_id: int
    lighthouse_id: str  # the lighthouse that formed it (a store prefix per lighthouse start)
    job: str
    identity: Identity  # (group, incarnation) of every member (the lighthouse's; a rank knows its key)
    groups: tuple[int, ...]  # the members, in order (rank order of the cross-group group)
    max_step: int  # the step every member is at after this round's heals
    heal: dict[int, int]  # healing group -> the group it heals from
    lease_s: float  # how long the members may go on in it while the lighthouse is silent
    pace: Pace | None = None
    store: str = ""  # this rank's rendezvous: rank k of the first member hosts rank k's
    heal_from: str = ""  # this rank's heal source: rank k of its source group
    update_from: str = ""  # an aside member rank's: rank k of the exchange's first member serves the average
    # identity_key(identity): what the wire carries, not the identity (13-digit incarnations of
    # every member in every reply would be most of a round's bytes at a thousand groups)
    members_key: str = ""
    # a heal quorum with members aside, its heals done: every member in one exchange at its
    # rendezvous. What a lease goes on in after a heal step, and what the lighthouse forms next
    # with the same members: one rendezvous for both, whoever missed the lighthouse's answer
    settled: bool = False

    status: ClassVar[int] = 200

    def __post_init__(self) -> None:
        if self.identity and not self.members_key:
            object.__setattr__(self, "members_key", identity_key(self.identity))

    def aside(self) -> frozenset[int]:
        """Healing groups and their sources: out of the step's FTAR (neither can stall it), they fetch
        its average (`update_from`); none when nobody else is left (the healer then sends zeros)."""
        return aside_of(self.groups, self.heal)

    def exchange(self) -> tuple[int, ...]:
        """The members in this step's FTAR, in rank order of its process group."""
        aside = self.aside()
        return tuple(g for g in self.groups if g not in aside)

    def live(self) -> set[int]:
        """The members that train this step (those in the exchange, but a healing group)."""
        return set(self.exchange()) - self.heal.keys()

    @property
    def key(self) -> tuple[str, int, bool]:
        """What names its cross-group process group: a new key, a new group."""
        return self.lighthouse_id, self.quorum_id, self.settled

    def settle(self) -> Quorum:
        """The same members once its heals are done: every one in the exchange, on a process
        group of its own at the same rendezvous (`store`, rank k of the old exchange's first
        member, a member still). With nobody aside, its exchange already held every member:
        the same process group goes on (the same key). What a lease goes on in after a heal
        step (manager.py), and what the lighthouse forms next with the same members."""
        if not self.heal:
            return self
        return replace(self, heal={}, heal_from="", update_from="", settled=bool(self.aside()))

    def shared(self) -> dict[str, Any]:
        """The part of the reply every rank of every member shares (GET /status shows it)."""
        return {
            "quorum_id": self.quorum_id,
            "lighthouse_id": self.lighthouse_id,
            "job": self.job,
            "members_key": self.members_key,
            **({"settled": True} if self.settled else {}),
            "groups": list(self.groups),
            "max_step": self.max_step,
            "heal": {str(g): s for g, s in self.heal.items()},
            "lease_s": self.lease_s,
            "pace": self.pace.to_wire() if self.pace is not None else None,
        }

    def shared_json(self) -> str:
        """`shared()` as the wire has it (the members as runs, `to_runs`), as JSON text lacking
        its closing brace: `for_rank` completes it."""
        return json.dumps({**self.shared(), "groups": to_runs(self.groups)})[:-1]

    @staticmethod
    def for_rank(shared_json: str, store: str, heal_from: str, update_from: str = "") -> str:
        """One rank's reply: the shared part and its own addresses (`store`, `heal_from`, `update_from`)."""
        own = f'"store": {json.dumps(store)}, "heal_from": {json.dumps(heal_from)}'
        return f'{shared_json}, {own}, "update_from": {json.dumps(update_from)}}}'

    @classmethod
    def parse(cls, body: Any) -> Quorum:
        body = _object(body, "a quorum")
        groups = _from_runs(body.get("groups"), "groups")
        if not groups:
            raise MessageError("groups is empty: a quorum has members")
        raw_heal = body.get("heal")
        if not isinstance(raw_heal, dict):
            raise MessageError(f"heal must be an object of group -> source, got {raw_heal!r}"[:200])
        heal = {
            _int({"heal": g}, "heal", hi=MAX_GROUPS): _int({"heal": s}, "heal", hi=MAX_GROUPS)
            for g, s in raw_heal.items()
        }
        strays = sorted({*heal, *heal.values()} - set(groups))
        if strays:
            raise MessageError(f"heal names groups {strays} that are not members {list(groups)}")
        members_key = _str(body, "members_key", limit=MAX_LIGHTHOUSE_ID)
        if not members_key:
            raise MessageError("members_key is missing")
        lighthouse_id = _str(body, "lighthouse_id", limit=MAX_LIGHTHOUSE_ID)
        if not lighthouse_id:
            raise MessageError("lighthouse_id is missing")
        return cls(
            quorum_id=_int(body, "quorum_id"),
            lighthouse_id=lighthouse_id,
            job=job_id(body.get("job")),
            identity=(),
            groups=groups,
            max_step=_int(body, "max_step"),
            heal=heal,
            lease_s=_seconds(body, "lease_s", 0.0),
            pace=Pace.parse(body.get("pace")),
            store=_str(body, "store", limit=MAX_ADDRESS * MAX_RELAYED),
            heal_from=_str(body, "heal_from", limit=MAX_ADDRESS * MAX_RELAYED),
            update_from=_str(body, "update_from", limit=MAX_ADDRESS * MAX_RELAYED),
            members_key=members_key,
            settled=_true_or_false(body, "settled"),
        )
