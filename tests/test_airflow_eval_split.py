"""The training DAGs' split (ftrec_airflow.eval_split): "auto" from the data's format, the
split params and the triggering asset event's cut and horizon (the params win where set), what a
user gets wrong named; and the fanned-out build's stages, as the DAG's tasks run them
(shard_tasks), build the in-memory build's temporal set byte for byte."""

import re
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from airflow.sdk.exceptions import AirflowFailException
from test_dataprep_bucketed import _assert_same

from dataprep.build import build_shards
from dataprep.readers import TIME_FORMATS
from dataprep.synth import write_synthetic
from ftrec_airflow import eval_split, pipeline, pipeline_ops, shard_tasks, tasks
from ftrec_airflow.eval_split import RunSplit

PARAMS = {name: default for name, (default, _, _) in pipeline.PARAMS.items()}  # the DAGs' defaults
CUT, HORIZON = 1_700_000_000, 86_400
EVENT = {"cut": CUT, "horizon": HORIZON}


@pytest.mark.parametrize(
    "fmt, params, event, want",
    [
        ("iclrec", {}, {}, RunSplit("leave_one_out")),  # the shared Beauty file: `make run` as before
        ("sasrec", PARAMS, {}, RunSplit("leave_one_out")),
        ("events", PARAMS, {}, RunSplit("temporal")),  # dataprep's default cut and horizon
        ("movielens", PARAMS, EVENT, RunSplit("temporal", CUT, HORIZON, "asset event")),
        ("events", PARAMS | {"split_cut": 5}, EVENT, RunSplit("temporal", 5, HORIZON, "param split_cut")),
        ("events", PARAMS | {"split_horizon": 60}, EVENT, RunSplit("temporal", CUT, 60, "asset event")),
        ("events", PARAMS | {"split": "leave_one_out"}, EVENT, RunSplit("leave_one_out")),  # said, so it wins
        (
            "events",
            PARAMS | {"split": "temporal", "split_cut": 7},
            {},
            RunSplit("temporal", 7, None, "param split_cut"),
        ),
    ],
)
def test_the_split_from_the_format_the_params_and_the_event(fmt, params, event, want):
    assert eval_split.resolve(fmt, params, event, TIME_FORMATS) == want


@pytest.mark.parametrize(
    "fmt, params, event, error",
    [
        (
            "sasrec",
            PARAMS | {"split": "temporal"},
            {},
            "param split=temporal needs event times, and data_format sasrec",
        ),
        ("iclrec", PARAMS | {"split_cut": 5}, {}, "param split_cut asks for a temporal split, and data_format iclrec"),
        ("iclrec", PARAMS, EVENT, "asset event extra 'cut' asks for a temporal split, and data_format iclrec"),
        (
            "events",
            PARAMS | {"split": "leave_one_out", "split_horizon": 5},
            {},
            "split_horizon belong to split=temporal",
        ),
        ("events", PARAMS | {"split": "random"}, {}, "param split='random': use one of auto, leave_one_out, temporal"),
        ("events", PARAMS | {"split_cut": "soon"}, {}, "param split_cut='soon': must be an integer number of seconds"),
        ("events", PARAMS | {"split_horizon": 0}, {}, "param split_horizon=0: must be >= 1 second"),
    ],
)
def test_what_a_user_gets_wrong_in_the_params_is_named(fmt, params, event, error):
    with pytest.raises(pipeline_ops.UserError, match=re.escape(error)):
        eval_split.resolve(fmt, params, event, TIME_FORMATS)


@pytest.mark.parametrize(
    "extra, error",
    [
        ({"cut": "2024-01-01"}, "asset event extra 'cut'='2024-01-01': must be an integer number of seconds"),
        ({"cut": 1.7e9}, "asset event extra 'cut'=1700000000.0: must be an integer"),
        ({"cut": True}, "asset event extra 'cut'=True: must be an integer"),
        ({"cut": CUT, "horizon": 0}, "asset event extra 'horizon'=0: must be >= 1 second"),
    ],
)
def test_an_events_bad_window_is_named(extra, error):
    with pytest.raises(pipeline_ops.UserError, match=re.escape(error)):
        eval_split.event_window(extra)


