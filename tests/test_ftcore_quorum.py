"""The quorum decision from tables: ftcore/quorum.py, no server, no sockets, no clock."""

import pytest

from ftcore.quorum import (
    FormationRound,
    Formed,
    HealPlan,
    Hearing,
    Member,
    Wait,
    arrivals_needed,
    decide,
    heartbeat_pace,
    isolated,
    majority,
    plan,
    probe_window,
    resumed,
    waited_for,
)


def _round(previous, requesting, healthy, min_replicas=1, expected=0, waited=False, leasing=()) -> FormationRound:
    prev = frozenset(previous) if previous is not None else None
    return FormationRound(
        prev, frozenset(requesting), frozenset(healthy), min_replicas, expected, waited, frozenset(leasing)
    )


@pytest.mark.parametrize(
    "previous,requesting,healthy,min_replicas,expected,waited,want",
    [
        # fast: every healthy member of the previous quorum asks
        ([0, 1, 2], [0, 1, 2], [0, 1, 2], 1, 3, False, (0, 1, 2)),
        # a failed member (not healthy) is not waited for
        ([0, 1, 2], [0, 1], [0, 1], 1, 3, False, (0, 1)),
        # a healthy member that has not asked yet is waited for, until the join timeout
        ([0, 1, 2], [0, 1], [0, 1, 2], 1, 3, False, "wait"),
        ([0, 1, 2], [0, 1], [0, 1, 2], 1, 3, True, (0, 1)),
        # a new group (not in the previous quorum) does not hold the round up
        ([0, 1], [0, 1], [0, 1, 2], 1, 3, False, (0, 1)),
        # first quorum: the whole job, or the join timeout
        (None, [0, 1], [0, 1], 1, 3, False, "wait"),
        (None, [0, 1, 2], [0, 1, 2], 1, 3, False, (0, 1, 2)),
        (None, [0, 1], [0, 1], 1, 3, True, (0, 1)),
        # never below min_replicas, never a minority of the healthy groups (split brain)
        ([0, 1, 2], [0], [0], 2, 3, True, "wait"),
        ([0, 1, 2, 3], [0, 1], [0, 1, 2, 3], 1, 4, True, "wait"),
        ([0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 3], 1, 4, True, (0, 1, 2)),
        # nobody asking
        ([0, 1], [], [0, 1], 1, 2, True, "wait"),
    ],
)
def test_decide(previous, requesting, healthy, min_replicas, expected, waited, want):
    got = decide(_round(previous, requesting, healthy, min_replicas, expected, waited))
    if want == "wait":
        assert isinstance(got, Wait) and got.reason, got  # a reason, for the quorum_waiting event
    else:
        assert got == Formed(want)


@pytest.mark.parametrize(
    "previous,requesting,healthy,leasing,want",
    [
        # the survivors of a quorum whose others hang: one of its members asks, so none commits there
        ([0, 1, 2], [0], [0], [0, 1, 2], (0,)),
        # a group that stood aside while both members of the last quorum hang (or train on without
        # this lighthouse, cut off): it waits out their lease, never a second history beside theirs
        ([0, 1], [2], [2], [0, 1], "wait"),
        ([0, 1], [2], [2], [], (2,)),  # the lease ran out (or its holders crashed)
        # the lease's holders ask too: they are in the quorum, nobody trains elsewhere
        ([0, 1], [0, 1, 2], [0, 1, 2], [0, 1], (0, 1, 2)),
    ],
)
def test_decide_never_forms_beside_a_lease(previous, requesting, healthy, leasing, want):
    got = decide(_round(previous, requesting, healthy, waited=True, leasing=leasing))
    assert got == Formed(want) if want != "wait" else isinstance(got, Wait) and "lease" in got.reason, got


@pytest.mark.parametrize(
    "requesting,healthy,resumes,want",
    [
        # a restarted lighthouse: the members of the quorum they last trained in all ask, and a
        # group on standby (healthy to it: it forgot the standby) is not waited for
        ([0, 1], [0, 1, 2], True, (0, 1)),
        # ... but not a part of that quorum (its others may train on in it under their lease)
        ([1], [0, 1, 2], False, "wait"),
        ([0, 1], [0, 1, 2], False, "wait"),
        # and never a minority of the healthy groups
        ([0], [0, 1, 2], True, "wait"),
    ],
)
def test_decide_resumes_the_quorum_its_members_all_ask_for(requesting, healthy, resumes, want):
    r = FormationRound(None, frozenset(requesting), frozenset(healthy), 1, 3, False, resumes=resumes)
    got = decide(r)
    assert got == Formed(want) if want != "wait" else isinstance(got, Wait), got


