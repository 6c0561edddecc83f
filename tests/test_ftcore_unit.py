"""ftcore pieces in one process: tensor files, the make-up schedule, the ledger, fault plans,
the lighthouse's quorum rules over real HTTP, the heal server, and FTAR over real gloo
groups (one thread per replica group)."""

import datetime
import json
import random
import threading
import time
import urllib.request

import pytest
import torch
import torch.distributed as dist
from conftest import ask_all

from ftcore import faults, heal, ledger, tensorfile
from ftcore.ftar import FTARError, ftar
from ftcore.lighthouse_client import LighthouseClient, call
from ftcore.messages import Quorum, QuorumRequest, RankInfo
from ftcore.schedule import MakeupSchedule


# ---- tensor files ------------------------------------------------------------------------
def test_tensorfile_roundtrip_model_optimizer_and_rng(tmp_path):
    m = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 5)).sum().backward()
    opt.step()
    tree = {
        "model": m.state_dict(),
        "opt": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "misc": (1, 2.5, None, "x", [True, b"\x00\x01"]),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(7, dtype=torch.int64),
    }
    path = tmp_path / "s.safetensors"
    tensorfile.save(tree, str(path), {"step": "3"})
    back, meta = tensorfile.read(open(path, "rb"))
    assert meta == {"step": "3"}
    assert back["misc"] == tree["misc"]
    assert back["opt"]["param_groups"] == tree["opt"]["param_groups"]
    for k, v in tree["model"].items():
        assert torch.equal(back["model"][k], v)
    assert torch.equal(back["rng"], tree["rng"]) and back["bf16"].dtype == torch.bfloat16
    assert back["empty"].shape == (0, 4) and int(back["scalar"]) == 7
    opt2 = torch.optim.AdamW(m.parameters())
    opt2.load_state_dict(back["opt"])  # loads into a real optimizer


