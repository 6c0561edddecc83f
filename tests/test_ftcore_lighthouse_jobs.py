"""One standing lighthouse for several jobs; what it refuses at the door; where ranks listen.

Real lighthouse servers on loopback and real clients, no processes beyond this one."""

import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import ask_all

from ftcore import lighthouse as lh_mod
from ftcore import lighthouse_http, netaddr
from ftcore.lighthouse_client import GroupLost, LighthouseClient, LighthouseError, call
from ftcore.messages import Pace, Quorum, QuorumRequest, RankInfo, identity_key


def _job(addr, job, steps, world=1):
    cs = []
    for g, step in enumerate(steps):
        for r in range(world):
            c = LighthouseClient(
                addr,
                RankInfo(
                    group=g,
                    rank=r,
                    world=world,
                    job=job,
                    num_groups=len(steps),
                    store=f"127.0.0.1:{1000 + 10 * g + r}",
                    heal=f"127.0.0.1:{2000 + 10 * g + r}",
                    step=step,
                ),
            )
            c.start_heartbeats()
            cs.append(c)
    return cs


def _ask_all(clients, requests, timeout=5.0) -> list:
    """ask_all with a request of each client's own (what a manager reports of its last quorum)."""
    out: list = [None] * len(clients)

    def ask(i):
        try:
            out[i] = clients[i].quorum(timeout, request=requests[i])
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[i] = e

    ts = [threading.Thread(target=ask, args=(i,)) for i in range(len(clients))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def test_one_lighthouse_serves_two_jobs_without_mixing_them(lighthouse):
    addr, lh = lighthouse()
    a, b = _job(addr, "job-a", [5, 5]), _job(addr, "job-b", [9, 3, 9])
    try:
        qa, qb = ask_all(a), ask_all(b)
        assert {q.groups == (0, 1) for q in qa} == {True} and qa[0].heal == {} and qa[0].max_step == 5
        assert qb[0].groups == (0, 1, 2) and qb[0].heal == {1: 0} and qb[0].max_step == 9
        assert qa[0].job == "job-a" and qb[0].job == "job-b"
        # each rank gets only its own addresses: group 1 heals from group 0, so both are aside
        # and group 2 alone is the exchange, whose rank k hosts the rendezvous and serves the average
        assert qb[0].aside() == {0, 1} and qb[0].exchange() == (2,) and qb[0].live() == {2}
        assert qb[1].store == "127.0.0.1:1020" and qb[1].heal_from == "127.0.0.1:2000"
        assert qb[0].update_from == qb[1].update_from == "127.0.0.1:2020" and qb[2].update_from == ""
        # a failure in job b re-forms job b only
        b[2].close()
        qb2 = ask_all(b[:2])
        assert qb2[0].groups == (0, 1) and qb2[0].quorum_id > qb[0].quorum_id
        assert {q.quorum_id for q in ask_all(a)} == {qa[0].quorum_id}
        sa, sb = lh.status("job-a"), lh.status("job-b")
        assert sa["jobs"] == ["job-a", "job-b"] and [g["group"] for g in sa["groups"]] == [0, 1]
        assert all(e.get("job", "job-a") == "job-a" for e in sa["events"])
        assert any(e["kind"] == "failure_detected" for e in sb["events"])
        assert not any(e["kind"] == "failure_detected" for e in sa["events"])
        code, st = call(addr, "/status?job=job-b", None, None, method="GET")
        assert code == 200 and len(st["groups"]) == 3
    finally:
        for c in a + b:
            c.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"group": 0, "rank": 3, "world": 2},  # rank beyond its world
        {"group": 7, "rank": 0, "world": 1, "num_groups": 2},  # a group the job does not have
        {"group": 0, "rank": 0, "world": 1, "quorum_id": 10**30},
        {"group": "x", "rank": 0},
        {"group": 0, "rank": 0, "job": "../../etc"},
        {"group": 0, "rank": 0, "timeout": float("nan")},
        {"group": 0, "rank": 0, "timeout": 1, "quorum_key": ["0"]},  # the last quorum by name (a string)
        {"group": 0, "rank": 0, "timeout": 1, "quorum_lighthouse_id": 7},
        [1, 2, 3],
    ],
)
def test_a_bad_request_is_a_400_and_wedges_nothing(lighthouse, bad):
    addr, lh = lighthouse()
    path = "/quorum" if isinstance(bad, dict) and "timeout" in bad else "/heartbeat"
    code, _ = call(addr, path, bad, None)
    assert code == 400
    good = _job(addr, "default", [0, 0])
    try:
        qs = ask_all(good)
        assert qs[0].groups == (0, 1)  # the tick thread and the job are fine
        assert lh._ticker.is_alive()
    finally:
        for c in good:
            c.close()


