"""Fail-slow: notice a replica group that is consistently slower than its peers.

Synchronous steps run at the pace of the slowest group. FT-HSDP's analyzer finds
fail-slow members by comparing completion times; here every rank reports, with its next
quorum request, how long its last step took from the start of the step to its entry into
the FTAR (its compute: the all-reduce itself ends at the same time for everyone, so only
this part tells groups apart). The lighthouse feeds one figure per group and round (its
slowest rank's) to `PaceJudge`, which keeps each group's ratio to the median of its peers
over a window of rounds.

A group is judged slow when the median of its last `window` ratios reaches `ratio`, and
leaving it out pays: R groups at the slow group's pace commit R/(f*T) batches a second,
R-1 groups at their own pace (R-1)/T, so exclusion needs f > R/(R-1) (2x for 2 groups,
1.5x for 3), with a 10% margin. The default ratio is 2 because the data stays exactly
once: the batches an excluded group misses are made up later by that group (ftcore/
schedule.py), so the job's wall time gains only from a group more than twice as slow, or
from one that recovers or is replaced before its make-up. Excess below `min_excess_s`
never counts (a step of a few milliseconds is all overhead). The judge never excludes
below `min_replicas` groups or more than half of the job, one group at a time.

An excluded group is held on standby for a probation that doubles each time the same
incarnation is excluded again; then it rejoins through a heal and is measured afresh, or sooner when the only work left
is its own make-up (a round in which no member had work). A replaced group (new
incarnation) starts with a clean record.
"""

import collections
import os
import statistics
from dataclasses import dataclass, field


def _env(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"ftcore: environment variable {name}={raw!r} is not a number") from None


@dataclass
class PacePolicy:
    ratio: float = _env("FTCORE_SLOW_RATIO", 2.0)  # 0: the fail-slow policy is off
    window: int = int(_env("FTCORE_SLOW_WINDOW", 20))  # rounds a group must stay slow
    probation_s: float = _env("FTCORE_SLOW_PROBATION", 30.0)  # first standby; doubles per repeat
    min_excess_s: float = _env("FTCORE_SLOW_MIN_EXCESS", 0.005)  # slower by less than this: not slow
    max_probation_s: float = 600.0

    def check(self) -> "PacePolicy":
        if self.ratio < 0 or self.window < 1 or self.probation_s <= 0 or self.min_excess_s < 0:
            raise ValueError(
                f"fail-slow policy: ratio >= 0 (0: off), window >= 1, probation > 0, min excess >= 0 (got {self})"
            )
        return self


@dataclass
class Verdict:
    group: int
    ratio: float  # median ratio to its peers over the window
    busy_s: float  # its median busy time over the window
    probation_s: float


@dataclass
class PaceJudge:
    policy: PacePolicy
    ratios: dict[int, collections.deque] = field(default_factory=dict)
    busy: dict[int, collections.deque] = field(default_factory=dict)
    strikes: dict[tuple[int, int], int] = field(default_factory=dict)  # (group, incarnation) -> exclusions

    def observe(self, busy: dict[int, float]) -> None:
        """One round: each member's busy seconds in the step it just finished (all in one quorum)."""
        if self.policy.ratio <= 0 or len(busy) < 2:
            return
        for g, b in busy.items():
            ref = statistics.median(v for h, v in busy.items() if h != g)
            slow = b - ref >= self.policy.min_excess_s and ref > 0
            self.ratios.setdefault(g, collections.deque(maxlen=self.policy.window)).append(b / ref if slow else 1.0)
            self.busy.setdefault(g, collections.deque(maxlen=self.policy.window)).append(b)

    def forget(self, g: int) -> None:
        self.ratios.pop(g, None)
        self.busy.pop(g, None)

    def judge(
        self, members: list[int], incarnations: dict[int, int], min_replicas: int, excluded: int
    ) -> Verdict | None:
        """The member to exclude now, if any (`excluded`: groups of the job already on standby)."""
        n = len(members)
        if self.policy.ratio <= 0 or n < 2 or n - 1 < min_replicas or 2 * (excluded + 1) > n + excluded:
            return None
        need = max(self.policy.ratio, 1.1 * n / (n - 1))
        worst = None
        for g in members:
            hist = self.ratios.get(g)
            if hist is None or len(hist) < self.policy.window:
                continue
            r = statistics.median(hist)
            if r >= need and (worst is None or r > worst[1]):
                worst = (g, r)
        if worst is None:
            return None
        g, r = worst
        key = (g, incarnations[g])
        self.strikes[key] = self.strikes.get(key, 0) + 1
        probation = min(self.policy.probation_s * 2 ** (self.strikes[key] - 1), self.policy.max_probation_s)
        verdict = Verdict(g, round(r, 3), round(statistics.median(self.busy[g]), 4), probation)
        self.forget(g)
        return verdict
