"""Fail-slow (ftcore/pace.py): a replica group consistently slower than its peers is held out
of the quorum on standby, never below min_replicas, and comes back through a heal.

The judge is tested on its own, then through a real lighthouse on loopback with real
clients, then in a real job (the toy trainer under the launcher, one group slowed by a
fault plan)."""

import json
import threading
import time

import pytest
from conftest import ask_all, run_python

from ftcore.lighthouse_client import LighthouseClient, Standby, call
from ftcore.messages import Busy, Pace, Quorum, QuorumRequest, RankInfo
from ftcore.pace import PaceJudge, PacePolicy

FAST = {0: 0.05, 1: 0.05, 2: 0.15}  # group 2 computes 3x as long


def judge_after(rounds: int, busy: dict, policy: PacePolicy, min_replicas: int = 1, excluded: int = 0):
    j = PaceJudge(policy)
    for _ in range(rounds):
        j.observe(busy)
    return j, j.judge(sorted(busy), dict.fromkeys(busy, 0), min_replicas, excluded)


def test_a_group_three_times_slower_is_excluded_only_after_a_full_window():
    policy = PacePolicy(ratio=2.0, window=5, probation_s=10)
    assert judge_after(4, FAST, policy)[1] is None
    j, v = judge_after(5, FAST, policy)
    assert v is not None and v.group == 2 and v.ratio == pytest.approx(3.0) and v.probation_s == 10
    for _ in range(5):  # the same incarnation again: twice the probation
        j.observe(FAST)
    assert j.judge([0, 1, 2], {0: 0, 1: 0, 2: 0}, 1, 0).probation_s == 20
    for _ in range(5):  # a replaced group (new incarnation) starts with a clean record
        j.observe(FAST)
    assert j.judge([0, 1, 2], {0: 0, 1: 0, 2: 1}, 1, 0).probation_s == 10


def test_exclusion_must_pay_and_respect_min_replicas_and_the_majority():
    policy = PacePolicy(ratio=1.2, window=3)
    # two groups: leaving one out pays only beyond 2x (R/(R-1), plus 10%)
    assert judge_after(3, {0: 0.05, 1: 0.09}, policy)[1] is None
    assert judge_after(3, {0: 0.05, 1: 0.15}, policy)[1].group == 1
    # min_replicas: with 3 groups and min_replicas 3 nobody may leave
    assert judge_after(3, FAST, policy, min_replicas=3)[1] is None
    # at most half of the job: 2 members left and one already excluded
    assert judge_after(3, {0: 0.05, 1: 0.15}, policy, excluded=1)[1] is None
    # off, or an excess too small to matter (all overhead)
    assert judge_after(3, FAST, PacePolicy(ratio=0, window=3))[1] is None
    assert judge_after(3, {0: 0.001, 1: 0.001, 2: 0.004}, policy)[1] is None
    # noise: a slow step now and then is not a slow group (median over the window)
    j = PaceJudge(PacePolicy(ratio=2.0, window=6))
    for i in range(6):
        j.observe(FAST if i % 3 == 0 else {0: 0.05, 1: 0.05, 2: 0.05})
    assert j.judge([0, 1, 2], dict.fromkeys(range(3), 0), 1, 0) is None
    with pytest.raises(ValueError):
        PacePolicy(ratio=-1).check()


def _clients(addr, n=3):
    clients = [LighthouseClient(addr, RankInfo(group=g, rank=0, world=1, num_groups=n)) for g in range(n)]
    for c in clients:
        c.start_heartbeats()  # alive while on standby, as a real rank is
    return clients


def _ask(clients, timeout: float = 5.0, **report):
    """Every client's quorum at once, each request reporting `report` (busy=..., idle=...)
    beside the client's info; a `busy` dict holds each group's figure (absent: none)."""
    out: list = [None] * len(clients)
    busy = report.pop("busy", {})

    def ask(i):
        g = clients[i].info.group
        req = QuorumRequest(clients[i].info, busy=busy.get(g), **report)
        try:
            out[i] = clients[i].quorum(timeout, request=req)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[i] = e

    ts = [threading.Thread(target=ask, args=(i,)) for i in range(len(clients))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


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
    addr, lh = lighthouse(pace=PacePolicy(ratio=2.0, window=4, probation_s=1.5), join_timeout=30)
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
    addr, lh = lighthouse(pace=PacePolicy(ratio=2.0, window=3, probation_s=600))
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
def test_a_slowed_group_is_excluded_in_a_real_job_and_all_groups_end_identical(tmp_path):
    """3 groups of the toy trainer; group 2 sleeps 0.15 s in each step from step 10 to 60
    (4x its peers' ~0.05 s); it is excluded, rejoins when only its make-up is left, and
    every group ends with the same state, data exactly once (the toy checks its ledger)."""
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps({"faults": [{"kind": "slow", "group": 2, "at_step": 10, "until_step": 60, "delay_s": 0.15}]})
    )
    out = tmp_path / "run"
    r = run_python(
        [
            "-m",
            "training",
            "launch",
            "--worker",
            "ftcore.examples.toy",
            "--replica-groups",
            "3",
            "--out",
            str(out),
            "--faults",
            str(plan),
            "--timeout",
            "200",
            "--",
            "--steps",
            "80",
            "--step-sleep",
            "0.04",
        ],
        260,
        env={"FTCORE_SLOW_WINDOW": "8", "FTCORE_SLOW_PROBATION": "60", "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stdout[-3000:]
    tl = json.loads((out / "timeline.json").read_text())
    kinds = [e["kind"] for e in tl["lighthouse_events"]]
    assert "group_excluded" in kinds and "group_readmitted" in kinds, kinds
    excluded = next(e for e in tl["lighthouse_events"] if e["kind"] == "group_excluded")
    assert excluded["group"] == 2
    assert len(set(tl["checksums"].values())) == 1 and len(tl["checksums"]) == 3, tl["checksums"]
    standby = [s for s in tl["steps"] if s["group"] == 2 and "standby" in s.get("error", "")]
    assert standby, "group 2 never stood by"