def test_a_group_that_lost_a_rank_is_told_to_restart_at_once(lighthouse):
    addr, lh = lighthouse(heartbeat_timeout=5.0, failure_probe=0.1)
    cs = _job(addr, "default", [0, 0], world=2)
    try:
        ask_all(cs)
        cs[3].close()  # group 1 rank 1 dies
        out = ask_all(cs[:3], timeout=8.0)
        # told by the lighthouse (a 410), not left to the 8 s quorum timeout (a LighthouseError
        # "no quorum"), and found by the closed connection, not the 5 s heartbeat timeout
        assert isinstance(out[2], GroupLost) and "lost rank 1" in str(out[2])
        detected = [e for e in lh.status()["events"] if e["kind"] == "failure_detected"]
        assert [(e["group"], e["reason"]) for e in detected] == [(1, "connection closed")], detected
        assert out[0].groups == (0,)
    finally:
        for c in cs:
            c.close()


def test_the_lighthouse_refuses_to_start_without_a_token(monkeypatch, capsys):
    monkeypatch.delenv("FTCORE_TOKEN", raising=False)
    monkeypatch.delenv("FTCORE_TOKEN_FILE", raising=False)
    assert lh_mod.main(["--bind", "127.0.0.1:0"]) == 2
    assert "no token" in capsys.readouterr().err
    assert lh_mod.main(["--bind", "0.0.0.0:0", "--insecure"]) == 2
    assert "without a token" in capsys.readouterr().err


def test_a_rank_binds_one_address(monkeypatch):
    monkeypatch.delenv("FTCORE_HOST", raising=False)
    assert netaddr.rank_host("127.0.0.1:29510") == "127.0.0.1"
    assert netaddr.rank_host("http://localhost:29510") == "127.0.0.1"
    assert netaddr.interface_of("127.0.0.1") == "lo"
    monkeypatch.setenv("FTCORE_HOST", "0.0.0.0")
    with pytest.raises(netaddr.AddressError, match="wildcard"):
        netaddr.rank_host("10.0.0.1:29510")
    monkeypatch.setenv("FTCORE_HOST", "not-an-ip")
    with pytest.raises(netaddr.AddressError, match="not an IP"):
        netaddr.rank_host("10.0.0.1:29510")
    monkeypatch.setenv("FTCORE_HOST", "127.0.0.2")
    assert netaddr.rank_host("10.0.0.1:29510") == "127.0.0.2"
    fd, port = netaddr.listen_fd("127.0.0.2")
    s = socket.socket(fileno=fd)
    try:
        assert s.getsockname() == ("127.0.0.2", port)
    finally:
        s.close()


