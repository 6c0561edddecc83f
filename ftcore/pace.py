"""Fail-slow: hold out a replica group while the job commits more batches a second without it.
Each rank reports its last step's compute with its next quorum request; a group is excluded
when its ratio to its peers, time-weighted over a window of at least `window` rounds and
`span_s` seconds, reaches R/(R-1) with a margin (`PacePolicy.bound`), also with its worst round
left out; never below `min_replicas` or more than half of the job. Every group settles before it
is measured (its first rounds, after a restart, back from standby): start-up is not slowness,
and a burst of load on a shared machine is diluted by the span. An excluded group waits a
probation that doubles per repeat and rejoins by heal. The rules in full: docs/ftcore.md, "pace"."""

import bisect
import collections
import statistics
from dataclasses import dataclass, field

from ftcore.environment import number, text
from ftcore.settings import setting


def _ratio_env() -> float | None:
    """FTCORE_SLOW_RATIO: unset or empty -> None (the bound from R alone)."""
    return number("FTCORE_SLOW_RATIO", 0.0) if text("FTCORE_SLOW_RATIO") else None


@dataclass
class PacePolicy:
    """The fail-slow rule's settings (a table: ftcore/settings.py); the lighthouse's --slow-*
    flags set the first three."""

    ratio: float | None = setting(
        _ratio_env(),
        "fail-slow: exclude a group only from this many times its peers' compute (unset: R/(R-1) x 1.1 "
        "for R groups, which it never goes below; 0: never; FTCORE_SLOW_RATIO)",
        flag="--slow-ratio",
        kind=float,
        at_least=0,
    )
    window: int = setting(
        int(number("FTCORE_SLOW_WINDOW", 40)),
        "... measured over this many rounds, time-weighted (FTCORE_SLOW_WINDOW)",
        flag="--slow-window",
        at_least=1,
    )
    probation_s: float = setting(
        number("FTCORE_SLOW_PROBATION", 30.0),
        "seconds an excluded group waits before it may rejoin; doubles each time (FTCORE_SLOW_PROBATION)",
        flag="--slow-probation",
        above=0,
    )
    min_excess_s: float = number("FTCORE_SLOW_MIN_EXCESS", 0.005)  # slower by less than this: not slow
    max_probation_s: float = 600.0
    margin: float = 1.1  # over R/(R-1)
    # rounds a group is not measured: its first (start-up, a restart) and its first back from standby
    settle: int = int(number("FTCORE_SLOW_SETTLE", 20))
    # the window spans at least this much of the job's time too (fast steps: more rounds)
    span_s: float = number("FTCORE_SLOW_SPAN", 3.0)
    most_rounds: int = 1024  # ... but holds no more rounds than this (memory), and judges at it

    @property
    def off(self) -> bool:
        return self.ratio == 0

    def bound(self, n: int) -> float:
        """The ratio s at which one of n members is excluded: n groups at its pace s*T commit
        n/(sT) batches a second, the others alone (n-1)/T. The make-up (ftcore/schedule.py: the
        data stays exactly once, so it trains each missed batch later, one a step while its peers
        send zeros) leaves this bound for the pace while it is slow, but over the whole run
        exclusion gains only when s > 2 and it recovered by its make-up: a ratio of 2 keeps that
        stricter bound. A ratio only raises the bound. s compares compute without the exchange
        (the same wait for all), so it overstates a step's ratio when the exchange is a large part."""
        return max(self.ratio or 0.0, self.margin * n / (n - 1))

    def check(self) -> "PacePolicy":
        ratio_ok = self.ratio is None or self.ratio >= 0
        if not ratio_ok or self.window < 1 or self.probation_s <= 0 or self.min_excess_s < 0:
            raise ValueError(
                "fail-slow policy: ratio >= 0 (0: off, unset: R/(R-1) with a margin), window >= 1, "
                f"probation > 0, min excess >= 0 (got {self})"
            )
        if self.margin < 1 or self.settle < 0 or self.span_s < 0 or self.most_rounds < self.window:
            raise ValueError(
                f"fail-slow policy: margin >= 1, settle >= 0, span >= 0 and window <= most rounds (got {self})"
            )
        return self


