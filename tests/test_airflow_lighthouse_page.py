"""The lighthouse page reads no file it was not meant to and sends no secret where a run
folder points: one test per probe of issue 23 (planted lighthouse.json, a name that starts
with "127.", symlinks, a missing or multi-line token file, colliding run folders and job
ids, a non-numeric fetched_at). Real sockets on loopback, the real FastAPI app."""

import json
import os
import socket
import threading

import pytest

from ftrec_airflow import lighthouse_status, settings

RUN = {"dag_id": "ftrec_train", "run_id": "probe"}


@pytest.fixture
def page(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from ftrec_airflow import lighthouse_app

    monkeypatch.setenv("FTREC_WORK", str(tmp_path / "work"))
    for k in ("FTREC_LIGHTHOUSE_URL", "FTCORE_TOKEN", "FTCORE_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    lighthouse_app.app.dependency_overrides[lighthouse_app.can_read_runs] = lambda: None
    try:
        yield TestClient(lighthouse_app.app, raise_server_exceptions=False)
    finally:
        lighthouse_app.app.dependency_overrides.clear()


@pytest.fixture
def listener_reply():
    return b"{}"


@pytest.fixture
def listener(free_port, listener_reply):
    """A loopback socket that records the first request it gets (what the page would send)
    and answers `listener_reply`."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", free_port))
    srv.listen(4)
    srv.settimeout(3)
    seen: list[bytes] = []

    def serve():
        try:
            conn, _ = srv.accept()
            conn.settimeout(2)
            seen.append(conn.recv(65536))
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(listener_reply)}\r\nConnection: close\r\n\r\n"
            conn.sendall(head.encode() + listener_reply)
            conn.close()
        except OSError:
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{free_port}", seen, t
    srv.close()


def _plant(doc: dict) -> None:
    run = settings.run_folder(RUN["dag_id"], RUN["run_id"])
    run.mkdir(parents=True, exist_ok=True)
    (run / lighthouse_status.SNAPSHOT).write_text(json.dumps(doc))


def test_a_planted_remote_url_is_never_contacted(page):
    _plant({"url": "http://203.0.113.7:80", "status": {"max_step": 3}})
    doc = page.get("/lighthouse/status", params=RUN).json()
    assert doc["url"] == "" and doc["live"] is False and "neither FTREC_LIGHTHOUSE_URL" in doc["note"]


@pytest.mark.parametrize(
    "host", ["127.attacker.example", "127.0.0.1.nip.io", "localhost", "0x7f.example", "[::ffff:203.0.113.7]"]
)
def test_a_loopback_looking_name_is_not_loopback(page, host):
    from ftrec_airflow.lighthouse_app import loopback_url

    assert loopback_url(f"http://{host}:8080") is None
    _plant({"url": f"http://{host}:8080", "status": None})
    assert page.get("/lighthouse/status", params=RUN).json()["url"] == ""


def test_numeric_loopback_addresses_are_rebuilt_not_echoed():
    from ftrec_airflow.lighthouse_app import loopback_url

    assert loopback_url("127.0.0.1:29510") == "http://127.0.0.1:29510"
    assert loopback_url("http://127.9.8.7:1/") == "http://127.9.8.7:1"
    assert loopback_url("http://[::1]:80") == "http://[::1]:80"
    for bad in ("https://127.0.0.1:1", "http://u:p@127.0.0.1:1", "http://127.0.0.1:1/x?y", "http://127.0.0.1"):
        assert loopback_url(bad) is None, bad


def test_the_token_is_the_servers_never_a_run_folders(page, listener, monkeypatch, tmp_path):
    """A loopback lighthouse (a launcher's own: one job, "default") gets that job's token
    derived from this server's FTCORE_TOKEN_FILE secret, never the secret; the run's own
    train/token (anyone's file) is never read."""
    from ftcore import auth

    url, seen, t = listener
    run = settings.run_folder(RUN["dag_id"], RUN["run_id"])
    (run / "train").mkdir(parents=True)
    (run / "train" / "token").write_text("planted-run-token")
    server = tmp_path / "server-token"
    server.write_text("server-secret\n")
    monkeypatch.setenv("FTCORE_TOKEN_FILE", str(server))
    _plant({"url": url, "status": None})
    page.get("/lighthouse/status", params=RUN)
    t.join(5)
    derived = auth.job_token("server-secret", "default")
    assert seen and f"Authorization: Bearer {derived}".encode() in seen[0]
    assert b"server-secret" not in seen[0] and b"planted-run-token" not in seen[0]


def test_no_server_token_means_no_authorization_header(page, listener):
    url, seen, t = listener
    _plant({"url": url, "status": None})
    page.get("/lighthouse/status", params=RUN)
    t.join(5)
    assert seen and b"Authorization" not in seen[0]


def test_a_multi_line_token_file_is_refused_without_showing_it(page, listener, monkeypatch, tmp_path):
    url, seen, t = listener
    cfg = tmp_path / "airflow.cfg"
    cfg.write_text(
        "[core]\nfernet_key = AAAA-fernet\nsecret_key = BBBB-secret\nsql_alchemy_conn = postgresql://u:pw@db/af\n"
    )
    monkeypatch.setenv("FTCORE_TOKEN_FILE", str(cfg))
    _plant({"url": url, "status": None})
    doc = page.get("/lighthouse/status", params=RUN).json()
    html = page.get("/lighthouse/", params=RUN).text
    t.join(1)
    assert not seen  # nothing was sent anywhere
    assert "does not hold one token" in doc["error"]
    for secret in ("AAAA-fernet", "BBBB-secret", "postgresql", "fernet_key"):
        assert secret not in json.dumps(doc) and secret not in html


def test_a_symlinked_snapshot_timeline_or_run_folder_is_not_followed(page, tmp_path):
    secret = tmp_path / "airflow.cfg"
    secret.write_text(json.dumps({"url": "http://127.0.0.1:9", "status": {"fernet_key": "AAAA"}}))
    run = settings.run_folder(RUN["dag_id"], RUN["run_id"])
    (run / "train").mkdir(parents=True)
    os.symlink(secret, run / lighthouse_status.SNAPSHOT)
    os.symlink(secret, run / "train" / "timeline.json")
    doc = page.get("/lighthouse/status", params=RUN).json()
    assert doc["status"] is None and doc["timeline"] is None and "AAAA" not in json.dumps(doc)
    # a run folder that is itself a link to another folder
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / lighthouse_status.SNAPSHOT).write_text(json.dumps({"status": {"max_step": 99}}))
    os.symlink(other, settings.run_folder(RUN["dag_id"], "linked"))
    assert lighthouse_status.read_snapshot(settings.run_folder(RUN["dag_id"], "linked")) is None


def test_a_non_numeric_fetched_at_is_a_message_not_a_500(page):
    _plant({"url": "", "fetched_at": "yesterday", "status": {"max_step": 3, "groups": []}})
    r = page.get("/lighthouse/", params=RUN)
    assert r.status_code == 200 and "fetched_at is not a time" in r.text
    doc = page.get("/lighthouse/status", params=RUN).json()
    assert doc["fetched_at"] is None and doc["status"]["max_step"] == 3


def test_run_folders_of_lookalike_dag_ids_differ_and_decode(tmp_path, monkeypatch):
    monkeypatch.setenv("FTREC_WORK", str(tmp_path))
    ids = ["x", "_x", "x_", ".x", "x.", "-x", "x/y", "x_2f", "", ".", "..", "é"]
    folders = {settings.run_folder(d, "r") for d in ids}
    assert len(folders) == len(ids)
    for d in ids:
        name = settings.slug(d)
        assert settings.unslug(name) == d and name not in (".", "..", "") and "/" not in name
    long = {settings.slug("r" * 300 + str(i)) for i in range(3)}
    assert len(long) == 3 and all(len(n) <= settings.NAME_MAX for n in long)


def test_long_job_ids_are_never_cut_into_each_other():
    import re

    job_id = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+@=-]{0,127}")  # ftcore/messages.py JOB_ID
    keys = [f"ftrec_train/{'r' * 200}{i}/train" for i in range(3)] + ["a b/c", "a-b/c", "a=b", "=x"]
    jobs = [settings.lighthouse_job_id(k) for k in keys]
    assert len(set(jobs)) == len(keys) and all(job_id.fullmatch(j) for j in jobs), jobs
    plain = "ftrec_train/manual__2026-01-01T00:00:00+00:00/train"
    assert settings.lighthouse_job_id(plain) == plain  # a key that fits stays readable


def test_no_standing_lighthouse_is_a_plain_note_not_an_error(page):
    """Browse -> "ftcore lighthouse" with FTREC_LIGHTHOUSE_URL unset: the default, said plainly."""
    doc = page.get("/lighthouse/status").json()
    assert doc["error"] == "" and doc["source"] == "none"
    html = page.get("/lighthouse/").text
    assert "No standing lighthouse is configured" in html and "class=bad" not in html


JOB = settings.lighthouse_job_id("ftrec_train/probe/train")


@pytest.mark.parametrize("listener_reply", [json.dumps({"jobs": ["other/run/train", JOB], "max_step": 7}).encode()])
def test_the_standing_lighthouse_is_asked_with_the_runs_job_token_and_shows_that_job(page, listener, monkeypatch):
    """Issue 41: the admin secret would list every live job; the page sends the run's job
    token (ftcore.auth.job_token), asks for that job, and shows no other job's id."""
    from ftcore import auth

    url, seen, t = listener
    monkeypatch.setenv("FTREC_LIGHTHOUSE_URL", url)
    monkeypatch.setenv("FTCORE_TOKEN", "admin-secret")
    _plant({"url": url, "status": None, "job": JOB})
    doc = page.get("/lighthouse/status", params=RUN).json()
    t.join(5)
    assert seen and f"Authorization: Bearer {auth.job_token('admin-secret', JOB)}".encode() in seen[0]
    assert b"admin-secret" not in seen[0] and b"/status?job=" in seen[0].split(b"\r\n")[0]
    assert doc["live"] and doc["status"]["jobs"] == [JOB] and "other/run/train" not in json.dumps(doc)


def test_fetch_status_for_a_job_sends_that_jobs_token_not_the_secret(listener):
    from ftcore import auth

    url, seen, t = listener
    lighthouse_status.fetch_status(url, job="j1", token="admin-secret")
    t.join(5)
    assert f"Bearer {auth.job_token('admin-secret', 'j1')}".encode() in seen[0] and b"admin-secret" not in seen[0]


def _planted_timeline(groups: int, events: int) -> dict:
    """`groups` groups committing one step each, and `events` events spread over them."""
    steps = [{"t": 1.0 + g * 1e-4, "group": g, "rank": 0, "step": 1, "committed": True} for g in range(groups)]
    kinds = ["fault", "group_failed", "heal_finished", "checkpoint"]
    evs = [{"t": 2.0 + i * 1e-4, "kind": kinds[i % 4], "group": i % groups} for i in range(events)]
    half = events // 2
    return {"exit_code": 0, "steps": steps, "launcher_events": evs[:half], "lighthouse_events": evs[half:]}


def test_a_planted_huge_timeline_renders_bounded_with_more_notes(page, monkeypatch):
    """Issue 41: 20,000 groups and 200,000 events render in one pass to a bounded page."""
    from ftrec_airflow import lighthouse_app

    monkeypatch.setattr(lighthouse_app, "INLINE_MAX_BYTES", 32 << 20)  # parsed here, as a small one is
    run = settings.run_folder(RUN["dag_id"], RUN["run_id"])
    (run / "train").mkdir(parents=True)
    raw = json.dumps(_planted_timeline(20_000, 200_000), separators=(",", ":"))
    assert len(raw) < 20 << 20
    (run / "train" / "timeline.json").write_text(raw)
    r = page.get("/lighthouse/", params=RUN)
    doc = page.get("/lighthouse/status", params=RUN).json()
    assert r.status_code == 200 and len(r.text) < 120_000, len(r.text)
    assert len(json.dumps(doc)) < 120_000
    assert r.text.count("class=group-row") == 64 and "19936 more groups not shown (64 of 20000)" in r.text
    assert r.text.count("<polyline class='group'") == 16 and "19984 more groups in the chart" in r.text
    assert r.text.count("class='mark'") <= 201 and "more marks in the chart" in r.text
    assert "199950 more older events not shown (50 of 200000)" in r.text
    assert doc["timeline"]["groups_total"] == 20_000 and doc["timeline"]["events_total"] == 200_000


def test_a_timeline_over_the_size_bound_is_refused_plainly(page, monkeypatch):
    from ftrec_airflow import lighthouse_app

    monkeypatch.setattr(lighthouse_app, "TIMELINE_MAX_BYTES", 4096)
    run = settings.run_folder(RUN["dag_id"], RUN["run_id"])
    (run / "train").mkdir(parents=True)
    (run / "train" / "timeline.json").write_text(json.dumps(_planted_timeline(10, 200)))
    r = page.get("/lighthouse/", params=RUN)
    doc = page.get("/lighthouse/status", params=RUN).json()
    assert r.status_code == 200 and "bound of 0.00391 MiB" in r.text
    assert "timeline.json is" in r.text and "over the page" in r.text and "FTREC_TIMELINE_MAX_MB" in r.text
    assert doc["timeline"] is None and "over the page's bound" in doc["note"]


def test_a_timeline_of_the_wrong_shape_is_a_message_not_a_500(page):
    run = settings.run_folder(RUN["dag_id"], RUN["run_id"])
    (run / "train").mkdir(parents=True)
    (run / "train" / "timeline.json").write_text(
        json.dumps({"steps": [{"t": 1, "group": "x", "committed": 1, "step": 1}]})
    )
    r = page.get("/lighthouse/", params=RUN)
    assert r.status_code == 200 and "not a timeline the page can read" in r.text


def _train_folder():
    run = settings.run_folder(RUN["dag_id"], RUN["run_id"])
    (run / "train").mkdir(parents=True, exist_ok=True)
    return run / "train"


def test_the_writers_summary_is_used_and_a_replaced_timeline_is_not_taken_for_it(page, monkeypatch):
    """Issue 41: the launcher's timeline.summary.json is what the page shows, read and checked
    instead of the timeline parsed; a timeline replaced beside it (the same size: only the
    sha256 tells) is summarized afresh, never shown with the other one's summary."""
    from ftrec_airflow import lighthouse_app
    from training import timeline_summary

    parsed = []
    monkeypatch.setattr(
        lighthouse_app, "_parsed", lambda raw, real=lighthouse_app._parsed: parsed.append(1) or real(raw)
    )
    train = _train_folder()
    timeline_summary.write(str(train), _planted_timeline(3, 10))
    doc = page.get("/lighthouse/status", params=RUN).json()
    assert parsed == [] and doc["timeline"]["groups_total"] == 3 and doc["timeline"]["exit_code"] == 0
    assert "<b>finished</b>" in page.get("/lighthouse/", params=RUN).text and parsed == []
    raw = (train / "timeline.json").read_bytes()
    (train / "timeline.json").write_bytes(raw.replace(b'"exit_code": 0', b'"exit_code": 7'))
    doc = page.get("/lighthouse/status", params=RUN).json()
    assert parsed == [1] and doc["timeline"]["exit_code"] == 7 and doc["note"] == ""


def _bad_summaries() -> list:
    from training import timeline, timeline_summary

    good = timeline_summary.bounded(timeline.summary(_planted_timeline(3, 10)))
    return [
        b"not json",
        json.dumps({"summary": good}).encode(),  # no stamp
        {**good, "groups": "everything"},
        {**good, "groups": [{**good["groups"][0], "checksum": ["a list"]}]},
        {**good, "series": {**good["series"], "marks": [[1.0, 0, "<script>"]]}},
        {**good, "series": {**good["series"], "groups": {"x": [[1.0, 1]]}}},
        {**good, "events_total": -1},
        {**good, "kinds": {"fault": "many"}},
        {**good, "exit_code": 1e400},
        [],
    ]


@pytest.mark.parametrize("bad", range(10))
def test_a_planted_summary_of_the_wrong_shape_is_a_refusal_not_a_500(page, bad):
    from training import timeline_summary

    train = _train_folder()
    data = json.dumps(_planted_timeline(3, 10)).encode()
    (train / "timeline.json").write_bytes(data)
    planted = _bad_summaries()[bad]
    doc = {"timeline": timeline_summary.stamp(data), "summary": planted}
    (train / timeline_summary.FILE).write_bytes(planted if isinstance(planted, bytes) else json.dumps(doc).encode())
    r = page.get("/lighthouse/", params=RUN)
    assert r.status_code == 200 and "not a timeline the page can read" in r.text and "<script>" not in r.text


def test_a_planted_summary_is_cut_to_the_pages_bounds(page):
    """Long lists and long texts in a matching summary are cut, never rendered whole."""
    from training import timeline, timeline_summary

    train = _train_folder()
    data = json.dumps(_planted_timeline(3, 10)).encode()
    (train / "timeline.json").write_bytes(data)
    s = timeline.summary(_planted_timeline(3, 10))
    ev = {"t": 5.0, "kind": "k" * 1000, **{f"f{i}": "v" * 500 for i in range(20)}}
    s.update(events=[ev] * 30, groups=s["groups"] * 2000, kinds={f"kind{i}": i for i in range(2000)})
    s["groups"][0] = {**s["groups"][0], "checksum": "c" * 100_000}
    doc = {"timeline": timeline_summary.stamp(data), "summary": s}
    (train / timeline_summary.FILE).write_text(json.dumps(doc))
    assert (train / timeline_summary.FILE).stat().st_size > 1 << 20  # over the page's bound: not read
    assert page.get("/lighthouse/status", params=RUN).json()["timeline"]["groups_total"] == 3  # ignored: parsed
    s.update(events=[{**ev, "f0": "v" * 5000}] * 52, groups=s["groups"][:100])
    (train / timeline_summary.FILE).write_text(json.dumps(doc))
    r = page.get("/lighthouse/", params=RUN)
    got = page.get("/lighthouse/status", params=RUN).json()
    assert r.status_code == 200 and len(r.text) < 120_000 and len(json.dumps(got)) < 120_000
    assert r.text.count("class=group-row") == 64 and len(got["timeline"]["kinds"]) == 32
    assert len(got["timeline"]["events"]) == 50 and len(got["timeline"]["events"][0]) == 14


@pytest.fixture
def summaries(monkeypatch):
    """The page with a fresh worker, and a timeline over 1 KiB not parsed on the request."""
    from ftrec_airflow import lighthouse_app, timeline_cache

    fresh = timeline_cache.Summaries(lambda fd: timeline_cache.in_child(fd, lighthouse_app.TIMELINE_MAX_BYTES))
    monkeypatch.setattr(lighthouse_app, "SUMMARIES", fresh)
    monkeypatch.setattr(lighthouse_app, "INLINE_MAX_BYTES", 1024)
    return fresh


def _until_summarized(page, deadline_s: float = 30.0) -> dict:
    import time

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        doc = page.get("/lighthouse/status", params=RUN).json()
        if not doc["pending"]:
            return doc
        time.sleep(0.05)
    raise AssertionError("the worker did not summarize the timeline in time")


def test_a_large_timeline_without_a_summary_renders_at_once_and_is_summarized_off_the_request(page, summaries):
    train = _train_folder()
    (train / "timeline.json").write_text(json.dumps(_planted_timeline(20, 2000)))
    r = page.get("/lighthouse/", params=RUN)
    assert r.status_code == 200 and "summarizing this run&#x27;s timeline (0 MiB)" in r.text
    assert "http-equiv='refresh'" in r.text  # and the page asks again by itself
    doc = page.get("/lighthouse/status", params=RUN).json()
    assert doc["pending"] and doc["note"] == "summarizing this run's timeline (0 MiB): refresh in a few seconds"
    doc = _until_summarized(page)
    assert doc["timeline"]["groups_total"] == 20 and doc["timeline"]["events_total"] == 2000 and doc["note"] == ""
    assert "<b>finished</b>" in page.get("/lighthouse/", params=RUN).text
    assert sorted(p.name for p in train.iterdir()) == ["timeline.json"]  # the API server wrote nothing there
    (train / "timeline.json").write_text("[" * 5000 + "not a timeline" + " " * 2000)  # replaced: summarized again
    assert page.get("/lighthouse/status", params=RUN).json()["pending"]
    doc = _until_summarized(page)
    assert doc["timeline"] is None and "not a timeline the page can read" in doc["note"]


def test_the_worker_summarizes_one_timeline_at_a_time_from_a_bounded_queue(tmp_path):
    import threading
    import time

    from ftrec_airflow import timeline_cache

    active, most, started, release = [0], [0], threading.Event(), threading.Event()

    def run(fd):
        active[0] += 1
        most[0] = max(most[0], active[0])
        started.set()
        release.wait(10)
        time.sleep(0.01)
        active[0] -= 1
        return {"fd": os.fstat(fd).st_size}, ""

    s = timeline_cache.Summaries(run, slots=3, queue=2)
    f = tmp_path / "t.json"
    f.write_text("{}")
    keys = [(str(f), 1, 2, 3, i) for i in range(4)]
    with open(f, "rb") as fh:
        assert s.submit(keys[0], fh.fileno()) and started.wait(10)  # running: off the queue
        assert s.submit(keys[1], fh.fileno()) and s.submit(keys[1], fh.fileno()) and s.submit(keys[2], fh.fileno())
        assert not s.submit(keys[3], fh.fileno())  # the queue holds two
    release.set()
    end = time.monotonic() + 10
    while any(s.get(k) is None for k in keys[:3]) and time.monotonic() < end:
        time.sleep(0.01)
    assert [s.get(k) for k in keys] == [({"fd": 2}, "")] * 3 + [None] and most[0] == 1


def test_the_summarizing_child_is_capped_in_memory(tmp_path):
    """A planted timeline of tiny objects (6 MB of `{}`: each a dict in memory) costs the child
    many times its size: past its cap it says so and exits 2 (the page: not shown), no traceback."""
    import subprocess
    import sys

    planted = tmp_path / "timeline.json"
    planted.write_text('{"events": [' + ",".join(["{}"] * 2_000_000) + "]}")
    child = [sys.executable, "-m", "training.timeline_summary", "--max-bytes", str(8 << 20)]
    with planted.open("rb") as f:
        capped = subprocess.run([*child, "--max-memory", str(100 << 20)], stdin=f, capture_output=True, timeout=60)
    assert capped.returncode == 2 and capped.stdout == b"", capped.stderr
    assert capped.stderr.decode().strip() == "timeline: summarizing it needs over 100 MiB"
    with planted.open("rb") as f:  # the default cap (16 x max-bytes + 256 MiB) holds it
        default = subprocess.run(child, stdin=f, capture_output=True, timeout=60)
    assert default.returncode == 0 and json.loads(default.stdout)["groups_total"] == 0  # summarized: no groups
