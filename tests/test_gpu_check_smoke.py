"""The prepared device script (`python benchmarks/gpu_check.py`) runs end to end on CPU in its
reduced mode (--cpu), so it is known to work before a GPU is lent: all three parts, the table,
the JSON. Its CPU figures mean nothing; only that every part ran and passed its checks."""

import json

import pytest
from conftest import run_python

pytestmark = pytest.mark.integ


def test_gpu_check_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = run_python(
        ["benchmarks/gpu_check.py", "--cpu", "--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", "240"],
        300,
    )
    assert r.returncode == 0, r.stdout[-5000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["mode"] == "cpu"
    ft = res["ft"]
    assert ft["identical"] and ft["restarts"] == 1 and ft["healed"] and ft["fails"] == []
    sd = res["slowdown"]
    assert set(sd["rows"]) == {"none", "gloo_all_to_all", "smfree_copy_engines"} and sd["fails"] == []
    tp = res["throughput"]["rows"]
    assert {(r["attention"], r["shards"]) for r in tp} == {
        (a, s) for a in ("sasrec", "hstu") for s in ("balanced", "random")
    }
    assert all(r["tokens_per_s"] > 0 for r in tp)
    for head in ("## 1. ft", "## 2. slowdown", "## 3. non-padding tokens/s"):
        assert head in r.stdout