@dataclass
class Verdict:
    group: int
    ratio: float  # its compute over its peers' median, summed over the window
    bound: float  # the ratio it reached (PacePolicy.bound)
    busy_s: float  # its mean compute per round over the window
    peers_s: float  # its peers' median compute, mean per round
    probation_s: float
    rank: int | None = None  # its slow rank; None: not known (one figure for the group) or ranks alike
    rank_busy_s: float | None = None  # that rank's mean compute per round (the slowest rank's if none named)
    others_busy_s: float | None = None  # the median of the group's other ranks' means

    def event(self, window: int) -> dict:
        """The fields of its `group_excluded` event (rank None: one figure, or ranks alike)."""
        return {
            "group": self.group,
            "reason": f"{self.ratio}x its peers' compute over {window} rounds, bound {self.bound}x",
            "ratio": self.ratio,
            "bound": self.bound,
            "busy_s": self.busy_s,
            "peers_busy_s": self.peers_s,
            "window": window,
            "probation_s": self.probation_s,
            "rank": self.rank,
            "rank_busy_s": self.rank_busy_s,
            "other_ranks_busy_s": self.others_busy_s,
        }


# one round's figures of a group's ranks: by rank, or every rank's in rank order (a relay's)
Figures = dict[int, float] | tuple[float, ...]