def test_tensorfile_is_safetensors_layout():
    raw = tensorfile.dumps({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert header["w"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert (8 + n) % 8 == 0
    assert torch.equal(torch.frombuffer(bytearray(raw[8 + n :]), dtype=torch.float32), torch.arange(6.0))


def test_tensorfile_refuses_non_tensor_objects_and_garbage():
    with pytest.raises(TypeError, match="cannot store"):
        tensorfile.dumps({"f": object()})
    with pytest.raises(tensorfile.FormatError):
        tensorfile.loads(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")


# ---- schedule and ledger ---------------------------------------------------------------------
def _simulate(steps, groups, epochs, down_prob, seed):
    """Drive the schedule through random outages; return the committed (epoch, rg, contributors)."""
    rnd = random.Random(seed)
    s = MakeupSchedule(steps, groups, epochs, seed=seed)
    log, n = [], 0
    while not s.done:
        n += 1
        assert n < 10_000, "schedule never finished"
        live = {g for g in range(groups) if rnd.random() > down_prob} or {rnd.randrange(groups)}
        pos = s.position(live)
        if pos is None:
            continue
        contributors = {g for g in live if s.works(pos, g)}
        if not contributors:
            continue
        s.commit(pos, contributors)
        # what each contributor trained: (owner of the shards, epoch, row group)
        log.append(([pos.piece(g) for g in sorted(contributors)], pos.kind))
    return log


@pytest.mark.parametrize("seed", range(20))
def test_schedule_trains_every_bucket_exactly_once_per_epoch(seed):
    steps, groups, epochs = 7, 3, 2
    log = _simulate(steps, groups, epochs, down_prob=0.3, seed=seed)
    for e in range(epochs):
        seen = [(o, rg) for pieces, _ in log for o, ep, rg in pieces if ep == e]
        assert sorted(seen) == sorted((g, rg) for g in range(groups) for rg in range(steps))
    assert {kind for _, kind in log} == {"regular", "makeup"}


def test_makeup_is_spread_over_the_live_groups_and_does_not_wait_for_the_owner():
    """Group 2 misses 4 batches and stays away: groups 0 and 1 make them up, two per step,
    reading group 2's shards; the epoch then ends without it."""
    s = MakeupSchedule(4, 3, 1, seed=0)
    for _ in range(4):
        s.commit(s.position({0, 1}), {0, 1})
    assert s.in_makeup and s.makeup == [[0, rg, [2]] for rg in range(4)]
    pos = s.position({0, 1})
    assert pos.kind == "makeup" and pos.pieces == ((0, 2, 0, 0), (1, 2, 0, 1))
    assert pos.piece(0) == (2, 0, 0) and pos.piece(2) is None and not s.works(pos, 2)
    s.commit(pos, {0})  # group 1's piece was not trained (it sent zeros): still owed
    assert s.makeup == [[0, rg, [2]] for rg in (1, 2, 3)]
    pos = s.position({0, 1, 2})  # the owner is back: it trains its own first
    assert pos.pieces == ((0, 2, 0, 2), (1, 2, 0, 3), (2, 2, 0, 1))
    s.commit(pos, {0, 1, 2})
    # the data is done, but not known to be done everywhere: the round that trained the last
    # batch does not count (a group may have failed its vote; the next round heals it)
    assert s.done and not s.finished()
    # a round without group 2 (away, or healing): the others wait for it (a slow one is
    # readmitted in their idle rounds)
    assert s.position({0, 1}) is None and not s.finished()
    assert s.position({0, 1, 2}) is None and s.finished()  # a round with every group live


def test_a_step_budget_spent_mid_epoch_ends_the_run_only_with_every_group_back():
    """train.max_steps ending mid-epoch (`spent`): no more work, and the run ends as at the
    data's end, once a round has had every group live; a group behind is not left alone."""
    s = MakeupSchedule(10, 2, 1, seed=0)
    for _ in range(3):
        s.commit(s.position({0, 1}), {0, 1})
    assert not s.done and not s.finished() and s.position({1}, spent=False).kind == "regular"
    assert not s.finished(spent=True)  # the round that trained the last batch does not count
    assert s.position({1}, spent=True) is None and not s.finished(spent=True)  # group 0 is away
    assert s.position({0, 1}, spent=True) is None and s.finished(spent=True)


def test_schedule_without_failures_has_no_makeup_steps_and_survives_state_roundtrip():
    s = MakeupSchedule(4, 2, 2, seed=1)
    t = MakeupSchedule(4, 2, 2, seed=1)
    while not s.done:
        pos = s.position({0, 1})
        assert pos.kind == "regular"
        s.commit(pos, {0, 1})
        t.load_state_dict(tensorfile.loads(tensorfile.dumps(s.state_dict())))
        assert t.state_dict() == s.state_dict()
    assert s.order(1) != list(range(4)) or s.order(2) != list(range(4))


def test_ledger_check_proves_exactly_once_and_catches_duplicates(tmp_path):
    K, steps = 2, 3
    ids = lambda shard, rg: list(range((shard * steps + rg) * 4, (shard * steps + rg) * 4 + 4))  # noqa: E731
    writers = {(g, k): ledger.Ledger(str(tmp_path / "ok"), g, k) for g in range(2) for k in range(K)}
    for step, rg in enumerate(range(steps)):
        for (g, k), w in writers.items():
            w.record(step, 0, rg, "regular", {0, 1}, 1, ids(g * K + k, rg))
    summary = ledger.check(
        str(tmp_path / "ok"), steps_per_epoch=steps, num_groups=2, ranks_per_group=K, epochs=1, sample_ids=ids
    )
    assert summary["steps"] == steps and summary["batches"] == steps * 2 * K
    bad = ledger.Ledger(str(tmp_path / "bad"), 0, 0)
    for step, rg in enumerate([0, 1, 1]):  # row group 1 twice, 2 never
        bad.record(step, 0, rg, "regular", {0}, 1)
    with pytest.raises(ledger.LedgerError, match="twice"):
        ledger.check(str(tmp_path / "bad"), steps_per_epoch=3, num_groups=1, ranks_per_group=1, epochs=1)
    assert ledger.ranges([5, 1, 2, 3, 9]) == [[1, 3], [5, 5], [9, 9]]


@pytest.mark.parametrize("mistake", [None, "ids", "twice"])
def test_ledger_check_credits_makeup_pieces_to_the_shards_trained(tmp_path, mistake):
    """Group 1 missed row groups 1 and 2; group 0 makes up row group 2 from group 1's shards
    while group 1 makes up its own row group 1. A helper's ids must be the owner's rows."""
    steps = 3
    ids = lambda shard, rg: [shard * 100 + rg]  # noqa: E731
    w = {g: ledger.Ledger(str(tmp_path), g, 0) for g in range(2)}
    for g in range(2):
        w[g].record(0, 0, 0, "regular", {0, 1}, 1, ids(g, 0))
        for step, rg in ((1, 1), (2, 2)):
            w[g].record(step, 0, rg, "regular", {0}, 2, ids(0, rg) if g == 0 else None)
        pieces = [(0, 1, 0, 2), (1, 1, 0, 1)]
        if mistake == "twice":  # group 0 trains group 1's row group 1 as well
            pieces = [(0, 1, 0, 1), (1, 1, 0, 1)]
        theirs = ids(0 if mistake == "ids" and g == 0 else 1, dict((h, rg) for h, _, _, rg in pieces)[g])
        w[g].record(3, 0, 2, "makeup", {0, 1}, 3, theirs, pieces=pieces)
    args = {"steps_per_epoch": steps, "num_groups": 2, "ranks_per_group": 1, "epochs": 1, "sample_ids": ids}
    if mistake is None:
        assert ledger.check(str(tmp_path), **args) == {"steps": 4, "makeup_steps": 1, "epochs": 1, "batches": 6}
    else:
        with pytest.raises(ledger.LedgerError, match="the shard has" if mistake == "ids" else "twice"):
            ledger.check(str(tmp_path), **args)


# ---- fault plans -------------------------------------------------------------------------------
def test_fault_plan_parses_toml_and_rejects_mistakes(tmp_path):
    p = tmp_path / "plan.toml"
    p.write_text(
        '[[faults]]\nkind = "kill"\ngroup = 1\nat_step = 5\n\n'
        '[[faults]]\nkind = "raise"\ngroup = 0\nat_step = 3\nphase = "during_allreduce"\n'
    )
    fs = faults.load(str(p))
    assert [f.kind for f in fs] == ["kill", "raise"] and fs[1].in_process and not fs[0].in_process
    p.write_text('[[faults]]\nkind = "explode"\nat_step = 1\n')
    with pytest.raises(faults.PlanError, match="kind 'explode'"):
        faults.load(str(p))
    p.write_text('[[faults]]\nkind = "raise"\nat_step = 1\n')
    with pytest.raises(faults.PlanError, match="needs a phase"):
        faults.load(str(p))
    inj = faults.Injector(faults.parse([{"kind": "raise", "group": 0, "at_step": 2, "phase": "vote"}]), 0, 0, 0)
    inj.phase("vote", 1)
    with pytest.raises(faults.InjectedFault):
        inj.phase("vote", 2)
    inj.phase("vote", 3)  # fires once


# ---- lighthouse over HTTP ------------------------------------------------------------------------
def _client(addr, g, token=None, step=0):
    info = RankInfo(group=g, rank=0, world=1, store=f"127.0.0.1:{1000 + g}", heal=f"127.0.0.1:{2000 + g}", step=step)
    c = LighthouseClient(addr, info, token=token)
    c.start_heartbeats()
    return c


def _clients(addr, n, token=None, steps=None):
    return [_client(addr, g, token, (steps or [0] * n)[g]) for g in range(n)]


def test_lighthouse_quorum_heal_assignment_and_fast_reform(lighthouse):
    addr, lh = lighthouse(min_replicas=1, expected_replicas=4, join_timeout=5.0, heartbeat_timeout=1.0)
    cs = _clients(addr, 4, steps=[10, 10, 7, 3])
    try:
        qs = ask_all(cs)
        assert len({q.quorum_id for q in qs}) == 1 and qs[0].groups == (0, 1, 2, 3)
        assert qs[0].max_step == 10
        assert qs[0].heal == {2: 0, 3: 1}  # spread over the up-to-date groups
        assert [q.heal_from for q in qs] == ["", "", "127.0.0.1:2000", "127.0.0.1:2001"]  # each its source's
        first = qs[0].quorum_id
        # same members again: same quorum id (no process-group rebuild)
        for c in cs:
            c.update(step=11)
        assert {q.quorum_id for q in ask_all(cs)} == {first}
        # a member dies (its heartbeat connection closes): the others re-form at once
        cs[3].close()
        qs = ask_all(cs[:3])
        assert qs[0].groups == (0, 1, 2) and qs[0].quorum_id > first
        events = lh.status()["events"]
        kinds = [e["kind"] for e in events]
        assert kinds.count("quorum_formed") == 2
        # found by its closed connection, not by the 1 s heartbeat timeout; and the round did
        # not wait for it (a round stuck for over a second says so: quorum_waiting)
        detected = [e for e in events if e["kind"] == "failure_detected"]
        assert [(e["group"], e["reason"]) for e in detected] == [(3, "connection closed")], detected
        assert kinds.index("failure_detected") < len(kinds) - 1 - kinds[::-1].index("quorum_formed")
        assert "quorum_waiting" not in kinds, events
    finally:
        for c in cs:
            c.close()


def test_the_quorum_after_a_heal_is_the_heal_quorum_settled_where_a_lease_goes_on(lighthouse) -> None:
    """Group 2 heals from group 0 (both aside) while group 1 alone is the exchange. The next round,
    the heals done, is the heal quorum settled: the same id, every member in one exchange at the
    same rendezvous (rank k of group 1, the heal quorum's first in its exchange), exactly what a
    member that missed this answer goes on in under its lease (Quorum.settle). A lighthouse cut
    just as it answered once kept two members in a new quorum's rendezvous and the third in the
    settled one, each waiting for the other until the collective timeout."""
    addr, lh = lighthouse(min_replicas=1, expected_replicas=3, join_timeout=5.0, heartbeat_timeout=2.0)
    cs = _clients(addr, 3, steps=[10, 10, 7])
    try:
        heal = ask_all(cs)
        assert heal[0].heal == {2: 0} and heal[0].exchange() == (1,), heal[0]
        assert {q.store for q in heal} == {"127.0.0.1:1001"}
        for c in cs:
            c.update(step=11, quorum_id=heal[0].quorum_id)
        after = ask_all(cs)
        leased = heal[2].settle()  # what group 2 builds when it misses the answer (the lighthouse silent)
        for q in after:
            assert (q.quorum_id, q.settled, q.heal, q.store) == (heal[0].quorum_id, True, {}, "127.0.0.1:1001"), q
            assert q.key == leased.key and q.exchange() == leased.exchange() == (0, 1, 2)
        for c in cs:
            c.update(step=12)
        again = ask_all(cs)  # the same members again: the settled quorum stands (no rebuild)
        assert {(q.quorum_id, q.settled, q.store) for q in again} == {(heal[0].quorum_id, True, "127.0.0.1:1001")}
        formed = [e for e in lh.status()["events"] if e["kind"] == "quorum_formed"]
        assert [e.get("settled", False) for e in formed] == [False, True], formed
        # nobody aside (the healer's source the only other member): its exchange already held
        # every member, and a lease goes on in the same process group
        two = Quorum(5, "lh", "j", ((0, 0), (1, 0)), (0, 1), 3, {1: 0}, 10.0)
        assert not two.aside() and two.settle().key == two.key and two.settle().heal == {}
    finally:
        for c in cs:
            c.close()


def test_a_leased_rounds_late_request_is_overtaken_not_healed(lighthouse) -> None:
    """As a lighthouse pause ends, groups that finished step 34 on their lease send 34's request
    late, while a peer already asks for 35: forming those together would heal the leased groups
    to 35 and leave the peer waiting for requests they never send. The late ones are told they
    were overtaken; the round forms once every group asks for 35, with nobody to heal."""
    from ftcore.lighthouse_client import Overtaken

    addr, lh = lighthouse(min_replicas=1, expected_replicas=3, join_timeout=5.0, heartbeat_timeout=2.0)
    cs = _clients(addr, 3, steps=[34, 34, 34])
    try:
        assert all(isinstance(q, Quorum) for q in ask_all(cs))  # the quorum all three trained in
        late = [QuorumRequest(c.info, leased=True) for c in cs[:2]]
        cs[2].update(step=35)
        out: list = [None] * 3
        ts = [
            threading.Thread(target=lambda i=i: out.__setitem__(i, _quorum_or_error(cs[i], late[i]))) for i in range(2)
        ]
        ts.append(threading.Thread(target=lambda: out.__setitem__(2, _quorum_or_error(cs[2], None))))
        ts[2].start()
        time.sleep(0.1)  # the peer asks first; the leased requests arrive after it
        for t in ts[:2]:
            t.start()
        for t in ts[:2]:
            t.join(5)
        assert all(isinstance(o, Overtaken) for o in out[:2]), out
        assert ts[2].is_alive()  # the peer still waits: its request was not spent
        for c in cs[:2]:
            c.update(step=35)
        qs = ask_all(cs[:2])
        ts[2].join(5)
        for q in qs + [out[2]]:
            assert isinstance(q, Quorum) and q.max_step == 35 and q.heal == {}, q
        assert "heal_assigned" not in [e["kind"] for e in lh.status()["events"]]
        # a malformed flag is a 400, not state
        code, body = call(addr, "/quorum", {**cs[0].info.to_wire(), "leased": "yes", "timeout": 2.0}, None)
        assert code == 400 and "leased" in body["error"], body
    finally:
        for c in cs:
            c.close()


def _quorum_or_error(client, request):
    try:
        return client.quorum(5.0, request=request)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e


def test_lighthouse_a_group_leaving_rank_by_rank_is_not_a_failure(lighthouse):
    """K = 2: the first rank's goodbye leaves the group short of a rank; that is a clean exit
    in progress, not a failure (a real failure still is, see the test above)."""
    addr, lh = lighthouse(min_replicas=1, heartbeat_timeout=0.3)
    cs = [LighthouseClient(addr, RankInfo(group=0, rank=r, world=2)) for r in range(2)]
    try:
        for c in cs:
            c.start_heartbeats()
        time.sleep(0.3)
        cs[0].leave()
        time.sleep(0.8)  # past the heartbeat timeout of the rank that left
        cs[1].leave()
        kinds = [e["kind"] for e in lh.status()["events"]]
        assert "group_healthy" in kinds and kinds.count("group_left") == 1
        assert "failure_detected" not in kinds, kinds
    finally:
        for c in cs:
            c.close()


def test_lighthouse_min_replicas_majority_and_join_timeout(lighthouse):
    addr, _ = lighthouse(min_replicas=2, join_timeout=0.3, heartbeat_timeout=2.0)
    cs = _clients(addr, 3)
    try:
        time.sleep(0.2)  # all three heartbeat: healthy
        with pytest.raises(Exception, match="no quorum"):
            cs[0].quorum(timeout=0.8)  # one of three: below min_replicas and no majority
        qs = ask_all(cs[:2], timeout=3.0)  # two of three: after the join timeout
        assert qs[0].groups == (0, 1) and qs[1].groups == (0, 1)
    finally:
        for c in cs:
            c.close()


def test_a_first_quorum_waits_for_an_expected_group_still_starting(lighthouse):
    """Group 1 asks while group 0's processes still start (it has not spoken): past the join
    timeout the round still waits, or a short job could end before group 0 joins (it would find
    the job finished and report nothing). The start timeout bounds that wait."""
    addr, lh = lighthouse(expected_replicas=2, join_timeout=0.2, start_timeout=30.0)
    g1 = _client(addr, 1)  # group 0 has not spoken yet
    out: list = []
    asking = threading.Thread(target=lambda: out.append(_quorum_or_error(g1, None)))
    asking.start()
    try:
        time.sleep(1.0)  # five join timeouts
        assert not out and "quorum_formed" not in [e["kind"] for e in lh.status()["events"]]
        g0 = _client(addr, 0)
        try:
            q0 = g0.quorum(5.0)
            asking.join(5)
            assert q0.groups == (0, 1) and out[0].groups == (0, 1), out
        finally:
            g0.close()
    finally:
        g1.close()
    addr, _ = lighthouse(expected_replicas=2, join_timeout=0.2, start_timeout=0.6)
    alone, t0 = _client(addr, 1), time.monotonic()
    try:
        assert alone.quorum(5.0).groups == (1,) and time.monotonic() - t0 >= 0.5  # past the start timeout
    finally:
        alone.close()


def test_lighthouse_refuses_requests_without_the_token(lighthouse):
    addr, _ = lighthouse(token="s3cret")
    assert call(addr, "/status", None, None, method="GET")[0] == 401
    assert call(addr, "/status", None, "wrong", method="GET")[0] == 401
    assert call(addr, "/heartbeat", {"group": 0, "rank": 0}, None)[0] == 401
    assert call(addr, "/quorum", {"group": 0, "rank": 0}, None)[0] == 401
    code, st = call(addr, "/status", None, "s3cret", method="GET")
    assert code == 200 and st["groups"] == []
    page = urllib.request.Request(f"http://{addr}/", headers={"Authorization": "Bearer s3cret"})
    with urllib.request.urlopen(page) as r:
        assert b"ftcore lighthouse" in r.read()
    assert call(addr, "/status?token=s3cret", None, None, method="GET")[0] == 401  # header only


def test_lighthouse_restart_resumes_quorum_ids_and_steps(lighthouse):
    addr, lh = lighthouse(expected_replicas=2)
    cs = _clients(addr, 2, steps=[5, 5])
    try:
        qid = ask_all(cs)[0].quorum_id
    finally:
        for c in cs:
            c.close()
    addr2, lh2 = lighthouse(expected_replicas=2)  # a fresh lighthouse: no memory of the job
    cs = _clients(addr2, 2, steps=[5, 5])
    for c in cs:
        c.update(quorum_id=qid)
    try:
        qs = ask_all(cs)
        assert qs[0].quorum_id > qid and qs[0].max_step == 5 and qs[0].heal == {}
    finally:
        for c in cs:
            c.close()


# ---- heal server ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "groups, heal, aside, exchange, live",
    [
        ((0, 1, 2), {}, set(), (0, 1, 2), {0, 1, 2}),
        ((0, 1, 2), {1: 0}, {0, 1}, (2,), {2}),  # healer and source out of the exchange
        ((0, 1, 2, 3), {3: 1, 2: 1}, {1, 2, 3}, (0,), {0}),  # two healers, one source
        ((0, 1), {1: 0}, set(), (0, 1), {0}),  # nobody else: the source trains, the healer sends zeros
        ((0, 1, 2), {0: 2, 1: 2}, set(), (0, 1, 2), {2}),
    ],
)
def test_the_healing_groups_and_their_sources_stand_aside_when_others_can_exchange(groups, heal, aside, exchange, live):
    q = Quorum(
        quorum_id=1,
        lighthouse_id="lh",
        job="j",
        identity=tuple((g, 0) for g in groups),
        groups=groups,
        max_step=3,
        heal=heal,
        lease_s=1.0,
    )
    assert q.aside() == aside and q.exchange() == exchange and q.live() == live
    wire = Quorum.parse(json.loads(Quorum.for_rank(q.shared_json(), "h:1", "h:2", "h:3")))
    assert (wire.store, wire.heal_from, wire.update_from) == ("h:1", "h:2", "h:3") and wire.aside() == aside


def test_a_heal_server_offers_a_steps_average_beside_its_snapshot():
    srv = heal.HealServer(token="tok")
    try:
        srv.offer(3, {"w": torch.ones(2)})
        srv.offer(3, {"average": [torch.full((2,), 5.0)]}, kind="update")
        assert torch.equal(heal.fetch(srv.address, 3, "tok")["w"], torch.ones(2))  # the snapshot stands
        got = heal.fetch(srv.address, 3, "tok", kind="update")
        assert torch.equal(got["average"][0], torch.full((2,), 5.0))
        with pytest.raises(heal.HealError, match="404"):
            heal.fetch(srv.address, 3, "tok", kind="gradients")
        srv.withdraw("update")  # served: its copy of the gradients is not kept
        with pytest.raises(heal.HealError, match="504"):
            heal.fetch(srv.address, 3, "tok", kind="update")
        assert torch.equal(heal.fetch(srv.address, 3, "tok")["w"], torch.ones(2))
    finally:
        srv.close()


def test_heal_server_serves_snapshot_to_token_holders_only():
    srv = heal.HealServer(token="tok")
    try:
        w = torch.randn(4, 4)
        orig = w.clone()
        srv.offer(3, {"w": w, "step": 3})
        w.add_(1.0)  # training goes on; the snapshot must not change
        got = heal.fetch(srv.address, 3, "tok")
        assert torch.equal(got["w"], orig) and got["step"] == 3
        with pytest.raises(heal.HealError, match="401"):
            heal.fetch(srv.address, 3, None)
        with pytest.raises(heal.HealError, match="401"):
            heal.fetch(srv.address, 3, "nope")
        srv.offer(4, {"w": w})
        with pytest.raises(heal.HealError, match="410"):
            heal.fetch(srv.address, 3, "tok")
    finally:
        srv.close()


# ---- FTAR over real gloo groups (one thread per replica group) ---------------------------------------
def _groups(n):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pgs = [None] * n

    def make(i):  # each "group" has its own store client, as separate processes would
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        pgs[i] = dist.ProcessGroupGloo(dist.PrefixStore("t", client), i, n, datetime.timedelta(seconds=10))

    ts = [threading.Thread(target=make, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return store, pgs


def _run_all(n, fn):
    out, errs = [None] * n, [None] * n

    def go(i):
        try:
            out[i] = fn(i)
        except Exception as e:
            errs[i] = e

    ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=20)
    return out, errs


def test_ftar_averages_over_contributors_with_zeros_from_healers():
    store, pgs = _groups(3)
    big = [torch.full((300_000,), float(i + 1)) for i in range(3)]  # chunked in place
    small = [[torch.full((3, 2), float(10 * (i + 1))), torch.full((5,), -1.0 * (i + 1))] for i in range(3)]
    res, errs = _run_all(3, lambda i: ftar(pgs[i], [big[i], *small[i]], contribute=(i != 2), bucket_bytes=1 << 18))
    assert errs == [None] * 3
    assert [r.contributors for r in res] == [2, 2, 2] and not any(r.peer_error for r in res)
    for i in range(3):  # (1 + 2) / 2; group 2 healed: its own values did not count
        assert torch.equal(big[i], torch.full((300_000,), 1.5))
        assert torch.equal(small[i][0], torch.full((3, 2), 15.0))
        assert torch.equal(small[i][1], torch.full((5,), -1.5))


def test_ftar_costs_one_collective_per_bucket_and_carries_its_control_in_the_first(monkeypatch):
    """The contributor count, step check and error flag ride in the first bucket: a healthy
    step issues exactly one collective per bucket; a call with no packed float bucket (only
    large tensors) sends the four control numbers as one bucket of their own."""
    from ftcore import collectives as coll
    from ftcore.ftar import plan

    calls = []
    real = coll._issue
    monkeypatch.setattr(coll, "_issue", lambda kind, ts, fn: (calls.append(kind), real(kind, ts, fn))[1])
    store, pgs = _groups(2)
    make = lambda i: [torch.full((300_000,), float(i + 1)), torch.full((7,), float(i + 1))]  # noqa: E731
    ts = [make(i) for i in range(2)]
    res, errs = _run_all(2, lambda i: ftar(pgs[i], ts[i], contribute=True, bucket_bytes=1 << 18))
    assert errs == [None, None] and [r.contributors for r in res] == [2, 2]
    assert len(calls) == 2 * len(plan(make(0), 1 << 18)) and set(calls) == {"data"}
    assert torch.equal(ts[0][0], torch.full((300_000,), 1.5)) and torch.equal(ts[1][1], torch.full((7,), 1.5))
    calls.clear()
    big = [[torch.full((300_000,), float(i + 1))] for i in range(2)]  # chunks only: the meta goes alone
    res, errs = _run_all(2, lambda i: ftar(pgs[i], big[i], contribute=True, bucket_bytes=1 << 18))
    assert errs == [None, None] and torch.equal(big[1][0], torch.full((300_000,), 1.5))
    assert len(calls) == 2 * (len(plan(big[0], 1 << 18)) + 1)


def test_ftar_refuses_members_at_different_steps():
    store, pgs = _groups(2)
    res, errs = _run_all(2, lambda i: ftar(pgs[i], [torch.ones(100)], contribute=True, step=7 + i))
    assert all(isinstance(e, FTARError) and "not all at step" in str(e) for e in errs), errs


def test_ftar_error_during_reduce_flags_the_step_on_every_group():
    store, pgs = _groups(2)

    def boom():
        raise RuntimeError("injected")

    res, errs = _run_all(
        2, lambda i: ftar(pgs[i], [torch.ones(1000)], contribute=True, during=boom if i == 1 else None)
    )
    assert errs == [None, None] and all(r.peer_error for r in res)


def test_ftar_times_out_on_a_silent_peer_instead_of_hanging():
    store, pgs = _groups(2)
    # group 1 never joins: FTAR's own deadline ends the wait ("timed out"), not gloo's 10 s
    # timeout of the group (that error would be wrapped as "FTAR bucket 0: RuntimeError: ...")
    with pytest.raises(FTARError, match=r"^FTAR bucket 0: timed out$"):
        ftar(pgs[0], [torch.ones(10)], contribute=True, timeout=0.5)
    store2, pgs2 = _groups(2)
    with pytest.raises(FTARError, match="declared failed"):
        ftar(pgs2[0], [torch.ones(10)], contribute=True, timeout=5.0, is_stale=lambda: True)


def test_ftar_asks_once_when_a_wait_makes_no_progress_and_goes_on_waiting():
    """`on_stall` (the lighthouse's probe) fires once, when a wait has seen no progress for
    `stall_s`; the wait goes on and completes when the late peer arrives."""
    store, pgs = _groups(2)
    asked: list[int] = []

    def run(i):
        if i == 1:
            time.sleep(0.6)  # a late peer
        return ftar(
            pgs[i], [torch.full((5,), float(i))], contribute=True, stall_s=0.2, on_stall=lambda: asked.append(i)
        )

    res, errs = _run_all(2, run)
    assert errs == [None, None] and [r.contributors for r in res] == [2, 2]
    assert len(asked) == 1 and asked[0] == 0  # once, by the one kept waiting
    store3, pgs3 = _groups(2)  # a peer in time: nobody asks
    res, errs = _run_all(
        2, lambda i: ftar(pgs3[i], [torch.ones(3)], contribute=True, stall_s=5.0, on_stall=asked.append)
    )
    assert errs == [None, None] and len(asked) == 1


def test_unknown_backend_is_refused_by_name():
    import datetime

    import torch.distributed as dist

    from ftcore.crossgroup import new_pg as _new_pg

    store = dist.HashStore()
    with pytest.raises(ValueError, match="FTCORE_BACKEND"):
        _new_pg("mpi", store, 0, 1, datetime.timedelta(seconds=1))
    assert isinstance(_new_pg("gloo", store, 0, 1, datetime.timedelta(seconds=5)), dist.ProcessGroupGloo)


def test_a_rendezvous_a_peer_never_reaches_asks_the_lighthouse_once_then_gives_up_on_its_word(monkeypatch):
    """The exchange's group waits in its store for a peer that hangs (SIGSTOP: no connection
    closes): after STALL_PROBE it asks the lighthouse to probe once (a hang of most groups reads
    as the lighthouse's own isolation otherwise), and it ends as soon as the verdict says so."""
    from ftcore import crossgroup, timeouts

    monkeypatch.setattr(timeouts, "STALL_PROBE", 0.2)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    args = ("gloo", dist.PrefixStore("stall", store), 0, 2, datetime.timedelta(seconds=1), "127.0.0.1")
    asked: list[float] = []
    t0 = time.monotonic()
    verdict = lambda: len(asked) > 0 and time.monotonic() - asked[0] > 0.3  # noqa: E731 (failed 0.3 s later)
    with pytest.raises(crossgroup.RendezvousAborted):
        crossgroup._rendezvous(args, verdict, lambda: asked.append(time.monotonic()))
    assert len(asked) == 1 and 0.2 <= asked[0] - t0 < 2.0  # once, after the stall probe, long before the timeout
    for t in [t for t in threading.enumerate() if t.name == "ftcore-rendezvous"]:
        t.join(10)  # the abandoned rendezvous ends on its own, at the store's timeout


# ---- hardening: plans, ledgers ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "fault,msg",
    [
        ({"kind": "kill", "group": "1", "at_step": 3}, "group"),
        ({"kind": "kill", "group": 1, "at_step": "5"}, "at_step"),
        ({"kind": "kill", "group": 1, "at_step": True}, "at_step"),
        ({"kind": "kill", "group": -1, "at_step": 2}, "group"),
        ({"kind": "stop", "group": 0, "at_step": 2, "duration_s": "4"}, "duration_s"),
        ({"kind": "kill", "group": 0, "rank": "first", "at_step": 2}, "rank"),
        ({"kind": "slow", "group": 0, "at_step": 5, "until_step": 3, "delay_s": 0.1}, "until_step"),
    ],
)
def test_a_fault_plan_with_a_wrong_type_is_refused_when_read(fault, msg):
    with pytest.raises(faults.PlanError, match=msg):
        faults.parse({"faults": [fault]}, "plan.json")


def test_the_ledger_refuses_a_damaged_line_that_no_crash_explains(tmp_path):
    w = ledger.Ledger(str(tmp_path), 0, 0)
    for step in range(3):
        w.record(step, 0, step, "regular", [0], 1, [step])
    w.close()
    path = tmp_path / "group-000-rank-000.jsonl"
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join([lines[0], lines[1][:10], *lines[2:]]))  # torn in the middle
    with pytest.raises(ledger.LedgerError, match="line 2"):
        ledger.read(str(tmp_path))
    # a killed writer's torn last line, then its successor: accepted, the fragment ignored
    path.write_bytes(b"\n".join(lines[:2]) + b"\n" + lines[2][:7])
    w = ledger.Ledger(str(tmp_path), 0, 0)
    w.record(2, 0, 2, "regular", [0], 2, [2])
    w.close()
    assert [r["step"] for r, _ in ledger.read(str(tmp_path))] == [0, 1, 2]


def test_a_groups_ranks_are_columns_the_collector_does_not_track():
    """GroupRecord keeps its ranks' values as blocks of plain tuples: after a collection none of
    them is tracked (a job of 65,536 groups is that many objects to the collector, not three
    times as many), and a rank past the first block of 64 reads back what it was told."""
    import gc

    from ftcore.lighthouse_records import GroupRecord

    g = GroupRecord(0, 0, world=130)
    for r in (0, 64, 129):
        g.beat(r, f"h:{r}", f"h:{r + 1}", step=r, now=float(r), new_line=True)
    g.answer(129, (5, 3, "reply"))
    gc.collect()
    gc.collect()  # a tuple of tuples is untracked once a collection finds its blocks untracked
    columns = (g.stores, g.heals, g.steps, g.beats, g.closed_at, g.lines, g.answers)
    assert not any(gc.is_tracked(c) for c in columns)
    assert list(g.ranks()) == [0, 64, 129] and g.registered == 3 and g.rank(1) is None
    rk = g.rank(129)
    assert rk is not None and (rk.store, rk.heal, rk.step, rk.last_beat, rk.beat_lines, rk.answered) == (
        "h:129", "h:130", 129, 129.0, 1, (5, 3, "reply"),
    )  # fmt: skip
    assert g.step == 0 and g.last_beat() == 129.0 and not g.disconnected
    assert not g.beat(64, "", "", step=3, now=130.0, new_line=False) and g.rank_step(64) == 64  # never back
    assert g.line_closed(64, 200.0) and g.disconnected and g.rank(64).disconnected_at == 200.0
    assert g.lost_rank(201.0, probe=0.5, heartbeat_timeout=None) == 64
    assert g.drop(64) == 64 and not g.disconnected and list(g.ranks()) == [0, 129] and g.registered == 2
    big = GroupRecord(1, 0, world=1 << 16)  # the most a group may have: a beat copies one block
    big.beat(65535, "", "", step=1, now=1.0, new_line=False)
    assert list(big.ranks()) == [65535] and big.registered == 1 and big.has(65535) and not big.has(0)


def test_what_a_rank_is_told_reads_back_as_written(monkeypatch):
    """RankEnv.to_env (the launcher's, the pods') and from_env (the rank's) agree, typed: counts
    as ints, the relay as a flag, an unset field as None."""
    from ftcore import environment
    from ftcore.environment import RankEnv

    told = RankEnv(lighthouse="10.0.0.1:29510", job="j", num_groups=4, group=3, rank=1, world=2, relay=False)
    for name in environment._VARIABLES.values():  # what this process was told is not the test's
        monkeypatch.delenv(name, raising=False)
    for name, value in told.to_env().items():
        monkeypatch.setenv(name, value)
    assert told.to_env()["FTCORE_RELAY"] == "0" and RankEnv.from_env() == told
