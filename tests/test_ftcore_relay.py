"""One heartbeat line and one quorum request per replica group: each group's relay speaks to a
real lighthouse for its ranks (real servers on loopback, real clients)."""

import socket
import time

import pytest
from conftest import IdleFlood, ask_all

from ftcore import preauth
from ftcore.lighthouse_client import GroupLost, JobFinished, LighthouseClient, call
from ftcore.messages import FailureReport, HeartbeatReply, MessageError, QuorumRequest, RankInfo
from ftcore.relay import Relay, group_request

K = 3


def _group(lh_addr, job, g, groups=2, token=None):
    """A relay for group g and its K ranks' clients (rank k's store is 10.0.<g>.<k>:1)."""
    infos = [
        RankInfo(
            group=g,
            rank=k,
            world=K,
            job=job,
            num_groups=groups,
            store=f"10.0.{g}.{k}:1",
            heal=f"10.1.{g}.{k}:2",
        )
        for k in range(K)
    ]
    relay = Relay(lh_addr, infos[0], token, "127.0.0.1")
    clients = [LighthouseClient(relay.address, i, token) for i in infos]
    for c in clients:
        c.start_heartbeats()
    return relay, clients


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def job(lighthouse):
    """Two relayed groups of K ranks on one lighthouse; closed after the test."""
    addr, lh = lighthouse(heartbeat_timeout=1.0, failure_probe=0.1, join_timeout=2.0)
    made = [_group(addr, "relayed", g) for g in range(2)]
    yield addr, lh, made
    for relay, clients in made:
        for c in clients:
            c.close()
        relay.close()


def test_the_lighthouse_hears_one_line_and_one_request_per_group(job):
    addr, lh, made = job
    clients = [c for _, cs in made for c in cs]
    answers = ask_all(clients)
    assert all(not isinstance(a, Exception) for a in answers), answers
    j = lh.jobs["relayed"]
    for g in (0, 1):
        assert list(j.groups[g].ranks()) == [0]  # the relay alone speaks for the group
        assert j.groups[g].rank(0).beat_lines == 1
    # every rank k meets at rank k of the first member (group 0), whatever group it is in
    first = answers[0].groups[0]
    for i, a in enumerate(answers):
        assert a.store == f"10.0.{first}.{i % K}:1"
        assert a.quorum_id == answers[0].quorum_id and a.groups == (0, 1)
    status = call(addr, "/status?job=relayed", None, None, method="GET")[1]
    assert [(g["ranks"], g["world"], g["relay"]) for g in status["groups"]] == [(K, K, True)] * 2


def test_a_healing_rank_is_sent_to_its_own_rank_of_the_source(job):
    addr, lh, made = job
    clients = [c for _, cs in made for c in cs]
    ask_all(clients)
    for c in made[0][1]:  # group 0 committed two steps more than group 1
        c.update(step=2)
    answers = ask_all(clients)
    q = answers[K]  # rank 0 of group 1
    assert q.heal == {1: 0}
    assert [a.heal_from for a in answers[K:]] == [f"10.1.0.{k}:2" for k in range(K)]


def test_a_ranks_death_reaches_the_lighthouse_at_once_and_its_group_is_lost(job):
    addr, lh, made = job
    clients = [c for _, cs in made for c in cs]
    ask_all(clients)
    made[0][1][2].close()  # rank 2 of group 0 dies: its connections close, it never says goodbye
    j = lh.jobs["relayed"]
    assert _wait(lambda: not j.groups[0].healthy, 1.0), "the lighthouse did not see group 0 fail"
    assert any(e["kind"] == "failure_detected" and e["group"] == 0 for e in j.events)
    survivors = made[0][1][:2]
    answers = ask_all(survivors)
    assert all(isinstance(a, GroupLost) for a in answers), answers  # they exit; the group restarts


def test_a_verdict_older_than_the_last_round_fails_nobody(job):
    """The relay beats rarely while rounds are frequent: its last beat may date from before
    its group's last round (group 1 failed then, and has since been healed back in). Its ranks'
    beats must not hear that verdict after the round: it aborted every exchange with group 1."""
    addr, lh, made = job
    clients = [c for _, cs in made for c in cs]
    first = ask_all(clients)[0].quorum_id
    relay, ranks = made[0]
    relay.upstream.heard(first, (1,))  # its last beat's answer, while group 1 was failed
    assert relay.heartbeat(ranks[1].info).failed == (1,)
    again = ask_all(clients)[0]
    assert again.groups == (0, 1)
    reply = relay.heartbeat(ranks[1].info)
    assert reply.failed == () and reply.quorum_id == again.quorum_id
    # a rank's own client: a reply about an older quorum than one it heard of is superseded
    c = ranks[2]
    c.heard(first + 1)
    c.heard(first, (1,))
    assert (c.failed_groups, c.latest_quorum_id) == ((), first + 1)
    c.heard(first + 1, (1,))  # about the current quorum: it stands
    assert c.failed_groups == (1,)