def _context(monkeypatch, tmp_path, *extras: dict) -> None:
    """The task context the task bodies read: the run, and the events that triggered it, oldest first."""
    events = {"ftrec_interactions": [SimpleNamespace(extra=e) for e in extras]}
    ctx = {"ti": SimpleNamespace(dag_id="ftrec_retrain"), "run_id": "r", "triggering_asset_events": events}
    monkeypatch.setattr(tasks, "get_current_context", lambda: ctx)
    monkeypatch.setenv("FTREC_WORK", str(tmp_path / "work"))
    monkeypatch.setenv("FTREC_DATA_ROOTS", str(tmp_path))


def test_a_retrain_run_splits_at_the_window_of_its_event(monkeypatch, tmp_path):
    """ingest_new_data reads the newest event's data and the newest event's window (an event may
    bring a window alone); shard_spec builds at it unless the params say otherwise."""
    pq.write_table(pa.table({"user_id": [1, 1, 1], "item_id": [1, 2, 3], "timestamp": [1, 2, 3]}), tmp_path / "e.pq")
    _context(
        monkeypatch,
        tmp_path,
        {"path": "/elsewhere/old.parquet", "format": "events", "cut": 1},
        {"cut": CUT, "horizon": HORIZON},  # a window for the data already there
        {"path": str(tmp_path / "e.pq"), "format": "events"},
    )
    data = tasks.ingest_new_data(params=PARAMS)
    assert (data["path"], data["format"], data["window"]) == (str(tmp_path / "e.pq"), "events", EVENT)
    spec = tasks.shard_spec(data, params=PARAMS)
    assert (spec.split, spec.cut, spec.horizon) == ("temporal", CUT, HORIZON)
    spec = tasks.shard_spec(data, params=PARAMS | {"split_cut": 5})
    assert (spec.split, spec.cut, spec.horizon) == ("temporal", 5, HORIZON)
    assert tasks.shard_spec({**data, "window": {}}, params=PARAMS).cut is None  # the daily run: the default cut
    _context(monkeypatch, tmp_path, {"path": str(tmp_path / "e.pq"), "format": "events", "horizon": -3})
    with pytest.raises(AirflowFailException, match="asset event extra 'horizon'=-3: must be >= 1 second"):
        tasks.ingest_new_data(params=PARAMS)
    with pytest.raises(AirflowFailException, match="param split=temporal needs event times, and data_format sasrec"):
        tasks.shard_spec({"path": "x", "format": "sasrec"}, params=PARAMS | {"split": "temporal"})


def test_the_fanned_out_stages_build_the_in_memory_temporal_set(tmp_path):
    """shard_tasks' prepare, the mapped stages (each in a child process), plan and seal, as the
    DAG's build_shards group runs them, on a temporal spec: the in-memory build's set."""
    src = write_synthetic(str(tmp_path / "ev.parquet"), users=300, items=80, seed=2, fmt="events", median_len=8)
    kw = dict(world_size=2, batch_size=8, max_len=10)
    spec = pipeline_ops.ShardSpec(input=src, fmt="events", out=str(tmp_path / "set"), split="temporal", **kw)
    p = shard_tasks.prepare(spec, buckets=2, memory_budget=None, log=lambda line: None)
    stage = p["stage"]
    for s in p["spans"]:
        shard_tasks.run_stage("scan", stage, s)
    nb = shard_tasks.run_stage("ids", stage)["buckets"]
    for name, n in (("split", len(p["spans"])), ("bucket", nb)):
        for i in range(n):
            shard_tasks.run_stage(name, stage, i)
    shard_tasks.plan(stage, log=lambda line: None)
    for name, n in (("route", nb), ("write", spec.world_size)):
        for i in range(n):
            shard_tasks.run_stage(name, stage, i)
    summary = shard_tasks.seal(stage, spec.out, log=lambda line: None)
    assert nb == 2 and summary["config"]["split"] == "temporal"
    ref = build_shards(src, "events", str(tmp_path / "ref"), split="temporal", **kw)
    _assert_same(tmp_path / "ref", tmp_path / "set")
    assert ref["split"]["test_users"] > 0
