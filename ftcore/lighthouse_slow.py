"""Fail-slow on the lighthouse: one job's slow groups. Each round hands the judge (ftcore/pace.py)
its members' compute figures; a verdict puts a group on standby for its probation; a request of
a group on standby is answered with how long it waits. A job owns one (ftcore/lighthouse_job.py)
and hands it what each call uses."""

import time
from collections.abc import Callable, Mapping
from typing import Any

from ftcore.answers import StandbyReply
from ftcore.lighthouse_records import GroupRecord, Request
from ftcore.messages import Quorum
from ftcore.pace import Figures, PaceJudge, PacePolicy


class SlowGroups:
    def __init__(self, policy: PacePolicy, event: Callable[..., None]):
        self.judge = PaceJudge(policy)
        self.window = policy.window
        self.excluded: dict[int, float] = {}  # group -> monotonic end of its standby
        self._event = event

    def figures(
        self,
        quorum: Quorum | None,
        pending: Mapping[int, Mapping[int, Request]],
        groups: Mapping[int, GroupRecord],
        members: list[int],
    ) -> dict[int, float]:
        """Each member's compute in the step it just finished in `quorum` (its slowest rank's),
        for members that all ran that step in it and nobody healed: comparable figures. The judge
        records them with each rank's (a relay sends them all with its group's)."""
        if quorum is None or quorum.heal:
            return {}
        qid, out = quorum.quorum_id, {}
        ranks: dict[int, Figures] = {}
        for g in members:
            reqs = pending[g].values()
            figures = {r.rank: r.busy.seconds for r in reqs if r.busy is not None and r.busy.quorum_id == qid}
            if figures and len(figures) == len(reqs):
                out[g] = max(figures.values())
                first = next(iter(reqs)).busy
                relayed = first.ranks if first is not None and groups[g].relay else ()
                if len(relayed) == groups[g].world:  # a relay sends every rank's figure, in rank order
                    ranks[g] = relayed
                else:
                    ranks[g] = figures if len(figures) == groups[g].world else {}
        if len(out) < len(members):
            return {}
        self.judge.observe(out, ranks, at=time.monotonic())
        return out

    def exclude_slow(self, members: list[int], incarnations: dict[int, int], min_replicas: int) -> None:
        """Put the member the judge finds slow on standby (its figures were recorded by `figures`)."""
        v = self.judge.judge(members, incarnations, min_replicas, len(self.excluded))
        if v is None:
            return
        self.excluded[v.group] = time.monotonic() + v.probation_s
        event: dict[str, Any] = v.event(self.window)
        self._event("group_excluded", incarnation=incarnations[v.group], **event)

    def standby(self, grp: GroupRecord, now: float, finished: bool) -> StandbyReply | None:
        """The answer to a quorum request of a group on standby while its probation lasts (and
        the job has not `finished`: nothing to wait for then); None once it may rejoin."""
        until = self.excluded.get(grp.group)
        if until is None:
            return None
        if now < until and not finished:
            return StandbyReply(
                round(min(until - now, 1.0), 3), f"excluded as slower than its peers for {until - now:.1f}s more"
            )
        del self.excluded[grp.group]
        self.judge.readmit(grp.group)
        self._event("group_readmitted", group=grp.group, incarnation=grp.incarnation)
        return None

    def release(self) -> None:
        """Every group on standby may rejoin now (the work left is their own)."""
        self.excluded = dict.fromkeys(self.excluded, 0.0)
