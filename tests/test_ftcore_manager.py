"""The manager's step protocol in one process, driven by a fake lighthouse client.

No lighthouse and no subprocess: each Manager gets `FakeLighthouse.connect` as its
`lighthouse_client`, which hands out the quorums a test chooses and records what the rank
asked. The rest is real and cheap: the rank's TCPStore and heal server on loopback, FTAR
(over a real gloo group when a quorum has two groups, each manager stepping in a thread of
its own) and the heal transfer. Every manager has one rank (world=1), so the vote inside a
group is the rank's own."""

import json
import threading
import time
from dataclasses import replace

import pytest
import torch

from ftcore import timeouts
from ftcore.faults import Fault
from ftcore.lighthouse_client import LighthouseError
from ftcore.manager import Manager, ManagerConfig
from ftcore.messages import Quorum


class FakeLighthouse:
    """Stands in for LighthouseClient: one answer per quorum request, in order (a Quorum, or an
    exception to raise); `gate` cleared holds a request until it is set again; `silent` is how
    long the lighthouse has been silent, for the lease."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.requests = []
        self.gate = threading.Event()
        self.gate.set()
        self.silent = 0.0
        self.replaced = False
        self.failed_groups = ()
        self.latest_quorum_id = 0
        self.abandoned_quorum_id = 0
        self.reports, self.events = [], []
        self.info = None

    def connect(self, addr, info, token):  # the manager's lighthouse_client factory
        self.info = info
        return self

    def update(self, **changes):
        self.info = replace(self.info, **changes)

    def start_heartbeats(self):
        pass

    def quorum(self, timeout=timeouts.QUORUM_TIMEOUT, request=None, leased=lambda: False):
        self.requests.append(request)
        assert self.gate.wait(10), "the test never released this request"
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def silent_for(self):
        return self.silent

    def report_failure(self, quorum_id, error, stalled=False):
        self.reports.append((quorum_id, error))

    def event(self, kind, **data):
        self.events.append((kind, data))

    def leave(self):
        pass

    def close(self):
        pass


def quorum(qid=1, groups=(0,), heal=None, max_step=0, lighthouse_id="lh-1", store="", heal_from="", update_from=""):
    return Quorum(
        quorum_id=qid,
        lighthouse_id=lighthouse_id,
        job="default",
        identity=tuple((g, 0) for g in groups),
        groups=tuple(groups),
        max_step=max_step,
        heal=heal or {},
        lease_s=10.0,
        store=store,
        heal_from=heal_from,
        update_from=update_from,
    )


class Group:
    """One replica group of one rank: its state (a tensor), its fake lighthouse, its manager."""

    def __init__(self, tmp_path, fake, group=0, num_groups=1, min_replicas=1, step=0, faults=None):
        self.state = {"w": torch.full((4,), float(group + 1))}
        self.fake = fake
        self.records = tmp_path / f"records-{group}.jsonl"
        cfg = ManagerConfig(
            lighthouse="127.0.0.1:9",
            group=group,
            num_groups=num_groups,
            min_replicas=min_replicas,
            host="127.0.0.1",
            records=str(self.records),
        )
        self.mgr = Manager(
            cfg, lambda: dict(self.state), self.state.update, step=step, faults=faults, lighthouse_client=fake.connect
        )

    def step(self, grad):
        """One step of the protocol; its vote."""
        self.mgr.start_quorum()
        self.mgr.allreduce([grad])
        return self.mgr.should_commit()

    def last_record(self):
        return json.loads(self.records.read_text().splitlines()[-1])


@pytest.fixture
def groups(tmp_path):
    made = []

    def make(*answers, **kw):
        g = Group(tmp_path, FakeLighthouse(*answers), **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.mgr.shutdown()


def test_a_step_commits_with_no_errors_and_enough_participants(groups):
    g = groups(quorum(1), quorum(1))
    grad = torch.tensor([1.0, 2.0])
    assert g.step(grad) and g.mgr.step == 1
    assert torch.equal(grad, torch.tensor([1.0, 2.0]))  # the average over one group is its own
    rec = g.last_record()
    assert rec["committed"] and rec["participants"] == 1 and rec["contributors"] == 1 and rec["error"] == ""
    assert g.fake.info.step == 1 and g.fake.info.quorum_id == 1  # what heartbeats report from now on
    assert g.step(torch.ones(2)) and g.mgr.step == 2
    # each request reported the step it was made for, and the quorum the rank last trained in
    assert [r.info.step for r in g.fake.requests] == [0, 1]
    assert [(r.info.quorum_id, r.quorum_lighthouse_id) for r in g.fake.requests] == [(0, ""), (1, "lh-1")]


def test_no_commit_below_min_replicas(groups):
    g = groups(quorum(1, groups=(0,)), num_groups=2, min_replicas=2)
    assert not g.step(torch.ones(2))
    assert g.mgr.step == 0
    rec = g.last_record()
    assert not rec["committed"] and rec["participants"] == 1 and rec["error"] == ""


def test_no_commit_when_an_error_was_recorded_then_the_retry_commits(groups):
    g = groups(quorum(1), quorum(1), faults=[Fault("raise", group=0, at_step=0, phase="vote")])
    assert not g.step(torch.ones(2)) and g.mgr.step == 0
    assert "raise in vote" in g.last_record()["error"]
    assert g.step(torch.ones(2)) and g.mgr.step == 1  # the same step again: the fault fired once


def test_no_quorum_is_no_commit_and_no_failure_report(groups):
    g = groups(LighthouseError("lighthouse 127.0.0.1:9 unreachable"))
    assert not g.step(torch.ones(2)) and g.mgr.step == 0
    assert g.mgr.errors and g.mgr.errors[0].startswith("quorum: LighthouseError")
    assert g.fake.reports == []  # the lighthouse's own trouble is not a data-plane failure to report


def _step_all(gs, grads):
    """One step of each group, each in a thread of its own (their exchange needs them all at
    once); their votes."""
    votes = [None] * len(gs)

    def run(i, g):
        votes[i] = g.step(grads[i])

    ts = [threading.Thread(target=run, args=(i, g)) for i, g in enumerate(gs)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return votes


def _heal_pair(groups, faults0=None):
    """Group 0 at step 5 serves group 1 (at step 2) in a quorum of both; each steps in a thread."""
    g0 = groups(num_groups=2, step=5, faults=faults0)
    g1 = groups(group=1, num_groups=2, step=2)
    store, source = g0.fake.info.store, g0.fake.info.heal  # rank 0 of group 0: rendezvous and heal source
    g0.fake.answers.append(quorum(3, groups=(0, 1), heal={1: 0}, max_step=5, store=store))
    g1.fake.answers.append(quorum(3, groups=(0, 1), heal={1: 0}, max_step=5, store=store, heal_from=source))
    g0.state["w"] = torch.tensor([7.0, 8.0, 9.0, 10.0])
    grads = [torch.tensor([4.0, 6.0]), torch.tensor([100.0, 100.0])]
    return g0, g1, _step_all((g0, g1), grads), grads


def test_a_heal_assignment_loads_the_sources_state_and_meets_it_at_max_step(groups):
    g0, g1, votes, grads = _heal_pair(groups)
    assert votes == [True, True], (g0.mgr.errors, g1.mgr.errors)
    assert torch.equal(g1.state["w"], torch.tensor([7.0, 8.0, 9.0, 10.0]))  # group 0's state, fetched
    assert g1.mgr.healed_step == 5 and g0.mgr.healed_step is None
    assert g1.mgr.step == g0.mgr.step == 6  # met at max_step 5, then both committed it
    # the healing group sent zeros: the average is group 0's gradient alone, on both
    assert all(torch.equal(g, torch.tensor([4.0, 6.0])) for g in grads)
    assert g1.last_record()["healing"] and g1.last_record()["contributors"] == 1
    assert [k for k, _ in g1.fake.events] == ["heal_started", "heal_fetched", "heal_finished"]


def test_a_source_gives_its_snapshot_back_once_no_heal_needs_it(groups):
    """The snapshot is a copy of the whole state: held on, it would double a source's memory
    for the rest of the job."""
    g0, _, votes, _ = _heal_pair(groups)
    assert votes == [True, True]
    snapshot = lambda: g0.mgr.heal_server._offers["snapshot"]  # noqa: E731
    at, snap = snapshot()
    assert at == 5 and torch.equal(snap["w"], torch.tensor([7.0, 8.0, 9.0, 10.0]))  # held while in use
    g0.fake.answers.append(quorum(4, groups=(0,), max_step=6))  # group 1 gone again: no heal
    assert g0.step(torch.ones(2)) and g0.mgr.step == 7
    assert snapshot()[1] is None


def test_a_failed_heal_fetch_makes_the_healing_groups_vote_false(groups):
    # the source breaks the transfer (it raises while serving): the fetch fails
    g0, g1, votes, _ = _heal_pair(groups, faults0=[Fault("raise", group=0, at_step=0, phase="heal_serve")])
    assert votes == [True, False], (g0.mgr.errors, g1.mgr.errors)
    assert g1.mgr.errors[0].startswith("heal: HealError"), g1.mgr.errors
    assert g1.mgr.step == 2 and g1.mgr.healed_step is None  # nothing loaded, nothing committed
    assert torch.equal(g1.state["w"], torch.full((4,), 2.0))
    assert not g1.last_record()["committed"]


def _heal_trio(groups, faults0=None, faults2=None, meanwhile=None):
    """Group 1 (step 2) heals from group 0 (step 5) while group 2 (step 5) trains: 0 and 1 are
    aside, group 2 alone is the exchange and serves its average to them; each in a thread.
    `meanwhile(g0, g1, g2)` runs while they step."""
    g0 = groups(num_groups=3, step=5, faults=faults0)
    g1 = groups(group=1, num_groups=3, step=2)
    g2 = groups(group=2, num_groups=3, step=5, faults=faults2)
    kw = {"qid": 3, "groups": (0, 1, 2), "heal": {1: 0}, "max_step": 5, "store": g2.fake.info.store}
    g0.fake.answers.append(quorum(**kw, update_from=g2.fake.info.heal))
    g1.fake.answers.append(quorum(**kw, heal_from=g0.fake.info.heal, update_from=g2.fake.info.heal))
    g2.fake.answers.append(quorum(**kw))
    g0.state["w"] = g2.state["w"] = torch.tensor([7.0, 8.0, 9.0, 10.0])
    grads = [torch.tensor([4.0, 6.0]), torch.tensor([100.0, 100.0]), torch.tensor([1.0, 3.0])]
    votes = [None, None, None]

    def run(i, g):
        g.mgr.start_quorum()
        g.mgr.set_work(i == 2)  # the quorum's live members: group 2 alone
        g.mgr.allreduce([grads[i]])
        votes[i] = g.mgr.should_commit()

    ts = [threading.Thread(target=run, args=(i, g)) for i, g in enumerate((g0, g1, g2))]
    for t in ts:
        t.start()
    if meanwhile is not None:
        meanwhile(g0, g1, g2)
    for t in ts:
        t.join(30)
    return (g0, g1, g2), votes, grads


def test_a_healing_group_and_its_source_stand_aside_and_take_the_exchanges_average(groups):
    (g0, g1, g2), votes, grads = _heal_trio(groups)
    assert votes == [True, True, True], (g0.mgr.errors, g1.mgr.errors, g2.mgr.errors)
    assert all(torch.equal(g, torch.tensor([1.0, 3.0])) for g in grads)  # group 2's alone, on all three
    assert torch.equal(g1.state["w"], torch.tensor([7.0, 8.0, 9.0, 10.0]))  # the source's state
    assert g0.mgr.step == g1.mgr.step == g2.mgr.step == 6
    assert [g.last_record()["contributors"] for g in (g0, g1, g2)] == [1, 1, 1]
    assert g0.mgr._xg.pg is None and g2.mgr._xg.pg is None  # nobody built a group with an aside member


def test_a_source_failing_its_heal_costs_the_exchange_nothing(groups):
    (g0, g1, g2), votes, grads = _heal_trio(groups, faults0=[Fault("raise", group=0, at_step=0, phase="heal_serve")])
    assert votes == [True, False, True], (g0.mgr.errors, g1.mgr.errors, g2.mgr.errors)
    assert g1.mgr.errors[0].startswith("heal: HealError") and g1.mgr.step == 2
    assert torch.equal(grads[0], grads[2]) and g0.mgr.step == g2.mgr.step == 6
    assert g2.mgr.errors == [] and g2.fake.reports == []


def test_a_hung_heal_source_is_left_once_the_lighthouse_fails_it(groups):
    """The source hangs while it serves (its connection open, nothing sent): the healer gives the
    fetch up as soon as its lighthouse says the source failed, not after HEAL_TIMEOUT; the
    exchange, which the source stands aside from, commits."""
    hang = Fault("slow", group=0, at_step=0, phase="heal_serve", delay_s=timeouts.HEAL_TIMEOUT)

    def verdict(g0, g1, g2):  # the healer's lighthouse fails the source (its heartbeats stopped)
        time.sleep(0.5)
        g1.fake.failed_groups = (0,)

    (g0, g1, g2), votes, _ = _heal_trio(groups, faults0=[hang], meanwhile=verdict)
    assert votes[1] is False and votes[2] is True, (g1.mgr.errors, g2.mgr.errors)
    assert any("given up: its source failed" in e for e in g1.mgr.errors), g1.mgr.errors
    assert g1.mgr.step == 2 and g1.mgr.healed_step is None and g2.mgr.step == 6


def test_a_rank_reaching_an_abandoned_quorums_rendezvous_leaves_at_once(groups):
    """Its peers gave quorum 3 up (one reported its exchange failed) and wait for the next round,
    which needs this group: it must not wait out the join timeout in a rendezvous nobody else
    will reach. The lighthouse's word that 3 was abandoned ends it, and the step fails."""
    g0 = groups(num_groups=2)  # hosts the rendezvous, never comes to it
    g1 = groups(quorum(3, groups=(0, 1), store=g0.fake.info.store), group=1, num_groups=2)
    told = threading.Timer(0.5, lambda: setattr(g1.fake, "abandoned_quorum_id", 3))
    told.start()
    assert not g1.step(torch.ones(2))
    told.join()
    assert g1.mgr.errors[0].startswith("quorum: RendezvousAborted"), g1.mgr.errors
    assert g1.fake.reports[-1][0] == 3 and g1.mgr.step == 0  # reported: the lighthouse rebuilds every group