def test_a_quorum_a_member_reported_broken_is_abandoned_on_every_ranks_beat(job):
    """A member whose exchange failed reports it and drops its process group: nobody can finish
    that exchange now. Every rank hears so on its next beat (through its relay), so one still
    waiting in the exchange, or only now reaching its rendezvous, leaves at once instead of
    waiting out its timeout for peers who already left. A stall report is only a probe."""
    addr, lh, made = job
    clients = [c for _, cs in made for c in cs]
    qid = ask_all(clients)[0].quorum_id
    (relay, ranks), reporter = made[0], made[1][1][0]
    reporter.report_failure(qid, "no progress for 0.2 s", stalled=True)
    time.sleep(0.5)  # several beats of the relay's upstream line and of its ranks
    assert not relay.heartbeat(ranks[1].info).abandoned and ranks[1].abandoned_quorum_id == 0
    reporter.report_failure(qid, "gloo: Connection reset by peer")
    assert _wait(lambda: all(c.abandoned_quorum_id == qid for c in ranks), 2.0), [c.abandoned_quorum_id for c in ranks]
    again = ask_all(clients)[0]  # the next round forms a new quorum, abandoned by nobody
    assert again.quorum_id > qid
    assert _wait(lambda: relay.heartbeat(ranks[1].info).quorum_id == again.quorum_id, 2.0)
    assert not relay.heartbeat(ranks[1].info).abandoned
    # on the wire: only when set, and a rank refuses a reply that is not true or false
    wire = HeartbeatReply(qid, abandoned=True).to_wire()
    assert wire["abandoned"] is True and HeartbeatReply.parse(wire).abandoned
    assert "abandoned" not in HeartbeatReply(qid).to_wire()
    with pytest.raises(MessageError, match="abandoned must be true or false"):
        HeartbeatReply.parse({**wire, "abandoned": "yes"})


def test_a_goodbye_tells_the_lighthouse_the_groups_last_step(job):
    """A group that committed steps since its last word to the lighthouse (short steps: no beat)
    and finishes: the job's finished step is its last one, so a group behind it is told the
    job finished instead of training on alone from an older step."""
    addr, lh, made = job
    ask_all([c for _, cs in made for c in cs])
    for c in made[0][1]:
        c.update(step=3)
    made[0][1][0].leave()
    j = lh.jobs["relayed"]
    assert _wait(lambda: j.finished_step == 3), j.finished_step
    behind = ask_all(made[1][1])  # group 1, still at step 0
    assert all(isinstance(a, JobFinished) and "finished at step 3" in str(a) for a in behind), behind


def test_ranks_hear_the_lighthouses_silence_through_their_relay():
    from ftcore.lighthouse import LighthouseConfig, serve

    srv, lh = serve(LighthouseConfig(bind="127.0.0.1:0", heartbeat_timeout=1.0))
    relay, clients = _group(f"127.0.0.1:{srv.server_address[1]}", "quiet", 0, groups=1)
    try:
        assert _wait(lambda: clients[1].silent_for() < 0.2)
        # the lighthouse's server stalls for 1.5 s (as a stopped process): no connection closes
        srv.loop.call_soon_threadsafe(time.sleep, 1.5)
        assert _wait(lambda: clients[1].silent_for() > 0.5, 1.4), "the rank still thinks the lighthouse answers"
        assert _wait(lambda: clients[1].silent_for() < 0.2, 5.0)
    finally:
        for c in clients:
            c.close()
        relay.close()
        lh.close()
        srv.shutdown()


