"""The logged MLflow model serves raw item ids where only mlflow and torch are installed.

A tiny training run logs its model; a subprocess that cannot import ftrec loads it with
mlflow.pyfunc (and through `mlflow models predict --env-manager local`) and recommends.

Why a filtered interpreter and not a fresh venv: a venv with mlflow and torch would need a
network or minutes of copying. `python -I` (no PYTHONPATH, no user site, no script folder on
sys.path) from a folder outside the repo leaves one route to ftrec: the venv's editable
install, a meta-path finder plus a sys.path placeholder added by its .pth. The subprocess
removes both before importing anything and asserts that `training`, `dataprep` and `ftcore`
cannot be found: what remains is exactly the venv's third-party packages.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest
import torch

from dataprep.build import build_shards
from dataprep.schema import ITEM_MAP
from dataprep.synth import write_synthetic
from training import checkpoint
from training.config import ModelConfig, load_config
from training.model import SeqRec
from training.serving import Scorer
from training.train import train

ISOLATE = textwrap.dedent("""
    import sys
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    sys.path[:] = [p for p in sys.path if "__editable__" not in p]
    import importlib.util
    for name in ("training", "dataprep", "ftcore"):
        assert importlib.util.find_spec(name) is None, f"{name} is importable"
""")

SERVE = ISOLATE + textwrap.dedent("""
    import json, time
    import mlflow, pandas as pd
    from mlflow.cli import cli
    uri, histories, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    model = mlflow.pyfunc.load_model(uri)
    got = model.predict(pd.DataFrame({"history": histories}), params={"k": 5})
    batch = pd.DataFrame({"history": [histories[0]] * 32})
    model.predict(batch)
    t = time.perf_counter()
    model.predict(batch)
    latency = time.perf_counter() - t
    with open(out + ".in.json", "w") as f:
        json.dump({"dataframe_split": {"columns": ["history"], "data": [[h] for h in histories]},
                   "params": {"k": 5}}, f)
    cli.main(["models", "predict", "-m", uri, "-i", out + ".in.json", "-o", out + ".cli.json",
              "--env-manager", "local"], standalone_mode=False)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("training", "dataprep", "ftcore"))
    with open(out, "w") as f:
        json.dump({"items": got["items"].tolist(), "scores": got["scores"].tolist(), "leaked": leaked,
                   "latency_s": latency, "cli": json.load(open(out + ".cli.json"))}, f)
""")


def _isolated_python(code: str, args: list[str], cwd, timeout: float, env: dict) -> str:
    """`python -I -c code *args` from cwd, in its own process group, killed on timeout."""
    p = subprocess.Popen(
        [sys.executable, "-I", "-c", code, *args],
        cwd=cwd,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1", **env},
    )
    try:
        text, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        text, _ = p.communicate()
        pytest.fail(f"the isolated interpreter did not finish in {timeout}s:\n{text[-4000:]}")
    assert p.returncode == 0, text[-4000:]
    return text


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 6-step run on synthetic data whose raw item ids (1000 + 13 i) are none of its dense ids."""
    d = tmp_path_factory.mktemp("serve")
    write_synthetic(str(d / "synth.txt"), users=200, items=100, seed=4, median_len=8, max_history=40)
    with open(d / "synth.txt") as src, open(d / "ev.txt", "w") as dst:
        for line in src:
            user, item = line.split()
            dst.write(f"{user} {1000 + 13 * int(item)}\n")
    build_shards(str(d / "ev.txt"), "sasrec", str(d / "shards"), world_size=1, batch_size=16, max_len=16)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the embedded store, artifacts under the run's out
        res = train(
            load_config(
                None,
                [
                    f"data.shards={d / 'shards'}",
                    f"train.out={d / 'run'}",
                    "train.max_steps=6",
                    "model.dim=16",
                    "loss.kind=sampled_softmax",
                    "loss.num_negatives=16",
                    "eval.periodic=false",
                    "mlflow.plots=false",
                ],
            )
        )
    assert res["mlflow_unsent"] == 0
    return res, str(d / "shards")