def _raw(addr: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes on a fresh connection; the reply's bytes (b'' if it only closed)."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out:
                    head, _, body = out.partition(b"\r\n\r\n")
                    length = [
                        int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
                    ]
                    if length and len(body) >= length[0]:
                        break
        except TimeoutError:
            pass
        return out


@pytest.mark.parametrize(
    "data,code",
    [
        (b"POST /heartbeat HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n\xff\xfe", b"400"),  # not UTF-8
        (b"POST /heartbeat HTTP/1.1\r\nHost: h\r\nContent-Length: 8\r\n\r\nInfinity", b"400"),  # not JSON
        (b"POST /heartbeat HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n[]", b"400"),  # not an object
        (b"POST /heartbeat HTTP/1.1\r\nHost: h\r\nContent-Length: abc\r\n\r\n", b"400"),  # no number
        (b"POST /heartbeat HTTP/1.1\r\nHost: h\r\nContent-Length: 99999999\r\n\r\n", b"413"),  # over 1 MiB
        (b"BREW /pot\r\n\r\n", b"400"),  # no request line
        (b"POST /heartbeat HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", b"400"),  # HTTP/1.1 without Host
        # a chunked body would otherwise be read as a second request
        (b"POST /heartbeat HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", b"400"),
        (b"POST /heartbeat HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nContent-Length: 9\r\n\r\n{}", b"400"),
        # a 400-digit integer is a 400, not a dropped connection
        (b'POST /heartbeat HTTP/1.1\r\nHost: h\r\nContent-Length: 410\r\n\r\n{"step": ' + b"9" * 400 + b"}", b"400"),
    ],
)
def test_malformed_requests_get_a_status_not_a_dropped_connection(lighthouse, data, code):
    addr, _ = lighthouse()
    reply = _raw(addr, data)
    assert reply.split(b" ")[1] == code, reply[:200]


def test_the_token_travels_in_the_header_only(lighthouse):
    addr, _ = lighthouse(token="s3cret")
    assert call(addr, "/status?token=s3cret", None, None, method="GET")[0] == 401
    assert call(addr, "/status", None, "s3cret", method="GET")[0] == 200


def test_idle_and_concurrent_connections_do_not_wedge_the_lighthouse(lighthouse, monkeypatch) -> None:
    monkeypatch.setattr(lighthouse_http, "FIRST_REQUEST_S", 1.0)
    addr, _ = lighthouse()
    host, port = addr.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(200)]
    try:
        burst = []
        results: list[int] = []

        def ask():
            results.append(call(addr, "/status", None, None, method="GET", timeout=10)[0])

        burst = [threading.Thread(target=ask) for _ in range(300)]
        for t in burst:
            t.start()
        for t in burst:
            t.join()
        assert results.count(200) == 300  # none reset, none refused
        time.sleep(1.5)  # idle sockets that never spoke are closed by the server
        idle[0].settimeout(2)
        assert idle[0].recv(1) == b""
    finally:
        for s in idle:
            s.close()


def test_a_heal_server_answers_a_bad_step_with_400():
    from ftcore import heal

    srv = heal.HealServer(token=None)
    try:
        # b"\xb2" is "²" in the request line's latin-1: str.isdigit() says yes, int() says no
        reply = _raw(srv.address, b"GET /snapshot/\xb2 HTTP/1.1\r\n\r\n")
        assert reply.split(b" ")[1] == b"400", reply[:200]
    finally:
        srv.close()


def test_a_restarted_lighthouse_resumes_the_quorum_its_members_report(lighthouse):
    """Same members, same last quorum (id, lighthouse id, members) reported by every rank: the new
    lighthouse hands out that quorum again, so nobody rebuilds its process group and a group
    that went on without it (on its lease) is still in step with the others."""
    addr, _ = lighthouse()
    cs = _job(addr, "default", [4, 4])
    try:
        q = ask_all(cs)[0]
    finally:
        for c in cs:
            c.close()
    addr2, lh2 = lighthouse()
    cs = _job(addr2, "default", [4, 4])
    for c in cs:
        c.update(quorum_id=q.quorum_id)
    last = [QuorumRequest(c.info, quorum_lighthouse_id=q.lighthouse_id, quorum_key=q.members_key) for c in cs]
    try:
        q2 = _ask_all(cs, last)
        assert q.lighthouse_id != lh2.pulse.lighthouse_id  # another lighthouse ...
        assert {x.key for x in q2} == {q.key}  # ... handed out the same quorum
        for c in cs:
            c.update(step=5)
        last = [
            QuorumRequest(cs[0].info, quorum_lighthouse_id=q.lighthouse_id, quorum_key=q.members_key),
            QuorumRequest(cs[1].info, quorum_lighthouse_id=q.lighthouse_id, quorum_key=identity_key(((0, 0),))),
        ]
        q3 = _ask_all(cs, last)  # one member remembers another quorum
        assert q3[0].key == q.key  # kept: same members
    finally:
        for c in cs:
            c.close()


