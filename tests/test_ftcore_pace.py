"""Fail-slow (ftcore/pace.py): a replica group consistently slower than its peers is held out
of the quorum on standby, never below min_replicas, and comes back through a heal.

The judge is tested on its own, then through a real lighthouse on loopback with real
clients, then in a real job (the toy trainer under the launcher, one group slowed by a
fault plan)."""

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ask_all

from ftcore import pace
from ftcore.lighthouse_client import LighthouseClient, Standby, call
from ftcore.messages import Busy, Pace, Quorum, QuorumRequest, RankInfo
from ftcore.pace import PaceJudge, PacePolicy, median_without

FAST = {0: 0.05, 1: 0.05, 2: 0.15}  # group 2 computes 3x as long


def by_rounds(**kw) -> PacePolicy:
    """The window rule alone: no settling and no time span (their tests set them)."""
    return PacePolicy(**({"settle": 0, "span_s": 0.0} | kw))


def judge_after(rounds: int, busy: dict, policy: PacePolicy, min_replicas: int = 1, excluded: int = 0):
    j = PaceJudge(policy)
    for _ in range(rounds):
        j.observe(busy, at=0.0)
    return j, j.judge(sorted(busy), dict.fromkeys(busy, 0), min_replicas, excluded)


def duty_cycle(j: PaceJudge, rounds: int, every: int, pause: float, slow: int = 2, n: int = 3, t: float = 0.035):
    """Rounds of n groups at t seconds; group `slow` is stopped for `pause` seconds in one
    round of every `every` (as SIGSTOP/SIGCONT does): most of its steps are not slow."""
    for i in range(rounds):
        j.observe({g: t + (pause if g == slow and i % every == every - 1 else 0.0) for g in range(n)}, at=0.0)


@pytest.mark.parametrize(
    "groups, s, ratio, excluded",
    [
        # the bound is R/(R-1) x 1.1: 2.2 for 2 groups, 1.65 for 3, 1.47 for 4
        (2, 2.1, None, False),
        (2, 2.3, None, True),
        (3, 1.6, None, False),
        (3, 1.7, None, True),
        (4, 1.42, None, False),
        (4, 1.52, None, True),
        # FTCORE_SLOW_RATIO raises the bound (2: the wall-time bound with the make-up) ...
        (3, 1.9, 2.0, False),
        (3, 2.1, 2.0, True),
        # ... and never lowers it below where leaving the group out costs pace; 0: off
        (3, 1.6, 1.2, False),
        (3, 5.0, 0.0, False),
    ],
)
def test_a_group_is_excluded_at_r_over_r_minus_1_of_its_peers(groups, s, ratio, excluded):
    busy = {g: 0.1 for g in range(groups)} | {groups - 1: 0.1 * s}
    j, v = judge_after(8, busy, by_rounds(ratio=ratio, window=8))
    assert (v is not None) == excluded, (groups, s, ratio, v)
    if excluded:
        assert v.group == groups - 1 and v.ratio == pytest.approx(s)
        assert v.bound == pytest.approx(max(ratio or 0, 1.1 * groups / (groups - 1)), abs=1e-3)
        assert v.busy_s == pytest.approx(0.1 * s) and v.peers_s == pytest.approx(0.1)


def test_the_bound_table():
    p = PacePolicy(ratio=None)
    assert [round(p.bound(n), 3) for n in (2, 3, 4, 8)] == [2.2, 1.65, 1.467, 1.257]
    assert PacePolicy(ratio=2.0).bound(3) == 2.0 and PacePolicy(ratio=2.0).bound(2) == pytest.approx(2.2)


def test_a_group_three_times_slower_is_excluded_only_after_a_full_window():
    policy = by_rounds(ratio=None, window=5, probation_s=10)
    assert judge_after(4, FAST, policy)[1] is None
    j, v = judge_after(5, FAST, policy)
    assert v is not None and v.group == 2 and v.ratio == pytest.approx(3.0) and v.probation_s == 10
    for _ in range(5):  # the same incarnation again: twice the probation
        j.observe(FAST, at=0.0)
    assert j.judge([0, 1, 2], {0: 0, 1: 0, 2: 0}, 1, 0).probation_s == 20
    for _ in range(5):  # a replaced group (new incarnation) starts with a clean record
        j.observe(FAST, at=0.0)
    assert j.judge([0, 1, 2], {0: 0, 1: 0, 2: 1}, 1, 0).probation_s == 10