def test_a_loaded_lighthouse_slows_the_groups_beats_and_waits_for_them_longer(lighthouse):
    # a budget of 4 beats/s for two speakers: each is asked to beat every 0.5 s
    addr, lh = lighthouse(heartbeat_timeout=2.0, failure_probe=0.1, join_timeout=2.0, heartbeat_budget=4.0)
    made = [_group(addr, "paced", g) for g in range(2)]
    try:
        quorum = ask_all([c for _, cs in made for c in cs])[0]
        assert _wait(lambda: all(r.upstream.pace == 0.5 for r, _ in made), 4.0), [r.upstream.pace for r, _ in made]
        assert lh.pulse.beat_s == 0.5 and lh.pulse.probe_s == pytest.approx(0.55)
        silences = []
        for _ in range(60):  # 1.2 s: beats half a second apart, every one answered
            silences += [r.upstream.silent_for() for r, _ in made] + [c.silent_for() for _, cs in made for c in cs]
            time.sleep(0.02)
        assert max(silences) < 0.2, "an answering lighthouse was taken for a silent one"
        # a peer's report: each group is heard within the probe its slower beats allow, none fails
        report = FailureReport("paced", 1, 0, 0, quorum.quorum_id, "peer reset")
        assert call(addr, "/report_failure", report.to_wire(), None)[0] == 200
        time.sleep(1.0)
        j = lh.jobs["paced"]
        assert j.groups[0].healthy and j.groups[1].healthy
        assert not [e for e in j.events if e["kind"] == "failure_detected"]
    finally:
        for relay, clients in made:
            for c in clients:
                c.close()
            relay.close()


def test_a_job_cannot_mix_relayed_and_direct_groups(job):
    addr, lh, made = job
    ask_all([c for _, cs in made for c in cs])
    direct = RankInfo(group=1, rank=0, world=1, job="relayed", num_groups=2, incarnation=5)
    status, body = call(addr, "/heartbeat", direct.to_wire(), None)
    assert status == 400 and "relay" in body["error"]


def test_a_relay_serves_only_its_own_group():
    info = RankInfo(group=0, rank=0, world=2, job="a")
    relay = Relay("127.0.0.1:9", info, None, "127.0.0.1")
    try:
        other = RankInfo(group=1, rank=0, world=2, job="a")
        status, body = call(relay.address, "/heartbeat", other.to_wire(), None)
        assert status == 400 and "group 0" in body["error"]
    finally:
        relay.close()


def test_idle_sockets_without_a_token_never_turn_a_ranks_connection_away():
    info = RankInfo(group=0, rank=0, world=2, job="a")
    relay = Relay("127.0.0.1:9", info, "tok", "127.0.0.1")  # caps 4K+16 = 24 connections
    rank1 = RankInfo(group=0, rank=1, world=2, job="a", store="s:1", heal="h:2")
    try:
        with IdleFlood(relay.address, n=200) as flood:
            for _ in range(30):  # the review's probe: all 30 were refused
                status, body = call(relay.address, "/heartbeat", rank1.to_wire(), "tok", timeout=10)
                assert status == 200 and "quorum_id" in body
                time.sleep(0.05)
            assert flood.opened > 200  # the flood was turned away and kept coming back
        assert relay.members[1].seen
    finally:
        relay.close()


def test_a_relay_closes_a_client_that_never_shows_its_token_at_the_pre_auth_bound():
    relay = Relay("127.0.0.1:9", RankInfo(group=0, rank=0, world=2, job="a"), "tok", "127.0.0.1")
    try:
        with socket.create_connection(relay.address.rsplit(":", 1), timeout=10) as s:
            s.sendall(b"POST /heartbeat HTTP/1.1\r\n")  # and then nothing more
            t0 = time.monotonic()
            assert s.recv(4096) == b""  # a TimeoutError here: the relay held it open
            assert time.monotonic() - t0 < preauth.PREAUTH_S + 2  # well before the 10 s first-request bound
    finally:
        relay.close()


def test_a_relays_address_lists_must_match_its_world():
    wire = {**RankInfo(group=0, rank=0, world=3, job="a", store="a:1,b:1").to_wire(), "relay": True}
    with pytest.raises(MessageError, match="lists 2 addresses for world=3"):
        RankInfo.parse(wire)
    wire = {**RankInfo(group=0, rank=1, world=3, job="a").to_wire(), "relay": True}
    with pytest.raises(MessageError, match="rank"):
        RankInfo.parse(wire)


def test_the_groups_request_is_its_lowest_step_and_slowest_rank():
    from ftcore.messages import Busy

    base = RankInfo(group=0, rank=0, world=2, job="a", relay=True)
    asks = [
        QuorumRequest(RankInfo(group=0, rank=0, world=2, job="a", step=7), busy=Busy(3, 0.5), idle=-1),
        QuorumRequest(RankInfo(group=0, rank=1, world=2, job="a", step=6), busy=Busy(3, 0.9), again=True),
    ]
    req = group_request(base, asks)
    assert (req.info.step, req.busy, req.again, req.info.relay) == (6, Busy(3, 0.9, (0.5, 0.9)), True, True)
    assert Busy.parse(req.busy.to_wire()) == req.busy
    asks[1] = QuorumRequest(asks[1].info, busy=Busy(2, 0.9))  # measured in another quorum: not comparable
    assert group_request(base, asks).busy is None
