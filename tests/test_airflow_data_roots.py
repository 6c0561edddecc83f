"""The data roots (FTREC_DATA_ROOTS): a data_source param or an asset event's path is read only
under them, and an ingest error names the file, line and field, never their content. Runs the
task bodies with a faked task context: no scheduler."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("AIRFLOW_HOME", str(ROOT / "work" / "test-airflow-home"))

from airflow.sdk.exceptions import AirflowFailException  # noqa: E402

from ftrec_airflow import pipeline_ops, settings, tasks  # noqa: E402

SECRET = "machine x login u password SECRET123\n"
PARAMS = {"replica_groups": 1, "ranks_per_group": 1, "synth_users": 10, "synth_items": 10, "seed": 0}


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """tmp_path/data is the one allowed root; tmp_path/outside is not; events come from `posted`."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    data.mkdir()
    outside.mkdir()
    monkeypatch.setenv("FTREC_DATA_ROOTS", str(data))
    monkeypatch.setenv("FTREC_WORK", str(tmp_path / "work"))
    posted: list = []
    ctx = {
        "ti": SimpleNamespace(dag_id="ftrec_retrain"),
        "run_id": "r1",
        "triggering_asset_events": {"ftrec_interactions": posted},
    }
    monkeypatch.setattr(tasks, "get_current_context", lambda: ctx)
    return SimpleNamespace(data=data, outside=outside, posted=posted)


def _ingest(source: str, fmt: str = "sasrec") -> dict:
    return tasks.ingest_validate({**PARAMS, "data_source": source, "data_format": fmt})


def _refused(fn, *args) -> str:
    with pytest.raises(AirflowFailException) as e:
        fn(*args)
    return str(e.value)


def test_default_roots_are_the_shared_data_and_the_work_folder(monkeypatch):
    monkeypatch.delenv("FTREC_DATA_ROOTS", raising=False)
    real = [Path(os.path.realpath(p)) for p in (settings.shared_data(), settings.work_root())]
    assert settings.data_roots() == real


def test_a_path_outside_the_roots_is_refused_before_it_is_opened(roots, monkeypatch):
    (roots.outside / "x.txt").write_text(SECRET)
    opened = []
    monkeypatch.setattr(pipeline_ops, "_sniff_text", lambda *a: opened.append(a))
    for source in (str(roots.outside / "x.txt"), (roots.outside / "x.txt").as_uri(), str(roots.outside / "nope")):
        msg = _refused(_ingest, source)
        assert "FTREC_DATA_ROOTS" in msg and source in msg and "does not exist" not in msg
    assert not opened


def test_links_and_dotdot_cannot_leave_a_root(roots):
    (roots.outside / "x.txt").write_text("1 2\n")
    (roots.data / "link.txt").symlink_to(roots.outside / "x.txt")
    (roots.data / "dir").mkdir()
    (roots.data / "dir" / "link.txt").symlink_to(roots.outside / "x.txt")
    for source in (
        str(roots.data / "link.txt"),
        f"{roots.data}/../outside/x.txt",
        f"file://{roots.data}/../outside/x.txt",
        str(roots.data / "dir"),  # a folder holding a link out
    ):
        assert "FTREC_DATA_ROOTS" in _refused(_ingest, source)


def test_an_asset_event_path_is_held_to_the_roots(roots):
    (roots.outside / "x.txt").write_text("1 2\n")
    roots.posted.append(SimpleNamespace(extra={"path": str(roots.outside / "x.txt"), "format": "sasrec"}))
    params = {**PARAMS, "data_source": "auto", "data_format": "iclrec"}
    assert "FTREC_DATA_ROOTS" in _refused(tasks.ingest_new_data, params)


def test_a_file_under_a_root_ingests(roots):
    f = roots.data / "events.txt"
    f.write_text("".join(f"{u} {i}\n" for u in range(5) for i in range(3)))
    for source in (str(f), f.as_uri()):
        got = _ingest(source)
        assert got["path"] == str(f.resolve()) and got["format"] == "sasrec" and not got["synthetic"]
    roots.posted.append(SimpleNamespace(extra={"path": str(f), "format": "sasrec"}))
    assert tasks.ingest_new_data({**PARAMS, "data_source": "auto", "data_format": "iclrec"})["path"] == str(f.resolve())


def test_other_urls_are_not_read_as_local_paths(roots):
    assert "not a local path" in _refused(_ingest, "s3://bucket/events.txt")


@pytest.mark.parametrize("fmt", ["iclrec", "sasrec"])
def test_a_secret_under_a_root_fails_without_showing_it(roots, caplog, fmt):
    netrc = roots.data / ".netrc"
    netrc.write_text(SECRET + "machine y login v password SECRET456\n")
    msg = _refused(_ingest, str(netrc), fmt)
    assert "line 1" in msg and str(netrc) in msg
    assert "SECRET" not in msg and "password" not in msg and "SECRET" not in caplog.text