def test_a_duty_cycled_group_is_excluded_although_most_of_its_steps_are_not_slow():
    """Stopped 0.25 s in one round of 8 (a 50% duty cycle at 35 ms steps): the median step
    ratio is 1 (the rule before), the time-weighted ratio ~1.9, over the 1.65 bound of 3 groups."""
    j = PaceJudge(by_rounds(ratio=None, window=40))
    duty_cycle(j, 40, every=8, pause=0.25)
    s, without_worst = j.slowness(2)
    assert s == pytest.approx((40 * 0.035 + 5 * 0.25) / (40 * 0.035)) and without_worst > 1.65
    v = j.judge([0, 1, 2], dict.fromkeys(range(3), 0), 1, 0)
    assert v is not None and v.group == 2 and v.ratio == pytest.approx(s, abs=1e-3)
    # the same stops in 2 groups of 2: the bound is 2.2, and one group's stops are not enough
    j2 = PaceJudge(by_rounds(ratio=None, window=40))
    duty_cycle(j2, 40, every=8, pause=0.25, slow=1, n=2)
    assert j2.slowness(1)[1] < 2.2 and j2.judge([0, 1], {0: 0, 1: 0}, 1, 0) is None


def test_one_long_pause_or_an_occasional_slow_step_excludes_nobody():
    j = PaceJudge(by_rounds(ratio=None, window=20))
    duty_cycle(j, 20, every=20, pause=2.0)  # one 2 s pause (a collection, a checkpoint) in the window
    s, without_worst = j.slowness(2)
    assert s > 3 and without_worst == pytest.approx(1.0)
    assert j.judge([0, 1, 2], dict.fromkeys(range(3), 0), 1, 0) is None
    j = PaceJudge(by_rounds(ratio=None, window=20))
    duty_cycle(j, 20, every=5, pause=0.03)  # 4 of 20 steps twice as long: s 1.17
    assert j.judge([0, 1, 2], dict.fromkeys(range(3), 0), 1, 0) is None
    # an excess under min_excess_s never counts (a step of a few milliseconds is all overhead)
    assert judge_after(20, {0: 0.001, 1: 0.001, 2: 0.004}, by_rounds(ratio=None, window=20))[1] is None


def test_a_readmitted_group_is_not_excluded_again_on_its_first_rounds():
    """After readmission its first `settle` rounds are not measured (a healed group's warm-up),
    and it needs a full window again; slow again after that, it goes back for twice the probation."""
    policy = by_rounds(ratio=None, window=10, settle=4, probation_s=5)
    j, v = judge_after(14, FAST, policy)  # its first 4 rounds settle too
    assert v is not None and v.group == 2
    j.readmit(2)
    members, inc = [0, 1, 2], dict.fromkeys(range(3), 0)
    for _ in range(4):  # its first rounds back are slow: not counted
        j.observe({0: 0.05, 1: 0.05, 2: 0.5}, at=0.0)
    for _ in range(9):
        j.observe({0: 0.05, 1: 0.05, 2: 0.05}, at=0.0)
        assert j.judge(members, inc, 1, 0) is None
    assert len(j.rounds[2]) == 9  # the 4 settling rounds left no trace
    j.observe({0: 0.05, 1: 0.05, 2: 0.05}, at=0.0)
    assert j.judge(members, inc, 1, 0) is None  # recovered: stays in
    for _ in range(3):  # slow again: out once its window's time-weighted ratio crosses 1.65 ...
        j.observe(FAST, at=0.0)
        assert j.judge(members, inc, 1, 0) is None
    j.observe(FAST, at=0.0)  # 4 rounds of 3x in 10: 1.8, 1.67 without the worst
    assert j.judge(members, inc, 1, 0).probation_s == 10  # ... for twice the probation