def median_without(ordered: list[float], value: float) -> float:
    """The median of sorted `ordered` with one `value` left out (any of equal ones: the rest is
    the same), in O(log n): every member's peers' median in one sort, not one sort each."""
    p = bisect.bisect_left(ordered, value)
    m = len(ordered) - 1

    def other(j: int) -> float:  # the j-th of the others, in order
        return ordered[j if j < p else j + 1]

    return other(m // 2) if m % 2 else (other(m // 2 - 1) + other(m // 2)) / 2


@dataclass
class PaceJudge:
    policy: PacePolicy
    # group -> (its figure, its peers' median, when) per measured round, over its window
    rounds: dict[int, collections.deque] = field(default_factory=dict)
    # group -> {rank: figure} per measured round ({}: no per-rank figures, a relayed group)
    ranks: dict[int, collections.deque] = field(default_factory=dict)
    settling: dict[int, int] = field(default_factory=dict)  # group -> rounds left unmeasured
    strikes: dict[tuple[int, int], int] = field(default_factory=dict)  # (group, incarnation) -> exclusions
    # group -> running sums over its window of (its counted figure, its peers' median): a round
    # tests every member in O(1) and computes `slowness` only for one that may be slow
    sums: dict[int, list[float]] = field(default_factory=dict)

    def observe(self, busy: dict[int, float], ranks: dict[int, Figures] | None = None, *, at: float) -> None:
        """One round, formed at monotonic time `at`: each member's busy seconds in the step it
        just finished (all in one quorum), and where known each of its ranks' figures."""
        if self.policy.off or len(busy) < 2:
            return
        w, ordered = self.policy.window, sorted(busy.values())
        for g, b in busy.items():
            if g not in self.rounds:
                self.settling.setdefault(g, self.policy.settle)  # first seen: start-up is not slowness
            if self.settling.get(g, 0) > 0:
                self.settling[g] -= 1
                continue
            ref = median_without(ordered, b)
            hist = self.rounds.setdefault(g, collections.deque())
            sums = self.sums.setdefault(g, [0.0, 0.0])
            hist.append((b, ref, at))
            sums[0] += self._counted(b, ref)
            sums[1] += ref
            while len(hist) > w and (len(hist) > self.policy.most_rounds or at - hist[1][2] >= self.policy.span_s):
                old = hist.popleft()  # the window keeps `window` rounds over `span_s` seconds
                sums[0] -= self._counted(old[0], old[1])
                sums[1] -= old[1]
            self.ranks.setdefault(g, collections.deque(maxlen=w)).append((ranks or {}).get(g, {}))  # never changed

    def _full(self, hist: collections.deque | None) -> bool:
        """A window to judge by: `window` rounds over `span_s` seconds (or `most_rounds`)."""
        p = self.policy
        return (
            hist is not None
            and len(hist) >= p.window
            and (hist[-1][2] - hist[0][2] >= p.span_s or len(hist) >= p.most_rounds)
        )

    def _counted(self, b: float, ref: float) -> float:
        """A round's figure as slowness counts it: its peers' when it exceeds them by less than
        min_excess_s (noise)."""
        return b if b - ref >= self.policy.min_excess_s else ref

    def forget(self, g: int) -> None:
        self.rounds.pop(g, None)
        self.ranks.pop(g, None)
        self.sums.pop(g, None)

    def readmit(self, g: int) -> None:
        """A group back from standby, or restarted: measured afresh after `settle` rounds."""
        self.forget(g)
        self.settling[g] = self.policy.settle

    def slowness(self, g: int) -> tuple[float, float] | None:
        """(s over the window, s with its worst round left out); None before a full window."""
        hist = self.rounds.get(g)
        if hist is None or not self._full(hist):
            return None
        seen = [(self._counted(b, ref), ref) for b, ref, _ in hist]
        total, ref_total = sum(s for s, _ in seen), sum(r for _, r in seen)
        worst, worst_ref = max(seen, key=lambda x: x[0] - x[1])
        if ref_total - worst_ref <= 0:
            return None
        return total / ref_total, (total - worst) / (ref_total - worst_ref)

    def judge(
        self, members: list[int], incarnations: dict[int, int], min_replicas: int, excluded: int
    ) -> Verdict | None:
        """The member to exclude now, if any (`excluded`: groups of the job already on standby)."""
        n = len(members)
        if self.policy.off or n < 2 or n - 1 < min_replicas or 2 * (excluded + 1) > n + excluded:
            return None
        need = self.policy.bound(n)
        worst = None
        for g in members:
            sums = self.sums.get(g)
            # s over the window must reach the bound (with room for the running sums' rounding)
            if sums is None or not self._full(self.rounds[g]) or sums[0] < 0.999 * need * sums[1]:
                continue
            s = self.slowness(g)
            if s is not None and min(s) >= need and (worst is None or s[0] > worst[1]):
                worst = (g, s[0])
        if worst is None:
            return None
        g, ratio = worst
        key = (g, incarnations[g])
        self.strikes[key] = self.strikes.get(key, 0) + 1
        probation = min(self.policy.probation_s * 2 ** (self.strikes[key] - 1), self.policy.max_probation_s)
        hist = self.rounds[g]
        verdict = Verdict(
            g,
            round(ratio, 3),
            round(need, 3),
            round(statistics.fmean(b for b, _, _ in hist), 4),
            round(statistics.fmean(r for _, r, _ in hist), 4),
            probation,
            *self.slow_rank(g),
        )
        self.forget(g)
        return verdict

    def slow_rank(self, g: int) -> tuple[int | None, float | None, float | None]:
        """(the group's slow rank, its mean figure, the median of its other ranks' means).

        Named when it is the group's only rank, or when its mean exceeds the others' by the
        policy's margin and `min_excess_s`. Ranks that wait for each other inside the step
        (an all-reduce within the group before the FTAR) report alike: no rank is named."""
        rounds = [d if isinstance(d, dict) else dict(enumerate(d)) for d in self.ranks.get(g, ()) if d]
        if not rounds:
            return None, None, None
        layout = set(rounds[-1])
        rounds = [d for d in rounds if set(d) == layout]
        mean = {r: statistics.fmean(d[r] for d in rounds) for r in layout}
        rank = max(mean, key=lambda r: mean[r])
        others = [v for r, v in mean.items() if r != rank]
        if not others:
            return rank, round(mean[rank], 4), None
        peer = statistics.median(others)
        named = mean[rank] - peer >= self.policy.min_excess_s and mean[rank] >= self.policy.margin * peer
        return (rank if named else None), round(mean[rank], 4), round(peer, 4)