def test_a_restarted_lighthouse_forms_the_quorum_its_members_all_ask_for_without_waiting(lighthouse):
    """Groups 0 and 1 last trained in a quorum of the two of them (group 2 stood aside, on
    standby: a lighthouse that restarts forgets it). Both ask: the quorum forms at once, not
    after the 20 s join timeout, and it is the same one. After a failure reported in it (a step
    given up mid-exchange), the same members form at once again, under new ids (everyone
    rebuilds its process group). One of them asking with group 2 waits past the join timeout
    (the other may train on in that quorum under its lease, unseen)."""
    addr, lh = lighthouse(join_timeout=20.0)
    cs = _job(addr, "default", [4, 4, 4])
    for c in cs:
        c.update(quorum_id=7)
    old = identity_key(((0, 0), (1, 0)))
    last = [QuorumRequest(c.info, quorum_lighthouse_id="c0ffee00", quorum_key=old) for c in cs[:2]]
    try:
        assert _wait_healthy(lh, "default", 3)
        t = time.monotonic()
        q = _ask_all(cs[:2], last)
        assert [x.groups for x in q] == [(0, 1)] * 2 and time.monotonic() - t < 10, q
        assert (q[0].quorum_id, q[0].lighthouse_id) == (7, "c0ffee00")  # resumed as it was
        cs[0].report_failure(7, "FTAR bucket 0: lease given up")
        q2 = _ask_all(cs[:2], last)
        assert [x.groups for x in q2] == [(0, 1)] * 2 and q2[0].key != q[0].key, q2
    finally:
        for c in cs:
            c.close()
    addr, lh = lighthouse(join_timeout=1.0)
    cs = _job(addr, "default", [4, 4, 4])
    for c in cs:
        c.update(quorum_id=7)
    try:
        assert _wait_healthy(lh, "default", 3)
        got = _ask_all(cs[1:], [last[1], QuorumRequest(cs[2].info)], timeout=3.0)
        assert all(isinstance(x, LighthouseError) for x in got), got
    finally:
        for c in cs:
            c.close()