@pytest.mark.parametrize("attention,similarity", [("sasrec", "dot"), ("hstu", "cosine")])
def test_exported_scorer_equals_seqrec(attention, similarity):
    torch.manual_seed(0)
    model = SeqRec(50, ModelConfig(attention=attention, dim=16, num_heads=2, max_len=8, similarity=similarity)).eval()
    program = torch.export.export(
        Scorer(model),
        (torch.ones(2, 2, dtype=torch.int64),),
        dynamic_shapes={"items": {0: torch.export.Dim("batch", min=1), 1: torch.export.Dim("length", min=1, max=8)}},
    ).module()
    histories = [[3, 4, 5], [7], list(range(1, 9)), [50, 1]]
    values = torch.tensor(sum(histories, []))
    offsets = torch.tensor([0, *torch.tensor([len(h) for h in histories]).cumsum(0).tolist()])
    padded = torch.zeros(len(histories), 8, dtype=torch.int64)
    for b, h in enumerate(histories):
        padded[b, : len(h)] = torch.tensor(h)
    with torch.no_grad():
        want = model.scores(model.last_hidden(values, offsets))
        torch.testing.assert_close(program(padded), want)
        torch.testing.assert_close(program(padded[1:2, :1]), want[1:2])  # shorter padding, batch of one


def test_logged_model_serves_raw_ids_without_ftrec(run, tmp_path):
    res, shards = run
    raw_ids = pq.read_table(os.path.join(shards, ITEM_MAP)).sort_by("id").column("raw_id").to_pylist()
    histories = [raw_ids[:3], [raw_ids[40], "no-such-item", raw_ids[7]], raw_ids[:30], ["no-such-item"], []]
    out = tmp_path / "pred.json"
    _isolated_python(
        SERVE,
        [f"runs:/{res['mlflow_run_id']}/model", json.dumps(histories), str(out)],
        cwd=tmp_path,
        timeout=300,
        env={"MLFLOW_TRACKING_URI": res["tracking_uri"]},
    )
    got = json.loads(out.read_text())
    assert got["leaked"] == []
    assert [len(i) for i in got["items"]] == [5, 5, 5, 0, 0]  # no known item: no recommendation
    assert [len(s) for s in got["scores"]] == [5, 5, 5, 0, 0]
    for hist, items, scores in zip(histories, got["items"], got["scores"], strict=True):
        assert set(items) <= set(raw_ids) and not set(items) & set(hist)
        assert scores == sorted(scores, reverse=True)

    # the same top 5 as SeqRec of the final checkpoint on the known, newest max_len items
    meta = checkpoint.read_meta(res["checkpoint"])
    model = SeqRec(meta["num_items"], ModelConfig(**meta["config"]["model"]))
    model.load_state_dict(checkpoint.load(res["checkpoint"])["model"])
    model.eval()
    dense = {r: i + 1 for i, r in enumerate(raw_ids)}
    for hist, items, scores in zip(histories[:3], got["items"], got["scores"], strict=False):
        known = [dense[r] for r in hist if r in dense]
        with torch.no_grad():
            s = model.scores(
                model.last_hidden(
                    torch.tensor(known[-model.cfg.max_len :]), torch.tensor([0, min(len(known), model.cfg.max_len)])
                )
            )[0]
        s[torch.tensor(known) - 1] = float("-inf")
        top = s.topk(5)
        assert items == [raw_ids[j] for j in top.indices.tolist()]
        assert scores == pytest.approx(top.values.tolist(), rel=1e-5, abs=1e-6)

    cli = got["cli"]["predictions"]
    assert [row["items"] for row in cli] == got["items"]
    print(f"predict latency, batch of 32: {got['latency_s'] * 1000:.1f} ms")


# ---------------------------------------------------------------- serving equals judging

PARITY = ISOLATE + textwrap.dedent("""
    import json
    import mlflow, pandas as pd
    uri, rows, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    model = mlflow.pyfunc.load_model(uri)
    meta = model.metadata
    frame = pd.DataFrame({"history": [r["history"] for r in rows], "timestamps": [r["timestamps"] for r in rows]})
    got = model.predict(frame, params={"k": 10})
    try:
        model.predict(pd.DataFrame({"history": [rows[0]["history"]]}))
        untimed = "served"
    except Exception as e:
        untimed = str(e)
    readme = open(mlflow.artifacts.download_artifacts(uri + "/artifacts/README.md")).read()
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("training", "dataprep", "ftcore"))
    inputs = {c["name"]: c.get("required", True) for c in json.loads(meta.signature.inputs.to_json())}
    with open(out, "w") as f:
        json.dump({"items": got["items"].tolist(), "scores": got["scores"].tolist(), "leaked": leaked,
                   "metadata": meta.metadata, "inputs": inputs, "untimed": untimed, "readme": readme}, f)
""")


