"""The lighthouse's own pulse, shared by every job it serves: which start of the lighthouse this
is (`lighthouse_id`), its own pauses (after one it grants every rank a heartbeat timeout to be
heard again), and the heartbeat pace it asks of every speaker with the failure probe that pace
allows."""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable

from ftcore import timeouts
from ftcore.lighthouse_config import LighthouseConfig
from ftcore.quorum import heartbeat_pace, probe_window


class Pulse:
    def __init__(self, cfg: LighthouseConfig, event: Callable[..., None]):
        self.cfg, self._event = cfg, event
        # this start of the lighthouse (ftcore/messages.py): store prefixes differ across restarts
        self.lighthouse_id = secrets.token_hex(4)
        self._lock = threading.Lock()
        self.alive_at = time.monotonic()  # the last time this process was seen running
        self.grace_until = 0.0  # after a pause: silence is not judged before this
        self.beat_s = 0.0  # the heartbeat pace asked of every speaker (0: their own)
        self.probe_s = cfg.failure_probe  # how long a failure probe waits to hear a member (as paced)
        # up to when its server has read every message that arrived (serve() wires the server's)
        self.read_until: Callable[[], float] = lambda: math.inf

    def notice_pause(self, now: float) -> None:
        """Called by the ticker every tick and before every health sweep: a gap far longer than
        a tick means this process was stopped (SIGSTOP, a frozen VM, a long GC) and heard nobody
        meanwhile, so it grants every rank a heartbeat timeout to be heard again."""
        with self._lock:
            gap = now - self.alive_at
            self.alive_at = max(self.alive_at, now)
            if gap > timeouts.PAUSE_JUMP and self.cfg.pause_grace:
                self.grace_until = now + self.cfg.heartbeat_timeout
                self._event("lighthouse_paused", seconds=round(gap, 3), grace_s=self.cfg.heartbeat_timeout)

    def in_grace(self, now: float) -> bool:
        return now < self.grace_until

    def judged_at(self, now: float) -> float:
        """The moment silence is judged as of: `now`, or earlier while the server reads late (a
        beat waiting unread in its sockets is not its sender's silence). Verdicts come as much
        later as it is behind; none is held while it stays behind (a real hang is still failed)."""
        return min(now, self.read_until())

    def pace(self, speakers: int) -> None:
        """Ask for slower heartbeats when their speakers would exceed the budget; the probe
        allows the slower of this pace and the last (a speaker adopts a new pace with its next beat)."""
        was, self.beat_s = self.beat_s, heartbeat_pace(speakers, self.cfg.heartbeat_budget, self.cfg.heartbeat_timeout)
        self.probe_s = probe_window(self.cfg.failure_probe, max(was, self.beat_s))