@pytest.mark.parametrize(
    "last,key,want",
    [
        # every rank names one quorum of exactly them
        ([(7, "lh", "k", False), (7, "lh", "k", False)], "k", (7, "lh", False)),
        ([(7, "lh", "k", True), (7, "lh", "k", True)], "k", (7, "lh", True)),  # ... settled after its heals
        ([(7, "lh", "k", False), (7, "lh", "k", True)], "k", None),  # one rank in the heal step's group, one settled
        ([(7, "lh", "k", False), (6, "lh", "k", False)], "k", None),  # one rank remembers an older one
        ([(7, "lh", "k", False), (7, "lh", "j", False)], "k", None),  # ... or other members
        ([(7, "lh", "j", False), (7, "lh", "j", False)], "k", None),  # that quorum had other members than these
        ([(0, "", "", False), (7, "lh", "k", False)], "k", None),  # a rank that never trained: a first quorum
        ([], "k", None),
    ],
)
def test_resumed(last, key, want):
    assert resumed(iter(last), key) == want


@pytest.mark.parametrize(
    "previous,members,finished,want",
    [
        # everyone at the same step in the previous quorum: nobody heals
        ({(0, 0), (1, 0)}, [Member(0, 0, 7, 3), Member(1, 0, 7, 3)], 0, HealPlan(7, {})),
        # a restarted group (new incarnation) heals from a member of the previous quorum
        ({(0, 0), (1, 0)}, [Member(0, 0, 7, 3), Member(1, 1, 0, 0)], 0, HealPlan(7, {1: 0})),
        # a group left out of the previous quorum heals even at an equal (or higher) step:
        # it may hold a step the others discarded
        ({(0, 0), (1, 0)}, [Member(0, 0, 7, 3), Member(1, 0, 7, 3), Member(2, 0, 8, 2)], 0, HealPlan(7, {2: 0})),
        # healers spread over the sources in turn
        (
            {(0, 0), (1, 0)},
            [Member(0, 0, 7, 3), Member(1, 0, 7, 3), Member(2, 5, 0, 0), Member(3, 5, 0, 0)],
            0,
            HealPlan(7, {2: 0, 3: 1}),
        ),
        # after a lighthouse restart: trust those that report the latest quorum
        (None, [Member(0, 0, 9, 4), Member(1, 0, 12, 3)], 0, HealPlan(9, {1: 0})),
        # no trusted member at all: everyone is trusted, the furthest step wins
        ({(5, 0)}, [Member(0, 0, 3, 1), Member(1, 0, 4, 1)], 0, HealPlan(4, {0: 1})),
        # the job finished beyond what these groups hold: no history of their own
        ({(0, 0)}, [Member(1, 2, 0, 0)], 10, None),
        ({(0, 0)}, [Member(0, 0, 10, 1)], 10, HealPlan(10, {})),
    ],
)
def test_plan(previous, members, finished, want):
    assert plan(frozenset(previous) if previous is not None else None, members, finished) == want


@pytest.mark.parametrize(
    "silent,live,accused,want",
    [
        (3, 3, False, True),  # everyone quiet at once: the lighthouse is the one cut off
        (2, 3, False, True),  # most quiet, and the one it hears says nothing against them
        (1, 3, False, False),  # one quiet while the others speak: its own silence is evidence
        (1, 2, False, False),  # a hung group of two is still found by the heartbeat timeout
        (2, 2, False, True),
        (1, 1, False, False),  # a job of one group: nothing to compare with
        (0, 4, False, False),
        # a group it still hears reports the silent ones stall it: evidence against them,
        # however many (two of three hung, three of five: a rack switch, a storage stall)
        (2, 3, True, False),
        (3, 5, True, False),
        (4, 5, True, False),
    ],
)
def test_isolated(silent, live, accused, want):
    assert isolated(Hearing(live, silent, accused)) is want