def test_a_member_that_missed_the_settled_answer_meets_the_others_under_its_lease(groups):
    """After the heal step, the lighthouse answers groups 0 and 1 with the heal quorum settled and
    goes silent before group 2 hears it: group 2 goes on under its lease in that same quorum
    settled (Quorum.settle), so all three meet in one rendezvous and commit the step together."""
    (g0, g1, g2), votes, _ = _heal_trio(groups)
    assert votes == [True, True, True]
    settled = replace(quorum(3, groups=(0, 1, 2), max_step=6, store=g2.fake.info.store), settled=True)
    g0.fake.answers.append(settled)
    g1.fake.answers.append(replace(settled))
    g2.fake.gate.clear()  # its answer lost: the lighthouse silent to it
    g2.fake.silent = 1.0
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 6.0])]
    out = _step_all((g0, g1, g2), grads)
    g2.fake.answers.append(settled)  # its late answer, dropped
    g2.fake.gate.set()
    assert out == [True, True, True], (g0.mgr.errors, g1.mgr.errors, g2.mgr.errors)
    assert all(torch.equal(g, torch.tensor([3.0, 4.0])) for g in grads)  # one exchange of all three
    recs = [g.last_record() for g in (g0, g1, g2)]
    assert [r["leased"] for r in recs] == [False, False, True] and {r["quorum_id"] for r in recs} == {3}
    assert g0.mgr.step == g1.mgr.step == g2.mgr.step == 7


