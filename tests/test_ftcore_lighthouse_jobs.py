"""One standing lighthouse for several jobs; what it refuses at the door; where ranks listen.

Real lighthouse servers on loopback and real clients, no processes beyond this one."""

import socket
import threading
import time

import pytest

from ftcore import lighthouse as lh_mod
from ftcore import netaddr
from ftcore.lighthouse import LighthouseConfig, serve
from ftcore.lighthouse_client import GroupLost, LighthouseClient, call


@pytest.fixture
def lighthouse():
    servers = []

    def start(**kw):
        server, lh = serve(LighthouseConfig(bind="127.0.0.1:0", **kw))
        servers.append((server, lh))
        return "127.0.0.1:%d" % server.server_address[1], lh

    yield start
    for server, lh in servers:
        lh.close()
        server.shutdown()
        server.server_close()


def _job(addr, job, steps, world=1):
    cs = []
    for g, step in enumerate(steps):
        for r in range(world):
            c = LighthouseClient(addr, g, r, world, job=job, num_groups=len(steps))
            c.info.update(store=f"127.0.0.1:{1000 + 10 * g + r}", heal=f"127.0.0.1:{2000 + 10 * g + r}", step=step)
            c.start_heartbeats()
            cs.append(c)
    return cs


def _ask_all(cs, timeout=5.0):
    out = [None] * len(cs)

    def ask(i):
        try:
            out[i] = cs[i].quorum(timeout)
        except Exception as e:   # noqa: BLE001 - the test inspects it
            out[i] = e
    ts = [threading.Thread(target=ask, args=(i,)) for i in range(len(cs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def test_one_lighthouse_serves_two_jobs_without_mixing_them(lighthouse):
    addr, lh = lighthouse()
    a, b = _job(addr, "job-a", [5, 5]), _job(addr, "job-b", [9, 3, 9])
    try:
        qa, qb = _ask_all(a), _ask_all(b)
        assert {q["groups"] == [0, 1] for q in qa} == {True} and qa[0]["heal"] == {} and qa[0]["max_step"] == 5
        assert qb[0]["groups"] == [0, 1, 2] and qb[0]["heal"] == {"1": 0} and qb[0]["max_step"] == 9
        assert qa[0]["job"] == "job-a" and qb[0]["job"] == "job-b"
        # each rank gets only its own rendezvous (rank k of the first group) and heal source
        assert qb[1]["store"] == "127.0.0.1:1000" and qb[1]["heal_from"] == "127.0.0.1:2000"
        # a failure in job b re-forms job b only
        b[2].close()
        qb2 = _ask_all(b[:2])
        assert qb2[0]["groups"] == [0, 1] and qb2[0]["quorum_id"] > qb[0]["quorum_id"]
        assert {q["quorum_id"] for q in _ask_all(a)} == {qa[0]["quorum_id"]}
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


@pytest.mark.parametrize("bad", [
    {"group": 0, "rank": 3, "world": 2},                       # rank beyond its world
    {"group": 7, "rank": 0, "world": 1, "num_groups": 2},      # a group the job does not have
    {"group": 0, "rank": 0, "world": 1, "quorum_id": 10 ** 30},
    {"group": "x", "rank": 0},
    {"group": 0, "rank": 0, "job": "../../etc"},
    {"group": 0, "rank": 0, "timeout": float("nan")},
    [1, 2, 3],
])
def test_a_bad_request_is_a_400_and_wedges_nothing(lighthouse, bad):
    addr, lh = lighthouse()
    path = "/quorum" if isinstance(bad, dict) and "timeout" in bad else "/heartbeat"
    code, _ = call(addr, path, bad, None)
    assert code == 400
    good = _job(addr, "default", [0, 0])
    try:
        qs = _ask_all(good)
        assert qs[0]["groups"] == [0, 1]     # the tick thread and the job are fine
        assert lh._ticker.is_alive()
    finally:
        for c in good:
            c.close()


def test_a_group_that_lost_a_rank_is_told_to_restart_at_once(lighthouse):
    addr, _ = lighthouse(heartbeat_timeout=5.0, failure_probe=0.1)
    cs = _job(addr, "default", [0, 0], world=2)
    try:
        _ask_all(cs)
        cs[3].close()                      # group 1 rank 1 dies
        t = time.monotonic()
        out = _ask_all(cs[:3], timeout=8.0)
        assert isinstance(out[2], GroupLost) and "lost rank 1" in str(out[2])
        assert time.monotonic() - t < 3.0  # not the 8 s quorum timeout
        assert out[0]["groups"] == [0]
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