def _wait_healthy(lh, job, n, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        j = lh.jobs.get(job)
        if j is not None and len(j.health.healthy) >= n:
            return True
        time.sleep(0.02)
    return False


def test_a_group_restarted_after_the_job_finished_is_told_so_not_started_afresh(lighthouse):
    from ftcore.lighthouse_client import JobFinished

    addr, _ = lighthouse()
    g0, g1 = _job(addr, "default", [10, 10])
    ask_all([g0, g1])
    g1.close()  # group 1 dies ...
    g0.leave()  # ... and group 0 finishes its last step and leaves
    late = LighthouseClient(
        addr,
        RankInfo(
            group=1,
            rank=0,
            world=1,
            incarnation=1,
            num_groups=2,  # group 1 restarted,
            store="127.0.0.1:1",
            heal="127.0.0.1:2",
            step=0,
        ),
    )  # from scratch
    late.start_heartbeats()
    try:
        with pytest.raises(JobFinished, match="finished at step 10"):
            late.quorum(timeout=5)
    finally:
        late.close()


def _one_answer_server(body: dict):
    """An HTTP server that answers every POST with `body` (200): a lighthouse gone wrong."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            raw = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.mark.parametrize(
    "field,change",
    [
        ("max_step", lambda b: b.pop("max_step")),
        ("max_step", lambda b: b.update(max_step="later")),
        ("heal", lambda b: b.update(heal={"5": 0})),  # a healing group that is not a member
        ("members_key", lambda b: b.update(members_key=[1, 0])),
        ("groups", lambda b: b.update(groups=[0, 1])),  # members travel as [first, end) runs
        ("groups", lambda b: b.update(groups=[[1, 1]])),  # an empty run
        ("groups", lambda b: b.update(groups=[[0, 2], [1, 3]])),  # a group twice
        ("lighthouse_id", lambda b: b.pop("lighthouse_id")),
    ],
)
def test_a_malformed_quorum_reply_is_a_lighthouse_error_naming_the_field(field, change):
    """What the lighthouse answers is checked once, by the client: a reply that is not a
    quorum never reaches the manager as one."""
    q = Quorum(
        quorum_id=4,
        lighthouse_id="ab12cd34",
        job="default",
        identity=((0, 0), (1, 2)),
        groups=(0, 1),
        max_step=7,
        heal={1: 0},
        lease_s=10.0,
        pace=Pace(3, 0.2, 0.15),
    )
    body = json.loads(Quorum.for_rank(q.shared_json(), "127.0.0.1:1000", "127.0.0.1:2000"))
    # a rank learns its members by key, not by every member's incarnation
    sent = {**q.__dict__, "identity": (), "store": "127.0.0.1:1000", "heal_from": "127.0.0.1:2000"}
    assert Quorum.parse(body) == Quorum(**sent) and q.members_key == identity_key(q.identity)
    change(body)
    srv = _one_answer_server(body)
    c = LighthouseClient(f"127.0.0.1:{srv.server_address[1]}", RankInfo(group=0, rank=0))
    try:
        with pytest.raises(LighthouseError, match=f"malformed quorum answer: .*{field}"):
            c.quorum(2.0)
    finally:
        c.close()
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("groups", [(0,), (0, 1, 2), (0, 2, 3, 7), (5, 1, 2, 3), tuple(range(1562)), (9, 8, 7)])
def test_members_travel_as_runs_and_come_back_in_order(groups):
    q = Quorum(
        quorum_id=1,
        lighthouse_id="ab",
        job="j",
        identity=tuple((g, 0) for g in groups),
        groups=groups,
        max_step=0,
        heal={},
        lease_s=1.0,
    )
    wire = json.loads(Quorum.for_rank(q.shared_json(), "", ""))
    assert len(wire["groups"]) <= len(groups) and Quorum.parse(wire).groups == groups


def test_a_burst_of_closed_lines_of_a_big_job_is_swept_by_the_ticker_not_the_loop(lighthouse, monkeypatch):
    """Each closed heartbeat line used to sweep its whole job at once, on the loop that answers
    every job (200 lines of a 12,000-group job kept another job unanswered for 12.5 s): now a
    close only asks, and the ticker sweeps (once for a burst, paced by the sweep's own cost, its
    lock let go between slices of groups), then fails every group gone."""
    from ftcore import lighthouse_records

    monkeypatch.setattr(lighthouse_records, "SWEEP_SLICE", 256)  # 3000 groups: sliced sweeps
    _, lh = lighthouse()
    n = 3000
    infos = [RankInfo(group=g, rank=0, world=1, job="big", num_groups=n) for g in range(n)]
    job = lh.job(infos[0])
    for info in infos:
        job.heartbeat(info, new_line=True)
    deadline = time.monotonic() + 10
    while len(job.health.healthy) < n and time.monotonic() < deadline:  # healthy once a sweep says so
        time.sleep(0.02)
    sweeps: list[str] = []
    sweep = job._update_health
    job._update_health = lambda now: (sweeps.append(threading.current_thread().name), sweep(now))[1]
    for g in range(500):  # as the server's loop does when a line closes
        job.disconnected(g, 0, 0)
    deadline = time.monotonic() + 10
    while sum(e["kind"] == "failure_detected" for e in list(job.events)) < 500 and time.monotonic() < deadline:
        time.sleep(0.02)
    failed = {e["group"] for e in list(job.events) if e["kind"] == "failure_detected"}
    assert failed == set(range(500))  # every group whose last line closed, and nobody else
    assert sweeps and threading.current_thread().name not in sweeps  # the old code: 500 sweeps here


def test_a_big_jobs_sweep_lets_its_lock_go_between_slices(monkeypatch):
    """At 65,535 groups a sweep holds its job's lock about 100 ms here, and the loop that answers
    every job waits on that lock for the big job's own beats and closed lines: a sweep lets it go
    between slices, so a waiting thread gets it before the sweep ends. A record replaced meanwhile
    (a new incarnation) is not judged as the old one."""
    from ftcore import lighthouse_records
    from ftcore.lighthouse_records import GroupRecord, in_slices

    monkeypatch.setattr(lighthouse_records, "SWEEP_SLICE", 1)
    groups = {g: GroupRecord(g, 0, 1) for g in range(50)}
    lock = threading.Lock()
    lock.acquire()  # the ticker's, as Lighthouse._tick holds it
    seen: list[int] = []
    took: list[int] = []

    def loop() -> None:  # a heartbeat of the big job, on the loop
        with lock:
            took.append(len(seen))
            groups[40] = GroupRecord(40, 1, 1)

    t = threading.Thread(target=loop)
    t.start()
    time.sleep(0.1)  # it waits for the lock
    for grp in in_slices(groups, lock):
        seen.append(grp.group)
    lock.release()
    t.join(5)
    assert took and took[0] < len(groups), took  # the old sweep: 50, after every group
    assert (40 in seen) == (took[0] > 40), (took, seen)  # its replaced record skipped if not yet read


def test_a_jobs_sweeps_are_paced_by_their_cost_and_its_reports_bounded_by_quorum():
    from ftcore.lighthouse_records import REPORTED_QUORUMS, SWEEP_S, SWEEP_SHARE, Health

    h = Health()
    h.swept(100.0, 0.001)
    assert not h.sweep_due(100.0 + SWEEP_S / 2) and h.sweep_due(100.0 + SWEEP_S + 1e-6)  # the periodic sweep
    h.sweep_asked = True
    assert h.sweep_due(100.0 + 0.01)  # asked: at the next tick
    h.swept(200.0, 0.5)  # a sweep that cost 0.5 s: the next waits until it is SWEEP_SHARE of the time
    wait = 0.5 * (1 / SWEEP_SHARE - 1)
    h.sweep_asked = True
    assert not h.sweep_due(200.0 + wait - 0.01) and h.sweep_due(200.0 + wait + 1e-6)
    for qid in range(1, 1000):  # a report may name any quorum id: kept for a few, and the current one
        h.probes(qid, current=7)
    assert len(h.reports) == REPORTED_QUORUMS and {7, 999} <= h.reports.keys()


def test_beats_waiting_unread_behind_a_late_loop_are_not_silence_but_a_real_hang_still_fails():
    """Silence is judged as of the moment the server had read everything that arrived
    (Pulse.judged_at): group 2's beats may still wait unread in a loop that runs late (a CPU
    hog, a burst) while groups 0 and 1, read since, are heard; group 2 is not failed for that.
    Once the server has read up to now, group 2, silent for real, is failed, and only it."""
    from ftcore.lighthouse import Lighthouse, LighthouseConfig

    lh = Lighthouse(LighthouseConfig(heartbeat_timeout=0.5))
    infos = [RankInfo(group=g, rank=0, world=1, job="late", num_groups=3) for g in range(3)]
    job = lh.job(infos[0])
    try:
        read_until = time.monotonic() + 0.2  # what the server had surely read: the first beats
        lh.pulse.read_until = lambda: read_until
        for info in infos:
            job.heartbeat(info, new_line=True)
        assert _wait_for(lambda: job.health.healthy == {0, 1, 2}), "the groups never became healthy"

        def failed() -> set[int]:
            return {e["group"] for e in list(job.events) if e["kind"] == "failure_detected"}

        for _ in range(75):  # 1.5 s: three heartbeat timeouts, groups 0 and 1 beating
            for info in infos[:2]:
                job.heartbeat(info)
            time.sleep(0.02)
        assert failed() == set(), "a beat that may wait unread was judged as its sender's silence"
        lh.pulse.read_until = lambda: math.inf  # the server caught up: group 2 sent nothing
        for _ in range(50):
            for info in infos[:2]:
                job.heartbeat(info)
            time.sleep(0.02)
        assert failed() == {2}
    finally:
        lh.close()


def _wait_for(pred, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    return pred()


def test_a_job_holds_no_more_ranks_than_the_lighthouse_allows_one_job(lighthouse):
    """A job's token lets it register groups, but not past --max-ranks-per-job (each group's
    ranks, summed over its live incarnations): a 400 that names the setting, and the job keeps
    what it had. A restarted group replaces its old incarnation's ranks, it does not add to them."""
    addr, lh = lighthouse(max_ranks_per_job=8)

    def beat(group: int, incarnation: int = 0, world: int = 4) -> tuple[int, dict]:
        info = RankInfo(group=group, rank=0, world=world, job="capped", num_groups=0, incarnation=incarnation)
        return call(addr, "/heartbeat", info.to_wire(), None)[:2]

    assert beat(0)[0] == 200 and beat(1)[0] == 200  # 8 ranks: at the cap
    code, body = beat(2)
    assert code == 400 and "--max-ranks-per-job 8" in json.dumps(body), body
    assert beat(1, incarnation=1)[0] == 200  # group 1 restarted: still 8
    assert beat(0, incarnation=1, world=5)[0] == 400  # 9 would be over
    assert sorted(lh.jobs["capped"].groups) == [0, 1] and lh.jobs["capped"].ranks_held == 8