def test_exclusion_respects_min_replicas_and_the_majority():
    policy = by_rounds(ratio=None, window=3)
    assert judge_after(3, FAST, policy, min_replicas=3)[1] is None  # nobody may leave
    assert judge_after(3, {0: 0.05, 1: 0.15}, policy, excluded=1)[1] is None  # half already out
    assert judge_after(3, {0: 0.05, 1: 0.15}, policy)[1].group == 1
    for bad in (PacePolicy(ratio=-1), PacePolicy(window=0), PacePolicy(margin=0.9), PacePolicy(settle=-1)):
        with pytest.raises(ValueError, match="fail-slow policy"):
            bad.check()


def test_the_ratio_setting(monkeypatch):
    monkeypatch.delenv("FTCORE_SLOW_RATIO", raising=False)
    assert pace._ratio_env() is None
    monkeypatch.setenv("FTCORE_SLOW_RATIO", "")
    assert pace._ratio_env() is None
    monkeypatch.setenv("FTCORE_SLOW_RATIO", "0")
    assert pace._ratio_env() == 0 and PacePolicy(ratio=pace._ratio_env()).off
    monkeypatch.setenv("FTCORE_SLOW_RATIO", "two")
    with pytest.raises(SystemExit, match="FTCORE_SLOW_RATIO='two' is not a number"):
        pace._ratio_env()


@pytest.mark.parametrize(
    "ranks, named, rank_s, others_s",
    [
        ({0: 0.05, 1: 0.15}, 1, 0.15, 0.05),  # rank 1 of the group is the slow one
        ({0: 0.15, 1: 0.05, 2: 0.05, 3: 0.06}, 0, 0.15, 0.05),
        # ranks that wait for each other inside the step report alike: no rank is named
        ({0: 0.15, 1: 0.149}, None, 0.15, 0.149),
        ({0: 0.15}, 0, 0.15, None),  # the group's only rank
        ({}, None, None, None),  # one figure for the whole group (its relay speaks for it)
    ],
)
def test_the_verdict_names_the_slow_rank(ranks, named, rank_s, others_s):
    j = PaceJudge(by_rounds(ratio=None, window=5))
    for _ in range(5):
        j.observe(FAST, {0: {0: 0.05}, 1: {0: 0.05}, 2: ranks}, at=0.0)
    v = j.judge([0, 1, 2], dict.fromkeys(range(3), 0), 1, 0)
    assert v is not None and v.group == 2
    assert (v.rank, v.rank_busy_s, v.others_busy_s) == (named, rank_s, others_s)


def test_the_slow_rank_is_judged_over_the_window_not_its_last_round():
    """A duty-cycled rank is slow in some rounds only; its mean over the window names it."""
    j = PaceJudge(by_rounds(ratio=None, window=16))
    for i in range(16):
        stop = 0.25 if i % 4 == 3 else 0.0
        j.observe(
            {0: 0.035, 1: 0.035, 2: 0.035 + stop},
            {0: {0: 0.035}, 1: {0: 0.035}, 2: {0: 0.036, 1: 0.035 + stop}},
            at=0.0,
        )
    v = j.judge([0, 1, 2], dict.fromkeys(range(3), 0), 1, 0)
    assert v is not None and v.rank == 1 and v.rank_busy_s == pytest.approx(0.035 + 0.25 / 4)


def _clients(addr, n=3, world=1, relay=False):
    """Each group's ranks (a relay: one client speaking for the group's `world` ranks)."""
    ranks = 1 if relay else world
    clients = [
        LighthouseClient(addr, RankInfo(group=g, rank=r, world=world, num_groups=n, relay=relay))
        for g in range(n)
        for r in range(ranks)
    ]
    for c in clients:
        c.start_heartbeats()  # alive while on standby, as a real rank is
    return clients