def test_with_nobody_aside_a_lease_after_the_heal_goes_on_in_the_heal_quorums_group(groups):
    """Two groups: the healer and its source were both in the heal step's exchange (nobody else
    was left to stand aside). The lighthouse's next answer is the same quorum, heals done, and
    its members keep their process group; one that missed that answer and goes on under its
    lease must keep it too (before: it built a settled group and waited there alone until the
    collective timeout)."""
    g0, g1, votes, _ = _heal_pair(groups)
    assert votes == [True, True]
    pg = g0.mgr._xg.pg
    assert pg is not None
    g0.fake.answers.append(quorum(3, groups=(0, 1), max_step=6, store=g0.fake.info.store))
    g1.fake.gate.clear()  # its answer lost: the lighthouse silent to it
    g1.fake.silent = 1.0
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    out = _step_all((g0, g1), grads)
    g1.fake.answers.append(quorum(3, groups=(0, 1), max_step=6))  # its late answer, dropped
    g1.fake.gate.set()
    assert out == [True, True], (g0.mgr.errors, g1.mgr.errors)
    assert all(torch.equal(g, torch.tensor([2.0, 3.0])) for g in grads)
    assert g0.mgr._xg.pg is pg and g1.last_record()["leased"] and g0.mgr.step == g1.mgr.step == 7