@pytest.fixture(scope="module", params=["sasrec", "hstu-timed"])
def registered(request, tmp_path_factory):
    """A short run on timestamped synthetic events, its model registered in a real MLflow store."""
    d = tmp_path_factory.mktemp(request.param)
    write_synthetic(str(d / "ev.parquet"), users=200, items=90, seed=5, fmt="events", median_len=12, max_history=40)
    build_shards(str(d / "ev.parquet"), "events", str(d / "shards"), world_size=1, batch_size=16, max_len=16)
    model = ["model.attention=hstu", "model.rel_bias=pos+time"] if request.param == "hstu-timed" else []
    uri = f"sqlite:///{d / 'mlflow.db'}"
    sets = [
        f"data.shards={d / 'shards'}",
        f"train.out={d / 'run'}",
        "train.max_steps=20",
        "model.dim=16",
        "model.num_heads=2",
        "loss.kind=sampled_softmax",
        "loss.num_negatives=16",
        "eval.periodic=false",
        "mlflow.plots=false",
        "mlflow.system_metrics=false",
        f"mlflow.tracking_uri={uri}",
        "mlflow.register=true",
        f"mlflow.model_name=parity-{request.param}",
        *model,
    ]
    res = train(load_config(None, sets))
    assert res["mlflow_unsent"] == 0
    return request.param, res, str(d / "shards"), uri


def _judged(res: dict, shards: str, users: int):
    """The first `users` test users as training.evaluate scores them: inputs, times, and the
    scores of model.last_hidden -> model.scores with the history excluded, as evaluate does."""
    from training.config import config_from_dict
    from training.evaluate import EvalData

    meta = checkpoint.read_meta(res["checkpoint"])
    cfg = config_from_dict(meta["config"])
    model = SeqRec(meta["num_items"], cfg.model)
    model.load_state_dict(checkpoint.load(res["checkpoint"])["model"])
    model.eval()
    s = EvalData(os.path.join(shards, "eval.parquet"), meta["num_items"], cfg.model.max_len, cfg.eval).splits["test"]
    b = int(s.offsets[users])
    values, offsets = s.values[:b], s.offsets[: users + 1]
    ts = s.timestamps[:b] if s.timestamps is not None else None
    with torch.no_grad():
        scores = model.scores(model.last_hidden(values, offsets, timestamps=ts))
    rows = torch.repeat_interleave(torch.arange(users), offsets[1:] - offsets[:-1])
    scores[rows, values - 1] = float("-inf")
    histories = [values[offsets[u] : offsets[u + 1]].tolist() for u in range(users)]
    times = [
        ts[offsets[u] : offsets[u + 1]].tolist() if ts is not None else [0] * len(h) for u, h in enumerate(histories)
    ]
    return histories, times, scores


def test_the_registered_model_serves_what_evaluation_judged(registered, tmp_path):
    kind, res, shards, uri = registered
    raw_ids = pq.read_table(os.path.join(shards, ITEM_MAP)).sort_by("id").column("raw_id").to_pylist()
    histories, times, scores = _judged(res, shards, users=24)
    rows = [{"history": [raw_ids[i - 1] for i in h], "timestamps": t} for h, t in zip(histories, times, strict=True)]
    out = tmp_path / "parity.json"
    _isolated_python(
        PARITY,
        [f"models:/parity-{kind}/1", json.dumps(rows), str(out)],
        cwd=tmp_path,
        timeout=300,
        env={"MLFLOW_TRACKING_URI": uri},
    )
    got = json.loads(out.read_text())
    assert got["leaked"] == []
    top = scores.topk(10)
    worst = 0.0
    for u in range(len(rows)):
        assert got["items"][u] == [raw_ids[j] for j in top.indices[u].tolist()], u
        diff = max(abs(a - b) for a, b in zip(got["scores"][u], top.values[u].tolist(), strict=True))
        assert diff < 1e-5, (u, diff)
        worst = max(worst, diff)
    print(f"{kind}: served vs judged, 24 users, top-10: max abs score difference {worst:.2e}")
    timed = kind == "hstu-timed"
    assert got["metadata"]["timed"] is timed and got["inputs"] == {"history": True, "timestamps": timed}
    assert ("REQUIRED" in got["readme"]) is timed and "timestamps" in got["metadata"]["inputs"]
    if timed:  # without the times it was judged with, the model refuses instead of serving other scores
        assert "missing inputs ['timestamps']" in got["untimed"]
    else:
        assert got["untimed"] == "served"