@pytest.mark.parametrize(
    "speakers, budget, timeout, want",
    [
        (16, 4000.0, 2.0, 0.0),  # within the budget: every speaker keeps its own pace
        (200, 4000.0, 2.0, 0.0),  # 0.05 s apart is a rank's own pace
        (1562, 4000.0, 2.0, 0.391),
        (100_000, 4000.0, 2.0, 0.5),  # never past a quarter of the heartbeat timeout
        (100_000, 4000.0, 10.0, 2.5),
    ],
)
def test_heartbeat_pace(speakers, budget, timeout, want):
    assert heartbeat_pace(speakers, budget, timeout) == want


@pytest.mark.parametrize("probe, pace, want", [(0.2, 0.0, 0.2), (0.2, 0.1, 0.2), (0.2, 0.5, 0.6), (0.1, 0.5, 0.55)])
def test_probe_window_covers_one_beat(probe, pace, want):
    assert probe_window(probe, pace) == pytest.approx(want)


# the last quorum (groups 0-2, group 2 healing from 0, id 3, at step 121); each request's
# (group, last quorum id applied, step): the members the next round waits for
@pytest.mark.parametrize(
    "heal,asked,waits",
    [
        # its members went on under quorum 2's lease past step 121: it never ran, nobody offered
        # group 2 its state, so the round does not wait for group 2 (5 s in the fault matrix)
        ({2: 0}, [(0, 2, 159), (1, 2, 159)], {0, 1}),
        ({2: 0}, [(1, 2, 130)], {0, 1}),  # one of them says so: the exchange needed both
        ({2: 0}, [(0, 3, 122), (1, 3, 122)], {0, 1, 2}),  # it ran: the healer is waited for
        ({2: 0}, [(0, 2, 121), (1, 2, 121)], {0, 1, 2}),  # a retry of its own step: the same answer again
        ({2: 0}, [(2, 1, 0)], {0, 1, 2}),  # the healer itself never applied a quorum before: no evidence
        ({}, [(0, 2, 159), (1, 2, 159)], {0, 1, 2}),  # no healer: every member, as before
        ({2: 0}, [], {0, 1, 2}),
    ],
)
def test_the_next_round_waits_for_a_heal_quorums_healers_only_if_it_ran(heal, asked, waits):
    assert waited_for((0, 1, 2), heal, 3, 121, asked) == waits


@pytest.mark.parametrize(
    "previous, healthy, expected, min_replicas, need",
    [
        ({0, 1, 2}, {0, 1, 2}, 0, 1, 3),  # steady: every member of the last quorum
        ({0, 1, 2}, {0, 1}, 0, 1, 2),  # a member failed: not waited for
        ({0, 1, 2}, {0, 1, 2, 3, 4}, 0, 1, 3),  # two new groups: still a majority of five
        ({0}, {0, 1, 2, 3}, 0, 1, 3),  # one member of four healthy: a majority is three
        (None, {0, 1}, 3, 1, 3),  # a first quorum waits for the job's expected groups
        (None, {0, 1, 2}, 0, 1, 3),  # ... or every healthy group
        ({0, 1}, {0, 1}, 0, 3, 3),  # min_replicas above everything
        (None, set(), 0, 1, 1),  # nobody healthy: one arrival is worth a try (it is told why it waits)
    ],
)
def test_arrivals_needed_from_a_table(previous, healthy, expected, min_replicas, need):
    prev = frozenset(previous) if previous is not None else None
    assert arrivals_needed(prev, frozenset(healthy), expected, min_replicas) == need


def test_fewer_arrivals_than_needed_never_form_on_the_fast_path():
    """What arrivals_needed promises: below it, decide (not yet waited) never forms; at it, with
    the fast path's members asking, it does."""
    for h in range(1, 8):
        healthy = frozenset(range(h))
        for prev_n in range(0, h + 1):
            previous = frozenset(range(prev_n)) if prev_n else None
            need = arrivals_needed(previous, healthy, 0, 1)
            for n in range(0, h + 1):
                asking = frozenset(range(n))
                got = decide(FormationRound(previous, asking, healthy, 1, 0, False))
                assert (n >= need) == isinstance(got, Formed), (h, prev_n, n, need, got)
    assert [majority(h) for h in range(6)] == [1, 1, 2, 2, 3, 3]