def test_a_failed_exchange_fails_the_members_aside_at_once(groups):
    # group 2 fails in the exchange: it offers "failed" for the step, so nobody aside waits for it
    (g0, g1, g2), votes, _ = _heal_trio(groups, faults2=[Fault("raise", group=2, at_step=5, phase="before_allreduce")])
    assert votes == [False, False, False]
    told = "update: the exchange of step 5 in quorum 3 did not complete"  # told, not timed out
    assert g0.mgr.errors == [told] and g1.mgr.errors == [told], (g0.mgr.errors, g1.mgr.errors)
    assert g0.mgr.step == 5 and g1.mgr.step == 5  # group 1's heal still loaded the state (at step 5)


def test_a_leased_step_never_applies_its_late_reply(groups):
    """The lighthouse goes silent in step 2: the step runs on its lease in the last quorum and
    commits. The reply to its request comes afterwards; it must change nothing (it belongs to
    a round that went on without it), and the next round reports the quorum it trained in."""
    q1 = quorum(1, lighthouse_id="lh-1")
    late = quorum(2, lighthouse_id="lh-2", max_step=9)
    g = groups(q1, late, q1)
    assert g.step(torch.ones(2)) and g.mgr.step == 1
    g.fake.gate.clear()  # step 2's request gets no answer ...
    g.fake.silent = 1.0  # ... and the lighthouse answers nothing else either
    assert g.step(torch.ones(2)) and g.mgr.step == 2
    rec = g.last_record()
    assert rec["leased"] and rec["committed"] and rec["quorum_id"] == 1
    round_2 = g.mgr._r.fut  # that step's background quorum call, still waiting
    g.fake.silent = 0.0
    g.fake.gate.set()  # the late reply arrives
    assert round_2.result(timeout=10) is None  # ... and is dropped, not applied
    assert g.mgr.quorum is q1 and g.fake.info.quorum_id == 1 and not g.mgr.healing
    assert g.step(torch.ones(2)) and g.mgr.step == 3
    assert [(r.info.step, r.info.quorum_id, r.quorum_lighthouse_id) for r in g.fake.requests] == [
        (0, 0, ""),
        (1, 1, "lh-1"),
        (2, 1, "lh-1"),
    ]
    assert not g.last_record()["leased"]
