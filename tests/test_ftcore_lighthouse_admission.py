"""The lighthouse's admission rule from tables (ftcore/lighthouse_admission.py): no server, no sockets."""

import pytest

from ftcore.lighthouse_admission import (
    EVICT_AGE_S,
    AdmissionCounts,
    Admit,
    Caps,
    EvictIdle,
    EvictWaiting,
    JobLoad,
    Load,
    Refuse,
    Waiting,
    admit,
    settle,
)

CAPS = Caps(total=64, per_peer=32, waiting_per_peer=4, job_floor=8, per_rank=4)
OLD, YOUNG = EVICT_AGE_S + 0.1, EVICT_AGE_S / 2


def w(peer: str, count: int, age: float) -> Waiting:
    return Waiting(peer, count, age)


ADMISSION = [
    # (what, newcomer's load, decision)
    ("room", Load(10, 2, None, None, None), Admit()),
    ("its address's tokenless pool is full: the oldest makes way", Load(10, 4, w("a", 4, OLD), None, None), "a"),
    ("... unless it is young (a burst of ranks): refused", Load(10, 4, w("a", 4, YOUNG), None, None), Refuse),
    ("its address is full: its own oldest tokenless makes way", Load(10, 32, w("a", 1, OLD), None, None), "a"),
    ("its address is full of connections with a token: refused", Load(10, 32, None, None, None), Refuse),
    ("full: the address with the most tokenless gives one", Load(64, 1, None, w("b", 3, OLD), w("c", 1, 9)), "b"),
    ("full, the most are young: the oldest anywhere", Load(64, 1, None, w("b", 3, YOUNG), w("c", 1, OLD)), "c"),
    (
        "full of one job's connections: its idle one past its share",
        Load(64, 1, None, None, None, 1, (JobLoad("hog", 60, 16, 44),)),
        EvictIdle("hog"),
    ),
    (
        "full, of jobs within their shares: refused",
        Load(64, 1, None, None, None, 3, (JobLoad("a", 16, 4, 8), JobLoad("b", 16, 4, 8))),
        Refuse,
    ),
    (
        "full: the job furthest past its share, not another",
        Load(64, 1, None, None, None, 2, (JobLoad("a", 22, 16, 5), JobLoad("b", 40, 16, 1))),
        EvictIdle("b"),
    ),
    (
        "full, the job past its share has nothing idle: refused",
        Load(64, 1, None, None, None, 1, (JobLoad("lines", 64, 64, 0),)),
        Refuse,
    ),
]


@pytest.mark.parametrize("what,load,expected", ADMISSION, ids=[a[0] for a in ADMISSION])
def test_admission_from_a_table(what, load, expected):
    got = admit(CAPS, "a", load)
    if expected is Refuse:
        assert isinstance(got, Refuse) and got.reason
    elif isinstance(expected, str):
        assert got == EvictWaiting(expected)
    else:
        assert got == expected


SETTLE = [
    ("within the floor", JobLoad("j", 8, 0, 7), Admit()),
    ("within its ranks' bound", JobLoad("j", 40, 10, 30), Admit()),
    ("past it: its own idle one closes", JobLoad("j", 41, 10, 30), EvictIdle("j")),
    ("past it, nothing idle: refused", JobLoad("j", 9, 1, 0), Refuse),
]


@pytest.mark.parametrize("what,load,expected", SETTLE, ids=[s[0] for s in SETTLE])
def test_a_job_past_its_bound_closes_its_own_idle_connections_only(what, load, expected):
    got = settle(CAPS, load)
    assert isinstance(got, Refuse) if expected is Refuse else got == expected


def test_a_jobs_share_of_a_full_lighthouse_leaves_room_for_one_more_job():
    assert CAPS.job_bound(100) == 400 and CAPS.job_bound(100, full=True, jobs=1) == 32
    assert CAPS.job_bound(0) == 8 and CAPS.job_bound(0, full=True, jobs=15) == 4


def test_the_ledger_counts_tokenless_connections_per_address_oldest_first():
    led: AdmissionCounts[str] = AdmissionCounts()
    for i, peer in enumerate(["a", "b", "b", "c", "b"]):
        led.open(f"{peer}{i}", peer, now=float(i))
    load = led.load("b", now=10.0, full=False)
    assert (load.total, load.peer, load.waiting) == (5, 3, Waiting("b", 3, 9.0))
    assert load.most == Waiting("b", 3, 9.0) and load.oldest == Waiting("a", 1, 10.0)
    led.signed_in("b1")
    led.close("b2")
    assert led.load("b", 10.0, False).most in (Waiting("a", 1, 10.0), Waiting("b", 1, 6.0), Waiting("c", 1, 7.0))
    assert led.oldest_waiting("b") == "b4" and len(led) == 4


def test_the_ledger_keeps_a_ranks_newest_line_and_lists_the_rest_idle_least_recently_used_first():
    led: AdmissionCounts[str] = AdmissionCounts()
    for c in ["line", "again", "status", "quorum"]:
        led.open(c, "a", 0.0)
        assert led.account(c, "j") is not None and led.account(c, "j") is None  # counted once
        led.busy(c, True)
    led.line("line", (0, 0))
    led.line("again", (0, 0))  # the rank reconnected: its old line is no longer protected
    for c in ["status", "line", "again"]:
        led.busy(c, False)
    assert led.is_line("again") and not led.is_line("line")
    assert list(led.idle["j"]) == ["status", "line"]  # "quorum" waits for its round
    assert led.load("a", 0.0, full=True).idle == (JobLoad("j", 4, 1, 2),)
    led.busy("status", True)
    led.busy("status", False)
    assert led.oldest_idle("j") == "line"
    for c in ["line", "again", "status", "quorum"]:
        led.close(c)
    assert not led.held and not led.idle and not led.lines and not led.per_peer