def _ask(clients, timeout: float = 5.0, **report):
    """Every client's quorum at once, each request reporting `report` (busy=..., idle=...)
    beside the client's info; a `busy` dict holds each rank's figure by (group, rank), or
    each group's by group (absent: none)."""
    busy = report.pop("busy", {})

    def ask(c):
        req = QuorumRequest(c.info, busy=busy.get((c.info.group, c.info.rank), busy.get(c.info.group)), **report)
        try:
            return c.quorum(timeout, request=req)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return e

    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(ask, clients))


def _round(clients, busy: dict, qid: int, timeout: float = 5.0):
    return _ask(clients, timeout, busy={g: Busy(qid, s) for g, s in busy.items()})


def _rejoin_round(clients):
    """Group 2 asks first, the others a moment later: a returning group is in the round it
    asked in (otherwise the others' round forms without it and it joins the next)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(q2=ask_all(clients[2:])[0]))
    t.start()
    time.sleep(0.3)
    qs = ask_all(clients[:2])
    t.join()
    return [*qs, out["q2"]]


def test_the_lighthouse_holds_a_slow_group_on_standby_and_readmits_it_through_a_heal(lighthouse):
    addr, lh = lighthouse(pace=by_rounds(ratio=2.0, window=4, probation_s=1.5), join_timeout=30)
    clients = _clients(addr)
    try:
        qid = ask_all(clients)[0].quorum_id
        for _ in range(4):
            qs = _round(clients, FAST, qid)
            assert all(isinstance(q, Quorum) for q in qs), qs
            qid = qs[0].quorum_id
        # group 2 is now on standby: told so at once, and the others do not wait for it (a
        # 30 s join timeout: a round that waited for group 2 would outlast the requests' 5 s
        # and say so with a quorum_waiting event after a second)
        qs = _round(clients, {}, qid)
        assert isinstance(qs[2], Standby) and 0 < qs[2].retry_s <= 1.0, qs[2]
        assert isinstance(qs[0], Quorum) and qs[0].groups == (0, 1), qs[0]
        st = lh.status()
        assert st["groups"][2]["standby_s"] > 0 and st["groups"][0]["standby_s"] is None
        kinds = [e["kind"] for e in st["events"]]
        assert "quorum_waiting" not in kinds[kinds.index("group_excluded") :], st["events"]
        ev = [e for e in st["events"] if e["kind"] == "group_excluded"]
        assert ev and ev[0]["group"] == 2 and ev[0]["ratio"] >= 2.0 and ev[0]["reason"]
        # after the probation it rejoins, and heals (it missed the steps the others took)
        time.sleep(1.6)
        for c in clients[:2]:
            c.update(step=5)
        qs = _rejoin_round(clients)
        assert all(isinstance(q, Quorum) for q in qs), qs
        assert qs[0].groups == (0, 1, 2) and 2 in qs[0].heal
        assert any(e["kind"] == "group_readmitted" for e in lh.status()["events"])
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("relay", [False, True])
def test_the_exclusion_event_names_the_slow_rank(lighthouse, relay):
    """Groups of 2 ranks; rank 1 of group 2 computes 3x as long. The event names it, with its
    figure and its group's other rank's, also when a relay speaks for the group (it sends its
    slowest rank's figure with every rank's, ftcore/relay.py)."""
    addr, lh = lighthouse(pace=by_rounds(ratio=None, window=4, probation_s=30))
    clients = _clients(addr, world=2, relay=relay)
    try:
        qid = ask_all(clients)[0].quorum_id
        for _ in range(4):
            figures = {(g, r): 0.05 for g in range(3) for r in range(2)} | {(2, 1): 0.15}
            busy = {k: Busy(qid, v) for k, v in figures.items()}
            if relay:
                busy = {
                    (g, 0): Busy(qid, max(figures[g, 0], figures[g, 1]), (figures[g, 0], figures[g, 1]))
                    for g in range(3)
                }
            qs = _ask(clients, busy=busy)
            assert all(isinstance(q, Quorum) for q in qs), qs
            qid = qs[0].quorum_id
        ev = [e for e in lh.status()["events"] if e["kind"] == "group_excluded"]
        assert len(ev) == 1 and ev[0]["group"] == 2 and ev[0]["ratio"] == 3.0 and ev[0]["bound"] == 1.65
        assert ev[0]["busy_s"] == 0.15 and ev[0]["peers_busy_s"] == 0.05
        assert (ev[0]["rank"], ev[0]["rank_busy_s"], ev[0]["other_ranks_busy_s"]) == (1, 0.15, 0.05)
    finally:
        for c in clients:
            c.close()


def test_each_quorum_tells_its_members_the_last_steps_pace(lighthouse):
    """The round's reply carries the slowest and the mean compute of the step just finished
    (every member's figure for the same quorum): each group's wait for the slowest is the
    cross-group straggler time the trainer logs (ft/straggler_s)."""
    addr, lh = lighthouse(pace=PacePolicy(ratio=0))
    clients = _clients(addr)
    try:
        qid = ask_all(clients)[0].quorum_id
        qs = _round(clients, FAST, qid)
        assert qs[0].pace == Pace(qid, 0.15, round(0.25 / 3, 6))
        assert _round(clients, {0: 0.1}, qs[0].quorum_id)[0].pace is None  # not every member's figure
    finally:
        for c in clients:
            c.close()


def test_a_standby_ends_when_only_the_excluded_groups_work_is_left(lighthouse):
    addr, lh = lighthouse(pace=by_rounds(ratio=2.0, window=3, probation_s=600))
    clients = _clients(addr)
    try:
        qid = ask_all(clients)[0].quorum_id
        for _ in range(3):
            qid = _round(clients, FAST, qid)[0].quorum_id
        qs = _round(clients, {}, qid)
        assert isinstance(qs[2], Standby)
        _ask(clients[:2], idle=qs[0].quorum_id)  # a round in which nobody had work: the make-up left is group 2's
        assert isinstance(_rejoin_round(clients)[2], Quorum)
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("busy", [[1, "x"], [1, -1], [1, 1e9], "1", [1, 2, 3], [1, True]])
def test_a_malformed_pace_figure_is_a_400_and_changes_nothing(lighthouse, busy):
    addr, lh = lighthouse()
    msg = {"group": 0, "rank": 0, "world": 1, "num_groups": 1, "busy": busy, "timeout": 1}
    code, body = call(addr, "/quorum", msg, None)
    assert code == 400 and "busy" in str(body)
    assert lh.status()["groups"] == []


@pytest.mark.integ
@pytest.mark.slow
def test_a_duty_cycled_rank_is_excluded_named_and_rejoins_by_heal(tmp_path):
    """benchmarks/fail_slow.py's duty scenario (one copy of the set-up): group 2's rank is
    SIGSTOPped 0.25 s and SIGCONTed 0.25 s for 12 s in a job of 3 groups of the toy trainer (a
    full window of 40 slowed rounds takes ~5 s on a loaded machine). Most of its steps are not
    slow; it is excluded anyway, named, and after the slowdown rejoins by a heal; nobody else is
    excluded, and every group ends with the same state."""
    from benchmarks import fail_slow

    a = argparse.Namespace(steps=0, pace=30.0, before=2.0, seconds=12.0, timeout=300.0, ranks_per_group=1, rank=0)
    # a probation as long as the slowdown: readmitted after it ends (sooner, it would be measured again)
    tl, duty = fail_slow.launch_duty(str(tmp_path / "run"), a, {"FTCORE_SLOW_PROBATION": "12"})
    row = fail_slow.duty_phases(tl, duty, 3.0)
    assert row["exclusions"] >= 1 and row["false_exclusions"] == 0, row
    assert row["rank_named"] == 0 and row["rejoined_by_heal_after_s"] is not None, row
    assert len(set(tl["checksums"].values())) == 1 and len(tl["checksums"]) == 3, tl["checksums"]


@pytest.mark.parametrize(
    "values", [[1.0, 2.0], [3.0, 1.0, 2.0], [5.0, 5.0, 1.0, 9.0], [0.5] * 7, [4.0, 1.0, 3.0, 2.0, 8.0, 8.0]]
)
def test_median_without_is_the_median_of_the_others(values):
    ordered = sorted(values)
    for i, v in enumerate(values):
        others = values[:i] + values[i + 1 :]
        assert median_without(ordered, v) == statistics.median(others)


def test_the_running_sums_are_the_windows_sums():
    """judge() tests every member by the running sums first: they must be the window's own."""
    import random

    rng = random.Random(7)
    j = PaceJudge(by_rounds(window=5))
    for _ in range(40):
        j.observe({g: rng.uniform(0.1, 0.5) * (3 if g == 2 else 1) for g in range(4)}, at=0.0)
        if rng.random() < 0.1:
            j.readmit(1)
    for g, hist in j.rounds.items():
        counted = sum(j._counted(b, ref) for b, ref, _ in hist)
        assert j.sums[g] == [pytest.approx(counted), pytest.approx(sum(r for _, r, _ in hist))]
    verdict = j.judge([0, 1, 2, 3], dict.fromkeys(range(4), 0), 1, 0)
    assert verdict is not None and verdict.group == 2  # three times its peers: the filter kept it


def test_start_up_is_not_slowness():
    """Every group settles before it is measured: a group slow in its first rounds (start-up on
    a loaded machine: 36 ms a step against its peers' 19) is not excluded, at the job's start
    nor after a restart (a new incarnation is readmitted: it settles again)."""
    policy = PacePolicy(ratio=None, window=40, settle=20, span_s=0.0)
    j, t = PaceJudge(policy), 0.0
    for i in range(60):
        t += 0.036
        j.observe({0: 0.019, 1: 0.019, 2: 0.036 if i < 20 else 0.019}, at=t)
        assert j.judge([0, 1, 2], dict.fromkeys(range(3), 0), 1, 0) is None
    j.readmit(2)  # restarted: its first rounds again
    for i in range(20):
        j.observe({0: 0.019, 1: 0.019, 2: 0.036}, at=t + i)
    assert 2 not in j.rounds and j.judge([0, 1, 2], dict.fromkeys(range(3), 0), 1, 0) is None
    # ... while a group that stays slow once settled is out after its window
    for i in range(40):
        j.observe({0: 0.019, 1: 0.019, 2: 0.036}, at=t + 20 + i)
    v = j.judge([0, 1, 2], dict.fromkeys(range(3), 0), 1, 0)
    assert v is not None and v.group == 2


def test_a_burst_of_load_is_diluted_by_the_span_and_a_duty_cycle_is_not():
    """The window spans `span_s` seconds as well as `window` rounds: 1.5 s of a group at 3x (a
    burst of load beside the job) reaches the bound in a 40-round window but not over 3 s; a
    rank stopped 0.25 s of every 0.5 s is still out once 3 s of it are seen."""

    def burst(policy: PacePolicy) -> list[int]:
        j, t, out = PaceJudge(policy), 0.0, []
        for i in range(200):
            slow = 80 <= i < 94
            t += 0.105 if slow else 0.035
            j.observe({0: 0.035, 1: 0.035, 2: 0.105 if slow else 0.035}, at=t)
            v = j.judge([0, 1, 2], dict.fromkeys(range(3), 0), 1, 0)
            out += [v.group] if v else []
        return out

    assert burst(by_rounds(ratio=None, window=40)) == [2]  # rounds alone: excluded for a burst
    assert burst(PacePolicy(ratio=None, window=40, settle=0, span_s=3.0)) == []
    duty = PaceJudge(PacePolicy(ratio=None, window=40, settle=0, span_s=3.0))
    t, verdict = 0.0, None
    for i in range(400):
        stop = 0.25 if i % 8 == 7 else 0.0
        t += 0.035 + stop
        duty.observe({0: 0.035, 1: 0.035, 2: 0.035 + stop}, at=t)
        verdict = verdict or duty.judge([0, 1, 2], dict.fromkeys(range(3), 0), 1, 0)
        if verdict is None and t < 3.0:
            assert duty.slowness(2) is None  # not before 3 s of evidence
    assert verdict is not None and verdict.group == 2
